"""Checkpoints: model, optimizer, scheduler, step, config and random state in one `.npz` file.

Layout of the file (a plain numpy `.npz`, readable with `numpy.load(path)`):
- `meta`: a JSON string: format/version, the model's class name (`model_class`) and `config`,
  the optimizer's and scheduler's state (with arrays replaced by references), the random state
  of the global generators (`npformer.runtime.random.global_rng`, dropout and initialisation) and every
  extra `**state` value (step, trainer history, the data generator's state, ...);
- one array per model parameter (`model/<name>`), per optimizer state entry
  (`optimizer/state/<i>/<name>`) and per array inside `**state`, stored uncompressed.

Saving is atomic and keeps the file's mode (npformer.files.atomic_write). Loading trusts nothing in the file:
it never unpickles, never picks a function by a name read from the file, checks every array's
declared size before allocating it (`archive`), checks the metadata's structure (`packing`),
and validates the model, optimizer, scheduler and random state before changing any of them.
docs/checkpoints.md describes the format and the checks.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
from typing import Any

import numpy as np

from npformer.runtime import random

from ..files import atomic_write
from ..models import MODEL_CLASSES
from ..models.pretrained import check_layer_counts
from ..nn import Module
from ..nn.config import RUNTIME_SETTINGS, TransformerConfig, stored_config
from ..optim import Optimizer
from .archive import Archive, CheckpointError
from .packing import bit_generator, pack, unpack

__all__ = ["save_checkpoint", "load_checkpoint", "load_model", "CheckpointError"]

FORMAT, VERSION = "npformer-checkpoint", 1
_SECTIONS = ("config", "model", "optimizer", "scheduler", "rng")   # every checkpoint has these
_RESERVED = ("format", "version", "model_class") + _SECTIONS
_DEFAULT_MODEL_CLASS = "Seq2SeqTransformer"  # files written before the class was stored


# -- random state ------------------------------------------------------------------------
def _model_device(model):
    for p in model.parameters():
        return p.device
    return "cpu"


def _rng_state(devices):
    """{"cpu": bit generator state} of the host's global generator (the initialisers; CuPy's
    generator exposes no portable state), and {"dropout": {"seed", "offset"}}: the dropout
    stream's two ints, so that a resumed run draws the masks of an uninterrupted one, on any device."""
    state = {device: random.global_rng(device).bit_generator.state for device in devices if device == "cpu"}
    state["dropout"] = random.dropout_stream().state_dict()
    return state


def _dropout_state(state, path):
    """The saved dropout stream state, checked by loading it into a scratch stream."""
    try:
        random.Philox().load_state_dict(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: metadata rng/dropout: {e}") from e
    return dict(state)


def _rng_generators(states, path):
    """({device: bit generator} set to the states of a checkpoint's `rng` entry, the dropout
    stream's state or None), each checked."""
    if not isinstance(states, dict):
        raise CheckpointError(f"{path}: metadata rng: expected a dict, got {type(states).__name__}")
    generators, dropout = {}, None
    for device, state in states.items():
        if device == "dropout":
            dropout = _dropout_state(state, path)
        elif device == "cpu":
            generators[device] = bit_generator(state, f"{path}: metadata rng/{device}")
        else:
            raise CheckpointError(f"{path}: metadata rng/{device}: unknown generator (a checkpoint holds the "
                                  "'cpu' one and the dropout stream)")
    return generators, dropout


def _prepare_rng_restore(states, path):
    """The function that sets the global generators and the dropout stream to `states` (it
    cannot fail), after checking that each state fits its generator."""
    generators, dropout = _rng_generators(states, path)
    for device, generator in generators.items():
        own = random.global_rng(device).bit_generator
        if type(generator) is not type(own):
            raise CheckpointError(f"{path}: metadata rng/{device}: a {type(generator).__name__} state for the "
                                  f"global {type(own).__name__} generator")

    def restore():
        for device, generator in generators.items():
            random.global_rng(device).bit_generator.state = generator.state
        if dropout is not None:  # files written before the Philox stream have none
            random.dropout_stream().load_state_dict(dropout)

    return restore


# -- saving ------------------------------------------------------------------------------
def _write_npz(fileobj, arrays):
    np.savez(fileobj, **arrays)  # stored, not compressed: a member's size is its array's size


def save_checkpoint(path: str | os.PathLike, model: Module, optimizer: Optimizer | None = None, scheduler: Any = None,
                    **state: Any) -> str | os.PathLike:
    """Write model (its class name, config and state), optimizer, scheduler, global random state
    and `**state` to `path`.

    state: anything nested (up to 64 levels) of bool/numeric arrays, numbers, strings, lists,
    tuples, dicts and numpy Generators (e.g. `step=1000, trainer=trainer.state_dict()`), given
    back by load_checkpoint. The write is atomic (temporary file + fsync + os.replace) and keeps
    the mode of the file it replaces; temporaries left by killed saves are removed. Returns `path`.
    ValueError for a `state` name the format reserves (config, model, optimizer, ...), TypeError
    / ValueError for a value it cannot store. torch.save's role for npformer, without pickle.
    """
    reserved = sorted(set(state) & set(_RESERVED))
    if reserved:
        raise ValueError(f"state: the names {reserved} are reserved by the checkpoint format")
    arrays = {}
    meta = {
        "format": FORMAT, "version": VERSION, "model_class": type(model).__name__,
        "config": pack(stored_config(model), "config", arrays),
        "model": pack(model.state_dict(), "model", arrays),
        "optimizer": pack(optimizer.state_dict(), "optimizer", arrays) if optimizer is not None else None,
        "scheduler": pack(scheduler.state_dict(), "scheduler", arrays) if scheduler is not None else None,
        "rng": pack(_rng_state(sorted({"cpu", _model_device(model)})), "rng", arrays),
    }
    meta.update({k: pack(v, f"state/{k}", arrays) for k, v in state.items()})
    arrays["meta"] = np.array(json.dumps(meta))

    def write(tmp):
        with open(tmp, "wb") as f:
            _write_npz(f, arrays)

    return atomic_write(path, write)


# -- loading -----------------------------------------------------------------------------
def _read(path):
    """The checkpoint dict of `path`, every section checked for its structure."""
    with Archive(path) as archive:
        meta = archive.meta
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not an npformer checkpoint (no '{FORMAT}' format tag)")
        version = meta.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise CheckpointError(f"{path}: metadata version: expected an int >= 1, got {str(version)[:80]}")
        if version > VERSION:
            raise CheckpointError(f"{path}: checkpoint format version {version} is newer than this "
                                  f"npformer's ({VERSION})")
        missing = [key for key in _SECTIONS if key not in meta]
        if missing:
            raise CheckpointError(f"{path}: the metadata lacks the entries {missing}")
        ckpt = {k: unpack(v, archive, k) for k, v in meta.items() if k not in ("format", "version")}
    ckpt.setdefault("model_class", None)  # files written before the class was stored
    _check_section(path, "model_class", ckpt["model_class"], str, "a class name")
    _check_section(path, "config", ckpt["config"], dict, "a dict with string keys")
    _check_section(path, "model", ckpt["model"], dict, "a dict of arrays with string keys")
    for name, value in (ckpt["model"] or {}).items():
        if not isinstance(value, np.ndarray):
            raise CheckpointError(f"{path}: metadata model/{name}: expected an array, got {type(value).__name__}")
    for key in ("optimizer", "scheduler"):
        _check_section(path, key, ckpt[key], dict, "a dict")
    _rng_generators(ckpt["rng"], path)
    return ckpt


def _check_section(path, where, value, kind, expected):
    """`value` must be None or of `kind` (dicts with string keys only)."""
    if value is None:
        return
    if not isinstance(value, kind) or (kind is dict and not all(isinstance(k, str) for k in value)):
        raise CheckpointError(f"{path}: metadata {where}: expected None or {expected}, got {str(value)[:80]}")


def _config_differences(saved, model):
    """'key: file X, model Y' for every config entry where the file and `model.config` differ
    (an entry missing on one side counts as the default of the model's constructor, or of
    nn.TransformerConfig for an nn module; its runtime settings never differ)."""
    own = stored_config(model)
    if not isinstance(own, dict) or not isinstance(saved, dict):
        return []
    if isinstance(model.config, TransformerConfig):  # an entry a file lacks has the config's default
        saved = {k: v for k, v in saved.items() if k not in RUNTIME_SETTINGS}
        defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    else:
        try:
            defaults = {name: p.default for name, p in inspect.signature(type(model)).parameters.items()
                        if p.default is not inspect.Parameter.empty}
        except (TypeError, ValueError):
            defaults = {}
    absent = "(absent)"
    differences = []
    for key in sorted(set(own) | set(saved), key=str):
        theirs, mine = saved.get(key, defaults.get(key, absent)), own.get(key, defaults.get(key, absent))
        if not _same(theirs, mine):
            differences.append(f"{key}: file {theirs!r}, model {mine!r}")
    return differences


def _same(a, b):
    """Equal values of one type (two real numbers compare by value: 8 and 8.0, np.int64(8))."""
    real = (int, float, np.integer, np.floating)
    numbers = all(isinstance(v, real) and not isinstance(v, (bool, np.bool_)) for v in (a, b))
    if type(a) is not type(b) and not numbers:
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # values without a truth value, e.g. arrays
        return False


def _checked_load(path, target, key, state):
    """The function that loads `state` into `target` (it cannot fail), after checking it."""
    if key == "model":
        return target.prepare_load_state_dict(state)  # RuntimeError listing what does not fit, as torch's
    try:
        return target.prepare_load_state_dict(state)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {key} state: {e}") from e


def load_checkpoint(path: str | os.PathLike, model: Module | None = None, optimizer: Optimizer | None = None,
                    scheduler: Any = None, restore_rng: bool = True, strict_config: bool = True,
                    state_targets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a checkpoint; load it into whichever of model/optimizer/scheduler are given.

    Everything is checked before anything changes: a failed load leaves the model, optimizer,
    scheduler and random generators as they were. State arrays follow the devices of the
    objects they are loaded into. With restore_rng, the global random generators (dropout,
    initialisation) continue from the saved state.

    strict_config: when the file's model config differs from `model.config` in any entry
    (nhead, activation, norm_first, positional, layer_norm_eps, pad_idx, dropout, ...) refuse
    with a CheckpointError listing the differences, even when the shapes fit; pass False to
    load the weights into a differently configured model on purpose.

    state_targets: {name: object} for `**state` entries saved by save_checkpoint (e.g.
    {"trainer": trainer}), each with `prepare_load_state_dict(state)` (check, then return the
    function that loads), checked and loaded with the rest.

    Returns a dict: "config" (rebuild with `Seq2SeqTransformer(**config)`, or use `load_model`),
    "model_class" (None in files written before it was stored), "model"/"optimizer"/"scheduler"
    (their state dicts), "rng", and every `**state` value given to save_checkpoint (numpy
    Generators come back as Generators).
    Raises FileNotFoundError, IsADirectoryError, RuntimeError when the model's keys or shapes
    do not fit (as torch's load_state_dict), or CheckpointError (a ValueError) naming the path
    for everything else: a damaged, foreign or malformed file, a config mismatch, an optimizer
    or scheduler state that does not fit.
    """
    path = os.fspath(path)
    ckpt = _read(path)
    loads, others = [], []
    for target, key in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler")):
        if target is None:
            continue
        if ckpt[key] is None:
            raise CheckpointError(f"{path}: the checkpoint has no {key} state to load")
        if hasattr(target, "prepare_load_state_dict"):
            loads.append(_checked_load(path, target, key, ckpt[key]))
        else:  # another kind of object (e.g. a wrapper): loaded by its own load_state_dict, first
            others.append((target, ckpt[key]))
        differences = _config_differences(ckpt["config"], model) if key == "model" and strict_config else []
        if differences:
            raise CheckpointError(f"{path}: the checkpoint's config differs from the model's: "
                                  + "; ".join(differences) + ". Rebuild the model from the file "
                                  "(npformer.load_model) or pass strict_config=False to load anyway")
    for key, target in (state_targets or {}).items():
        if key in _RESERVED or key not in ckpt:
            raise CheckpointError(f"{path}: the checkpoint has no {key!r} state to load")
        loads.append(_checked_load(path, target, key, ckpt[key]))
    if restore_rng:
        loads.append(_prepare_rng_restore(ckpt["rng"], path))
    for target, state in others:
        target.load_state_dict(state)
    for load in loads:
        load()
    return ckpt


def _model_class(path, ckpt):
    name = _DEFAULT_MODEL_CLASS if ckpt["model_class"] is None else ckpt["model_class"]
    if name not in MODEL_CLASSES:
        raise CheckpointError(f"{path}: the checkpoint holds a {name!r}; load_model rebuilds "
                              f"{sorted(MODEL_CLASSES)}. Build the model yourself and call "
                              "npformer.load_checkpoint(path, model)")
    return MODEL_CLASSES[name]


def _check_shapes(path, name, expected, arrays):
    """CheckpointError unless the file's model arrays have exactly the shapes the config implies."""
    missing = [k for k in expected if k not in arrays]
    unexpected = [k for k in arrays if k not in expected]
    misshaped = [f"{k}: file {arrays[k].shape}, config {tuple(expected[k])}" for k in expected
                 if k in arrays and arrays[k].shape != tuple(expected[k])]
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:8])}" + (", ..." if len(keys) > 8 else "")
                for what, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                   ("mis-shaped keys", misshaped)) if keys]
    if problems:
        raise CheckpointError(f"{path}: the arrays do not match the {name} that the file's config describes "
                              f"(nothing was built): " + "; ".join(problems))


def load_model(path: str | os.PathLike, device: str | None = None) -> tuple[Module, dict[str, Any]]:
    """Rebuild the npformer model saved at `path` from its class name, config and weights alone,
    on `device` (default cpu), in eval mode, in the dtype of the saved weights (float64 weights
    give a float64 model). Returns (model, checkpoint dict).

    The class comes from the fixed `npformer.models.MODEL_CLASSES` (files written before the
    class was stored are Seq2SeqTransformer). Before anything is built, the parameter shapes
    that the config implies (`cls.state_shapes(config)`) must equal the arrays in the file, so a
    config declaring a huge model next to small arrays fails at once. Raises FileNotFoundError,
    IsADirectoryError or CheckpointError naming the path.
    """
    path = os.fspath(path)
    ckpt = _read(path)
    cls = _model_class(path, ckpt)
    name, config, arrays = cls.__name__, ckpt["config"], ckpt["model"]
    if not config or arrays is None:
        raise CheckpointError(f"{path}: the checkpoint has no model config and weights to rebuild the model from")
    try:
        bound = inspect.signature(cls).bind(**config)
    except TypeError as e:
        raise CheckpointError(f"{path}: the config does not fit {name}({e})") from e
    bound.apply_defaults()
    try:
        check_layer_counts(bound.arguments, sum(a.size > 0 for a in arrays.values()))
        expected = cls.state_shapes(bound.arguments)
        every_array = cls.state_shapes(bound.arguments, persistent=False)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: config: {e}") from e
    _check_shapes(path, name, expected, arrays)
    weights = sum(math.prod(shape) for shape in expected.values())
    derived = {k: shape for k, shape in every_array.items() if k not in expected}
    if sum(math.prod(shape) for shape in derived.values()) > max(weights, 1 << 24):
        raise CheckpointError(f"{path}: the config implies derived buffers {derived} larger than the model's "
                              f"{weights} weights (nothing was built)")
    try:
        model = cls(**config)
    except Exception as e:  # the constructor's own checks of an untrusted config (ValueError, TypeError, ...)
        raise CheckpointError(f"{path}: cannot build {name} from the file's config "
                              f"({type(e).__name__}: {e})") from e
    if {a.dtype for a in arrays.values() if a.dtype.kind == "f"} == {np.dtype("float64")}:
        model.double()
    if device is not None:
        model.to(device)
    try:
        model.load_state_dict(arrays)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: {e}") from e
    model.eval()
    return model, ckpt
