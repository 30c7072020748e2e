"""Checkpoints: round trip, atomic saves, clear errors on damaged files, exact resumption,
loading onto another device. Uses a tiny stand-in model (two Parameters and dropout drawn
from the global generator); the Transformer round trip is in test_training.py."""
import os

import numpy as np
import pytest

import npformer
from autograd import Tensor, backend, manual_seed, random
from npformer import checkpoint, optim
from npformer.nn.module import Module, Parameter


class TinyNet(Module):
    """y = dropout(relu(x W1)) W2 with dropout from the global generator of the device."""

    def __init__(self, d_in=4, d_hidden=8, device="cpu"):
        super().__init__()
        rng = random.global_rng(device)
        self.w1 = Parameter(backend.to_device(rng.standard_normal((d_in, d_hidden)).astype("float32"), device))
        self.w2 = Parameter(backend.to_device(rng.standard_normal((d_hidden, 1)).astype("float32"), device))
        self.config = {"d_in": d_in, "d_hidden": d_hidden}

    def forward(self, x):
        h = (x @ self.w1).relu()
        keep = random.global_rng(self.w1.device).random(h.shape) >= 0.25
        return (h * Tensor(keep.astype("float32") / 0.75)) @ self.w2


def _setup(device="cpu", seed=0):
    manual_seed(seed)
    model = TinyNet(device=device)
    opt = optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.01)
    sched = optim.NoamLR(opt, d_model=8, warmup_steps=3)
    return model, opt, sched


def _train(model, opt, sched, data_rng, steps):
    losses = []
    for _ in range(steps):
        x = data_rng.standard_normal((16, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        pred = model(Tensor(backend.to_device(x, model.w1.device)))
        loss = ((pred - Tensor(backend.to_device(y, model.w1.device))) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_round_trip(tmp_path):
    model, opt, sched = _setup()
    data_rng = np.random.default_rng(1)
    _train(model, opt, sched, data_rng, 3)
    path = npformer.save_checkpoint(tmp_path / "ck.npz", model, opt, sched, step=3,
                                    history={"loss": [1.5, 0.25], "pair": (1, "a")},
                                    table={0: np.arange(3)}, data_rng=data_rng)
    other, other_opt, other_sched = _setup(seed=1)
    ck = npformer.load_checkpoint(path, other, other_opt, other_sched)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    assert ck["config"] == {"d_in": 4, "d_hidden": 8} and ck["step"] == 3
    assert ck["history"] == {"loss": [1.5, 0.25], "pair": (1, "a")}
    np.testing.assert_array_equal(ck["table"][0], np.arange(3))
    assert ck["data_rng"].random() == data_rng.random()
    assert other_sched.get_last_lr() == sched.get_last_lr() and other_sched.last_epoch == 3
    ours, theirs = opt.state_dict(), other_opt.state_dict()
    for i, state in ours["state"].items():
        assert theirs["state"][i]["step"] == state["step"] == 3
        np.testing.assert_array_equal(theirs["state"][i]["exp_avg_sq"], state["exp_avg_sq"])
    assert theirs["param_groups"][0]["lr"] == ours["param_groups"][0]["lr"]


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path):
    model, opt, sched = _setup()
    expected = _train(model, opt, sched, np.random.default_rng(7), 10)

    model, opt, sched = _setup()
    data_rng = np.random.default_rng(7)
    first = _train(model, opt, sched, data_rng, 5)
    npformer.save_checkpoint(tmp_path / "ck.npz", model, opt, sched, data_rng=data_rng)
    manual_seed(1234)  # a new process: other random state, fresh objects
    random.global_rng("cpu").random(10)
    model, opt, sched = _setup(seed=99)
    ck = npformer.load_checkpoint(tmp_path / "ck.npz", model, opt, sched)
    rest = _train(model, opt, sched, ck["data_rng"], 5)
    assert first + rest == expected  # bit for bit


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = _setup()
    path = tmp_path / "ck.npz"
    npformer.save_checkpoint(path, model, opt, step=1)
    before = sorted(os.listdir(tmp_path))

    def broken_writer(fileobj, arrays):
        fileobj.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoint, "_write_npz", broken_writer)
    _train(model, opt, sched, np.random.default_rng(0), 1)
    with pytest.raises(OSError, match="simulated"):
        npformer.save_checkpoint(path, model, opt, step=2)
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file left behind
    assert npformer.load_checkpoint(path)["step"] == 1


def test_damaged_files_raise_a_clear_error(tmp_path):
    model, opt, _ = _setup()
    path = tmp_path / "ck.npz"
    npformer.save_checkpoint(path, model, opt, step=1)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flipped.npz"
    flipped.write_bytes(data[:200] + bytes([data[200] ^ 0xFF]) + data[201:])
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a checkpoint at all")
    for bad in (truncated, flipped, garbage):
        with pytest.raises(checkpoint.CheckpointError, match=str(bad.name)):
            npformer.load_checkpoint(bad)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.zeros(2))
    with pytest.raises(checkpoint.CheckpointError, match="foreign.npz.*not a"):
        npformer.load_checkpoint(foreign)
    with pytest.raises(FileNotFoundError):
        npformer.load_checkpoint(tmp_path / "missing.npz")


def test_state_follows_the_model_device(tmp_path):
    model, opt, sched = _setup("cpu")
    _train(model, opt, sched, np.random.default_rng(0), 2)
    npformer.save_checkpoint(tmp_path / "ck.npz", model, opt, sched)
    on_test, opt_test, sched_test = _setup("test")
    npformer.load_checkpoint(tmp_path / "ck.npz", on_test, opt_test, sched_test)
    assert all(p.device == "test" for p in on_test.parameters())
    assert all(backend.device_of(v) == "test"
               for s in opt_test.state.values() for v in s.values() if backend.is_array(v))
    np.testing.assert_array_equal(on_test.w1.numpy(), model.w1.numpy())
    _train(on_test, opt_test, sched_test, np.random.default_rng(0), 1)  # and it trains there


def test_bad_state_arguments(tmp_path):
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="reserved"):
        npformer.save_checkpoint(tmp_path / "ck.npz", model, config={})
    with pytest.raises(TypeError, match="object"):
        npformer.save_checkpoint(tmp_path / "ck.npz", model, thing=object())
    with pytest.raises(checkpoint.CheckpointError, match="no optimizer"):
        npformer.save_checkpoint(tmp_path / "ck.npz", model)
        npformer.load_checkpoint(tmp_path / "ck.npz", optimizer=optim.SGD(model.parameters(), lr=0.1))
