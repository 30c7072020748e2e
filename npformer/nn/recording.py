"""Record the attention probabilities P of every MultiheadAttention of a model, and the gradient
of the loss with respect to them, dL/dP.

    with nn.record_attention(model) as recorder:
        loss = loss_of(model(...))
        loss.backward()
    for record in recorder:          # one per attention call, in call order
        record.name                  # 'transformer.decoder.layers.1.multihead_attn'
        record.weights               # P, a Tensor (B, H, Tq, Tk)
        record.grad                  # dL/dP, an array (B, H, Tq, Tk), after backward

Why a recorder: inside an attention module the output is O = P V, but the fused op computes
O without exposing P as a graph node, so `retain_grad()` on the weights that
`need_weights=True` returns gives zeros (they are a side output that the loss never reads,
as in torch). While recording, each attention module's `hook_pattern` (npformer.nn.hook_points)
has a hook, so the module computes S, P = softmax(S), dropout(P) and dropout(P) V as separate
autograd ops; the hook keeps P with `retain_grad()`, so after `backward()` P's gradient is the
loss's dL/dP. The model's outputs, losses and parameter gradients are those of the usual
path (the same dropout masks too); only the memory-efficient and flash kernels are not used.
Only the thread that opened the block records (like grad mode, recording is per thread).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

from autograd import Tensor
from autograd.backend import Array

from .attention import MultiheadAttention
from .module import Module


class AttentionRecord:
    """One call of an attention module while recording.

    name: the module's name in the model (`model.named_modules()`), e.g.
    'transformer.encoder.layers.0.self_attn'. module: the MultiheadAttention.
    weights: the attention probabilities P, a Tensor (B, H, Tq, Tk) (before dropout).
    grad: dL/dP, an array like P once a backward pass has reached it, else None.
    """

    def __init__(self, name: str, module: MultiheadAttention, weights: Tensor):
        self.name, self.module, self.weights = name, module, weights

    @property
    def grad(self) -> Array | None:
        """dL/dP (B, H, Tq, Tk), an array, once a backward pass has reached P; else None."""
        grad = self.weights.grad
        return None if grad is None else grad.data

    def __repr__(self):
        return f"AttentionRecord({self.name!r}, weights {self.weights.shape}, grad {'set' if self.grad is not None else None})"


class AttentionRecorder:
    """The records of one `record_attention` block, in call order: iterate over it, index it by
    position, or by module name (`recorder['transformer.decoder.layers.1.multihead_attn']`, the
    one call of that module; `recorder.all(name)` when it ran several times, as in decoding)."""

    def __init__(self):
        self.records = []

    def __iter__(self) -> Iterator[AttentionRecord]:
        return iter(self.records)

    def __len__(self):
        return len(self.records)

    def all(self, name: str) -> list[AttentionRecord]:
        """Every record of the module called `name`, in call order."""
        return [r for r in self.records if r.name == name]

    def names(self) -> list[str]:
        """The names of the modules that ran, in order of their first call."""
        return list(dict.fromkeys(r.name for r in self.records))

    def __getitem__(self, key):
        if not isinstance(key, str):
            return self.records[key]
        found = self.all(key)
        if len(found) != 1:
            raise KeyError(f"{key!r}: " + (f"ran {len(found)} times while recording; use recorder.all(name)" if found
                                           else f"no such attention call; recorded: {self.names()}"))
        return found[0]


class record_attention:
    """Context manager: while it is open, every MultiheadAttention inside `model` records its
    attention probabilities P (and, after backward, dL/dP) into the recorder it returns.

    Works for any model made of npformer.nn modules (Seq2SeqTransformer, CausalLM,
    EncoderClassifier, a bare MultiheadAttention). Records hold the Tensors of the graph, so
    open it for one forward/backward at a time. For the duration, each module's hook_pattern
    has a hook (beside any of yours); only the calls of the thread that opened the block are
    recorded (other threads using the model meanwhile get the same outputs, unrecorded).
    Raises ValueError for a model without attention, RuntimeError when a block is already open
    on it (in any thread).
    """

    def __init__(self, model: Module):
        self.modules = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiheadAttention)]
        if not self.modules:
            raise ValueError(f"record_attention: {type(model).__name__} has no MultiheadAttention module")
        self.recorder = AttentionRecorder()
        self.handles = []

    def __enter__(self):
        busy = [name or "(the model)" for name, m in self.modules if "recording_attention" in m.__dict__]
        if busy:
            raise RuntimeError(f"record_attention: already recording {busy}; close the other block first")
        self.thread = threading.get_ident()
        for name, module in self.modules:
            module.__dict__["recording_attention"] = self
            self.handles.append(module.hook_pattern.add_hook(self._recording_hook(name, module)))
        return self.recorder

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for _, module in self.modules:
            if module.__dict__.get("recording_attention") is self:
                del module.__dict__["recording_attention"]
        return False

    def _recording_hook(self, name, module):
        def record(probs, hook):
            """hook_pattern's hook: P (B, H, T, S) kept with retain_grad, recorded."""
            if threading.get_ident() == self.thread:  # another thread: not recorded
                self.recorder.records.append(AttentionRecord(name, module, probs.retain_grad()))
        return record
