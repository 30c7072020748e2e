"""What the explorer shows, as a JSON-ready dict: attention snapshots of a seq2seq model on a few
held-out examples (P and dL/dP of every layer, head and attention kind, recorded with
`npformer.nn.record_attention`), and the training curves of a Trainer's history.

The arrays are stored exactly as recorded, float32 (little-endian, base64): the page computes
the row sum r_i = sum_k P_ik dL/dP_ik and dL/dS_ij = P_ij (dL/dP_ij - r_i) from them in float64.
"""
from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from autograd import backend

from .. import functional as F
from ..data import BOS, EOS, NUM_SPECIAL, PAD, SequenceTask
from ..nn import Module, record_attention

FORMAT = "npformer-explorer/1"
KINDS = ("encoder_self", "decoder_self", "cross")
# which token row is the query side and which the key side of each attention kind
SIDES = {"encoder_self": ("src", "src"), "decoder_self": ("tgt_in", "tgt_in"), "cross": ("tgt_in", "src")}
TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder self-attention (causal)",
          "cross": "cross-attention (decoder queries, encoder keys)"}
DIGITS = 7  # significant digits of a float32 (24-bit significand: 7.2 decimal digits)


def kind_of(name: str) -> str:
    """The attention kind of a Seq2SeqTransformer's attention module from its name."""
    if name.endswith("multihead_attn"):
        return "cross"
    return "decoder_self" if ".decoder." in f".{name}" else "encoder_self"


def layer_index(name: str) -> int:
    """'transformer.decoder.layers.1.self_attn' -> 1."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def token_labels(task: SequenceTask, ids: Sequence[int]) -> list[str]:
    """The ids of one sequence as the page shows them: symbols (1..V-3), PAD, BOS, EOS."""
    special = {PAD: "PAD", BOS: "BOS", EOS: "EOS"}
    return [special.get(int(i)) or str(int(i) - NUM_SPECIAL + 1) for i in ids]


def pick_examples(task: SequenceTask, count: int) -> list[int]:
    """Indices of `count` held-out sequences of different lengths, the first of length 8 (or the
    longest there is: the demo's figures use it), then the longest and the shortest."""
    heldout = task.heldout
    longest = max(len(s) for s in heldout)
    wanted = list(dict.fromkeys([min(longest, 8), longest, min(len(s) for s in heldout)]))
    picked = []
    for length in wanted:
        i = next((i for i, s in enumerate(heldout) if len(s) == length and i not in picked), None)
        if i is not None and len(picked) < count:
            picked.append(i)
    picked += [i for i in range(len(heldout)) if i not in picked][:count - len(picked)]
    return picked


def masks(batch, kind: str) -> np.ndarray:
    """(Tq, Tk) bool, True where the model masks the key for the query: padding keys, and the
    future positions of the decoder's causal self-attention. One-sequence batch."""
    query, key = (getattr(batch, side)[0] for side in SIDES[kind])
    masked = np.broadcast_to(key == PAD, (len(query), len(key))).copy()
    if kind == "decoder_self":
        masked |= np.triu(np.ones((len(query), len(key)), dtype=bool), k=1)
    return masked


def encode_array(array: np.ndarray) -> str:
    """float32 little-endian bytes in base64 (what the page decodes exactly)."""
    return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")


def example_loss_and_records(model: Module, batch):
    """Teacher-forced mean cross-entropy (PAD ignored) of a one-sequence batch and its attention
    records after backward: (loss, recorder). The model runs in eval mode (no dropout)."""
    was_training = model.training
    model.eval()
    try:
        with record_attention(model) as recorder:
            logits = model(batch.src, batch.tgt_in)                                     # (1, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1),
                                   ignore_index=PAD)
            loss.backward()
    finally:
        model.train(was_training)
        model.zero_grad()  # the snapshot's parameter gradients must not reach a training step
    return loss.item(), recorder


def snapshot(model: Module, task: SequenceTask, examples: Sequence[int], step: int) -> dict[str, Any]:
    """P and dL/dP of every attention module for each held-out example (indices), the model as it
    is now (after `step` training steps): {"step", "examples": [{"loss", "P", "dLdP"}]}, P and dLdP
    {kind: [per layer: base64 float32 (H, Tq, Tk)]}."""
    out = []
    for index in examples:
        loss, recorder = example_loss_and_records(model, task.collate([task.heldout[index]]))
        arrays = {"P": {k: [] for k in KINDS}, "dLdP": {k: [] for k in KINDS}}
        for record in sorted(recorder, key=lambda r: layer_index(r.name)):
            kind = kind_of(record.name)
            arrays["P"][kind].append(encode_array(backend.as_numpy(record.weights.data)[0]))
            arrays["dLdP"][kind].append(encode_array(backend.as_numpy(record.grad)[0]))
        out.append({"loss": loss if np.isfinite(loss) else None, **arrays})   # JSON has no NaN
    return {"step": int(step), "examples": out}


def describe(model: Module, task: SequenceTask, examples: Sequence[int]) -> dict[str, Any]:
    """The parts of the data that do not change with the step: the kinds with their layer counts,
    the heads, and each example's tokens and masks."""
    layers = {kind: 0 for kind in KINDS}
    for name, _ in model.named_modules():
        if name.endswith(("self_attn", "multihead_attn")):
            layers[kind_of(name)] += 1
    described = []
    for index in examples:
        batch = task.collate([task.heldout[index]])
        described.append({"index": int(index), "src": token_labels(task, batch.src[0]),
                          "tgt_in": token_labels(task, batch.tgt_in[0]),
                          "tgt_out": token_labels(task, batch.tgt_out[0]),
                          "masks": {kind: masks(batch, kind).astype(int).tolist() for kind in KINDS}})
    return {"format": FORMAT, "dtype": "float32", "digits": DIGITS, "heads": int(model.config["nhead"]),
            "kinds": [{"name": k, "title": TITLES[k], "layers": layers[k], "query": SIDES[k][0], "key": SIDES[k][1]}
                      for k in KINDS if layers[k]],
            "examples": described, "snapshots": [], "curves": {}}


def _rounded(values):
    return [None if v is None or not np.isfinite(v) else float(f"{float(v):.{DIGITS}g}") for v in values]


def curves(history: dict[str, Any]) -> dict[str, Any]:
    """The lines the page draws, from a Trainer's history: per step the batch loss and token
    accuracy, the held-out evaluations, and the gradient norm of each layer (before clipping)."""
    evals = {k[len("eval_"):]: _rounded(v) for k, v in history.items()
             if k.startswith("eval_") and k != "eval_step" and isinstance(v, list)
             and not all(isinstance(x, int) for x in v)}
    return {"step": list(history.get("step", [])), "loss": _rounded(history.get("loss", [])),
            "accuracy": _rounded(history.get("accuracy", [])), "eval_step": list(history.get("eval_step", [])),
            "eval": evals, "grad_norm_step": list(history.get("layer_grad_norm_step", [])),
            "grad_norm": {name: _rounded(v) for name, v in history.get("layer_grad_norm", {}).items()}}


class Collector:
    """Snapshots of a model while it trains: `collector.take(step)` at the steps to keep;
    `collector.data(history)` is the explorer's data with the history's curves."""

    def __init__(self, model: Module, task: SequenceTask, examples: Sequence[int], title: str = ""):
        self.model, self.task, self.examples = model, task, list(examples)
        self._data = describe(model, task, self.examples)
        self._data["title"] = title

    def take(self, step: int) -> None:
        self._data["snapshots"].append(snapshot(self.model, self.task, self.examples, step))

    def steps(self) -> list[int]:
        """The steps of the snapshots taken so far."""
        return [s["step"] for s in self._data["snapshots"]]

    def adopt(self, path: str | os.PathLike, until: int) -> bool:
        """Take over the snapshots up to step `until` of an explorer.json written for the same
        examples and model shape (a resumed run continues its explorer). False, adopting nothing,
        when the file does not fit (or cannot be read)."""
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return False
        same = all(saved.get(k) == self._data[k] for k in ("format", "heads", "kinds", "examples"))
        if not same:
            return False
        self._data["snapshots"] = [s for s in saved["snapshots"] if s["step"] <= until]
        return bool(self._data["snapshots"])

    def data(self, history: dict[str, Any] | None = None) -> dict[str, Any]:
        """The explorer's data: what `describe` gives, the snapshots, and the history's curves."""
        return {**self._data, "curves": curves(history or {})}
