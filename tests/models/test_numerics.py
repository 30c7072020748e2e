"""Numerics of whole models: `autograd.detect_anomaly()` on a real model names the op and the
user's line, is silent on a healthy step, and 2,000 training steps make no NaN. (The numerics of
each op, at the edges and against torch, are in its tests/functional/test_op_<family>.py.)"""
import math
import re

import numpy as np
import pytest

import autograd
import npformer
import npformer.functional as F
from npformer import optim
from npformer.data import PAD, SequenceTask
from npformer.models import Seq2SeqTransformer
from npformer.training import Seq2SeqTrainer


def small_model():
    npformer.manual_seed(0)
    return Seq2SeqTransformer(10, 10, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                              dim_feedforward=16, dropout=0.0, pad_idx=PAD)


SRC, TGT_IN, TGT_OUT = np.array([[3, 5, 4, 0]]), np.array([[1, 4, 5, 3]]), np.array([[4, 5, 3, 2]])


def test_detect_anomaly_names_the_op_and_the_line_that_called_the_model():
    model = small_model()
    model.src_embed.weight.data[5, 0] = math.inf                  # a diverged embedding row
    with np.errstate(all="ignore"):                                # without the detector: NaN logits, silently
        assert np.isnan(model(SRC, TGT_IN).numpy()).all()
    with autograd.detect_anomaly(), pytest.raises(FloatingPointError) as info:
        logits = model(SRC, TGT_IN)  # noqa: F841
    message = str(info.value)
    assert message.startswith("npformer.functional.embedding.EmbeddingFunction forward produced NaN or Inf")
    assert re.search(r'test_numerics\.py", line \d+, in test_detect_anomaly.*\n\s+logits = model\(SRC, TGT_IN\)',
                     message), message


def test_detect_anomaly_catches_an_infinite_gradient_in_backward():
    """A norm penalty on a bias that is still zero (its init): sqrt'(0) = inf in backward only."""
    model = small_model()
    bias = model.transformer.encoder.layers[0].self_attn.in_proj_bias
    assert not bias.numpy().any()
    with autograd.detect_anomaly(), np.errstate(divide="ignore", invalid="ignore"):
        loss = F.cross_entropy(model(SRC, TGT_IN).reshape(-1, 10), TGT_OUT.reshape(-1))
        penalty = (bias ** 2).sum().sqrt()
        with pytest.raises(FloatingPointError, match=r"(?s)^autograd\.ops\.Sqrt backward produced NaN or Inf.*"
                                                     r"penalty = \(bias \*\* 2\)\.sum\(\)\.sqrt\(\)"):
            (loss + 1e-3 * penalty).backward()


def test_detect_anomaly_is_silent_and_changes_nothing_on_a_healthy_step():
    grads = []
    for anomaly in (False, True):
        model = small_model()
        with autograd.detect_anomaly() if anomaly else np.errstate():
            loss = F.cross_entropy(model(SRC, TGT_IN).reshape(-1, 10), TGT_OUT.reshape(-1), label_smoothing=0.1)
            loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for with_detector, without in zip(*grads):
        np.testing.assert_array_equal(with_detector, without)


@pytest.mark.slow
def test_two_thousand_steps_at_lr_1e3_with_clipping_never_make_a_nan():
    """The seed preset's model (vocab 20, d_model 32, 4 heads, d_ff 64, 2 + 2 layers, dropout 0.1)
    on reversal of length 6 through the Trainer: Adam at lr 1e-3, clipping at 1.0, batches of 8
    (~35 s of one core: the step cost is per-op overhead, so the batch is small). Every loss and
    gradient norm (before clipping: the Trainer would skip a non-finite update) and every final
    parameter is finite, and the run learned the task rather than quietly stalling."""
    npformer.manual_seed(0)
    model = Seq2SeqTransformer(20, 20, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=64, dropout=0.1, max_len=8, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=20, min_len=6, seed=0, heldout_size=200)
    trainer = Seq2SeqTrainer(model, optim.Adam(model.parameters(), lr=1e-3), task, batch_size=8, clip_norm=1.0,
                             grad_norm_every=0, progress=False)
    result = trainer.fit(2000)
    losses, norms = np.array(trainer.history["loss"]), np.array(trainer.history["grad_norm"])
    assert len(losses) == len(norms) == 2000
    assert np.isfinite(losses).all() and np.isfinite(norms).all()
    assert all(np.isfinite(p.numpy()).all() for p in model.parameters())
    assert losses[-100:].mean() < 0.25 * losses[:100].mean(), (losses[:100].mean(), losses[-100:].mean())
    assert result["token_accuracy"] > 0.9, result
