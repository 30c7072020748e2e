"""No host round trip inside a training step: on the test device (which counts every
device-to-host read: as_numpy, bool/int/float of an array, .item(), .tolist(), printing), a full
step of Seq2SeqTransformer (forward, label-smoothed cross-entropy with ignore_index, backward,
clip_grad_norm_, Adam) reads nothing on the host until `loss.item()`. Ids and targets that
arrive as host arrays are checked on the host before their copy; ids already on the device are
checked there and reported when the loss is read (npformer.runtime.deferred)."""
import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import backend
from npformer import models, optim
from npformer.runtime import deferred, testdevice

VOCAB, PAD = 31, 0


@pytest.fixture
def step():
    npformer.manual_seed(0)
    model = models.Seq2SeqTransformer(VOCAB, VOCAB, d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                      dim_feedforward=32, dropout=0.1, pad_idx=PAD).to("test")
    model.train()
    opt = optim.Adam(model.parameters(), lr=1e-3)

    def run(src, tgt_in, tgt_out):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD, label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss
    return run


def batch(seed=0):
    rng = np.random.default_rng(seed)
    src, tgt_in, tgt_out = (rng.integers(1, VOCAB, (4, 7)) for _ in range(3))
    src[1, 5:] = tgt_out[2, 4:] = PAD
    return src, tgt_in, tgt_out


def test_a_training_step_reads_nothing_on_the_host_before_the_loss(step):
    device_batch = [backend.to_device(a, "test") for a in batch()]
    step(*device_batch).item()                                   # the optimizer state exists from here on
    testdevice.transfers.clear()
    loss = step(*[backend.to_device(a, "test") for a in batch(1)])
    assert testdevice.transfers["device_to_host"] == 0, dict(testdevice.transfers)
    assert np.isfinite(loss.item())
    assert testdevice.transfers["device_to_host"] >= 1


def test_the_transfer_counter_sees_every_kind_of_host_read():
    x = backend.to_device(np.arange(3.0), "test")
    testdevice.transfers.clear()
    bool(x[0]), int(x[1]), float(x[2]), x.sum().item(), x.tolist(), backend.as_numpy(x), repr(x)
    assert testdevice.transfers["device_to_host"] == 7
    assert {k.split(":")[1] for k in testdevice.transfers if ":" in k} == {
        "bool", "int", "float", "item", "tolist", "as_numpy", "repr"}


def test_host_ids_out_of_range_raise_at_once_device_ids_when_the_loss_is_read(step):
    src, tgt_in, tgt_out = batch()
    src[0, 0] = VOCAB
    with pytest.raises(IndexError, match=rf"src token ids must be in \[0, {VOCAB - 1}\].*max {VOCAB}"):
        step(src, tgt_in, tgt_out)                               # host ids: checked before the copy
    deferred.discard_pending()
    device_batch = [backend.to_device(a, "test") for a in (src, tgt_in, tgt_out)]
    loss = step(*device_batch)                                   # device ids: the step runs (CuPy wraps them)
    with pytest.raises(IndexError, match=rf"token ids must be in \[0, {VOCAB - 1}\].*max {VOCAB}"):
        loss.item()
    assert np.isfinite(loss.item())                              # reported once


def test_device_targets_out_of_range_or_all_ignored_raise_when_the_loss_is_read():
    logits = npformer.Tensor(np.zeros((3, 4)), device="test", requires_grad=True)
    loss = F.cross_entropy(logits, backend.to_device(np.array([0, 9, 1]), "test"))
    with pytest.raises(IndexError, match=r"target class indices must be in \[0, 3\].*max 9"):
        loss.item()
    loss = F.cross_entropy(logits, backend.to_device(np.array([-100, -100, -100]), "test"))
    with pytest.raises(ValueError, match="every target equals ignore_index=-100"):
        loss.numpy()
    with pytest.raises(ValueError, match="every target equals ignore_index=-100"):
        F.cross_entropy(logits, np.array([-100, -100, -100]))    # host targets: at once
