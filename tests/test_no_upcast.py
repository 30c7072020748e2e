"""No silent float64 upcast anywhere in a float32 training step.

`autograd.Function.apply` is wrapped here (monkeypatched for the test only) so that every
op records the dtype of each floating array it receives (inputs and array options such as
masks), of each output, of each gradient arriving in its backward and of each gradient it
returns. After forward, cross-entropy with label smoothing, backward, clip_grad_norm_ and
two Adam steps, every one of them, every parameter, gradient and optimizer state must be
float32.
"""
import numpy as np
import pytest

import autograd
import npformer
from autograd import backend
from npformer import functional as F
from npformer import models, optim


def _floating(values):
    return [v for v in values if backend.is_array(v) and v.dtype.kind in "fc"]


@pytest.fixture
def recorded(monkeypatch):
    """A list of (op name, what, dtype) filled by every Function call and backward."""
    records = []
    original_apply = autograd.Function.apply.__func__

    def apply(cls, *args, **options):
        raw = [a.data if isinstance(a, autograd.Tensor) else a for a in args]
        for a in _floating(raw + list(options.values())):
            records.append((cls.__name__, "forward input", a.dtype))
        results = original_apply(cls, *args, **options)
        outputs = results if isinstance(results, tuple) else (results,)
        for t in outputs:
            records.append((cls.__name__, "forward output", t.dtype))
        ctx = outputs[0].creator
        if ctx is not None:
            def backward(node, *grads):
                for g in _floating(grads):
                    records.append((cls.__name__, "incoming gradient", g.dtype))
                input_grads = cls.backward(node, *grads)
                returned = input_grads if isinstance(input_grads, tuple) else (input_grads,)
                for g in _floating(returned):
                    records.append((cls.__name__, "input gradient", g.dtype))
                return input_grads
            ctx.backward = backward  # the tape calls node.backward(node, *grads)
        return results

    monkeypatch.setattr(autograd.Function, "apply", classmethod(apply))
    return records


@pytest.mark.parametrize("activation, positional", [("relu", "sinusoidal"), ("gelu", "learned")])
def test_float32_training_step_stays_float32(recorded, rng, activation, positional):
    npformer.manual_seed(0)
    model = models.Seq2SeqTransformer(13, 11, d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                      dim_feedforward=32, dropout=0.1, max_len=16, activation=activation,
                                      positional=positional, pad_idx=0)
    model.train()
    optimizer = optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-2)
    src = rng.integers(0, 13, (3, 7))
    tgt = rng.integers(0, 11, (3, 6))
    tgt[0, -2:] = 0  # padding: masks and ignore_index take part
    for _ in range(2):
        logits = model(src[:, :], tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 11), tgt[:, 1:].reshape(-1), ignore_index=0,
                               label_smoothing=0.1)
        optimizer.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()

    ops = {name for name, _, _ in recorded}
    assert {"LinearFunction", "AttentionFunction", "LayerNormFunction", "DropoutFunction", "CrossEntropyFunction", "EmbeddingFunction"} <= ops
    assert any(what == "input gradient" for _, what, _ in recorded)
    upcasts = sorted({(name, what, str(dtype)) for name, what, dtype in recorded if dtype != np.float32})
    assert not upcasts, f"ops that saw or made a non-float32 floating array: {upcasts}"
    assert loss.dtype == np.float32
    for name, p in model.named_parameters():
        assert p.dtype == np.float32, name
        assert p.grad is not None and p.grad.dtype == np.float32, name
    states = [v for state in optimizer.state.values() for v in state.values() if backend.is_array(v)]
    assert len(states) == 2 * len(list(model.parameters()))
    assert all(v.dtype == np.float32 for v in states), sorted({str(v.dtype) for v in states})
