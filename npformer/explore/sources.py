"""The explorer's data from a saved run: the demo's explorer.json, or snapshots recomputed from
checkpoints of demos/reverse.py (each checkpoint is one step; its "demo" entry names the task's
settings and seed, which give the held-out examples; the latest checkpoint's trainer history gives
the curves)."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from typing import Any

from ..checkpoint import CheckpointError, load_checkpoint, load_model
from ..data import SequenceTask
from .collect import FORMAT, Collector, pick_examples

DATA_FILE = "explorer.json"  # beside the checkpoints: what demos/reverse.py collected while training


class ExploreError(ValueError):
    """A source the explorer cannot use: the message names it and what was expected."""


def read_data(path: str | os.PathLike) -> dict[str, Any]:
    """The data in an explorer.json written by `page.write_data`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ExploreError(f"{path}: cannot read the explorer's data: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExploreError(f"{path}: expected the explorer's data (format {FORMAT!r}), got another JSON file")
    return data


def _checkpoint(path, with_model=True):
    """(checkpoint dict, model or None) of a checkpoint of demos/reverse.py, or ExploreError naming the file.
    with_model=False checks a file without building a model (from_checkpoints checks every file so first)."""
    if not os.path.exists(path):
        raise ExploreError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        raise ExploreError(f"{path}: a folder; give a run folder alone, or checkpoint files")
    try:  # (one read of the file: load_model returns the checkpoint dict too)
        model, ckpt = load_model(path) if with_model else (None, load_checkpoint(path, restore_rng=False))
        if not isinstance(ckpt.get("demo"), dict) or "settings" not in ckpt["demo"]:
            raise ExploreError(f"{path}: expected a checkpoint of demos/reverse.py (its 'demo' entry names the "
                               "task's settings and seed, which give the held-out examples); this one has none")
    except (CheckpointError, OSError, ValueError) as e:
        if isinstance(e, ExploreError):
            raise
        reason = str(e).removeprefix(f"{path}: ")
        raise ExploreError(f"{path}: not a checkpoint npformer can read ({reason})") from None
    return ckpt, model


def _task(demo):
    settings = demo["settings"]
    return SequenceTask(demo.get("task") or "reverse", vocab_size=settings["vocab"], min_len=settings["min_len"],
                        max_len=settings["max_len"], seed=demo["seed"])


def from_checkpoints(paths: Sequence[str | os.PathLike], examples: int = 3) -> dict[str, Any]:
    """The explorer's data recomputed from checkpoints of one run of demos/reverse.py: one
    snapshot per training step among them (a step saved twice is taken once), the curves from the
    latest one's trainer history. ExploreError naming a file that does not fit."""
    if not paths:
        raise ExploreError("expected at least one checkpoint file")
    loaded = {}
    first_demo = None
    for path in paths:
        ckpt, _ = _checkpoint(os.fspath(path), with_model=False)
        demo = {k: ckpt["demo"].get(k) for k in ("settings", "seed", "task")}
        if first_demo is None:
            first_demo, first = demo, path
        elif demo != first_demo:
            raise ExploreError(f"{path}: from another run than {first} (the demo's settings or seed differ)")
        loaded.setdefault(int(ckpt.get("step") or 0), os.fspath(path))
    task = _task(first_demo)
    collector = None
    history = {}
    for step in sorted(loaded):
        ckpt, model = _checkpoint(loaded[step])
        if collector is None:
            collector = Collector(model, task, pick_examples(task, examples),
                                  title=f"{os.path.basename(os.path.dirname(os.path.abspath(loaded[step])))}")
        collector.model = model
        collector.take(step)
        history = (ckpt.get("trainer") or {}).get("history") or history
    return collector.data(history)


def from_source(sources: Sequence[str | os.PathLike], examples: int = 3, recompute: bool = False) -> dict[str, Any]:
    """A run folder (its explorer.json, unless recompute; else its checkpoints *.npz) or a list of
    checkpoint files -> the explorer's data. ExploreError for a missing or unusable source."""
    sources = [os.fspath(s) for s in sources]
    if len(sources) == 1 and os.path.isdir(sources[0]):
        folder = sources[0]
        saved = os.path.join(folder, DATA_FILE)
        if os.path.exists(saved) and not recompute:
            return read_data(saved)
        checkpoints = sorted(glob.glob(os.path.join(folder, "*.npz")))
        if not checkpoints:
            raise ExploreError(f"{folder}: expected a run folder of demos/reverse.py, with {DATA_FILE} or checkpoint "
                               "files (*.npz); found neither")
        return from_checkpoints(checkpoints, examples)
    if len(sources) == 1 and not os.path.exists(sources[0]):
        raise ExploreError(f"{sources[0]}: no such file or folder")
    return from_checkpoints(sources, examples)
