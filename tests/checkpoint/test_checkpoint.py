"""Checkpoints: round trip, atomic saves that keep the file's mode and clean up after killed
saves, loads during saves, clear errors on damaged files, exact resumption, loading onto another
device, load_model for every model class. Mostly a tiny stand-in model (two Parameters and
dropout drawn from the global generator); the Transformer round trip is in test_training.py,
malicious and malformed files in test_checkpoint_security.py."""
import os
import re
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import npformer
from autograd import Tensor, backend
from npformer import checkpoint, optim
from npformer.models import BidirectionalEncoder, CausalLM, EncoderClassifier, Seq2SeqTransformer
from npformer.runtime import random
from npformer.runtime.random import manual_seed

from checkpoint_files import meta_of, with_meta
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


# -- load_model rebuilds every npformer model ----------------------------------------------------------------
@pytest.mark.parametrize("model, inputs", [
    (lambda: CausalLM(20, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=8, tie_weights=True),
     lambda: (np.array([[1, 5, 7, 2]]),)),
    (lambda: EncoderClassifier(20, 3, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, max_len=8, pad_idx=0),
     lambda: (np.array([[4, 5, 0, 0], [1, 2, 3, 4]]),)),
    (lambda: BidirectionalEncoder(20, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, max_len=8, pooler=True,
                                  type_vocab_size=2, embed_norm=True, final_norm=False, pooling="first"),
     lambda: (np.array([[4, 5, 6]]),)),
    (lambda: Seq2SeqTransformer(10, 12, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=16, positional="rope", tie_weights=True),
     lambda: (np.array([[3, 4, 5]]), np.array([[1, 5, 4]]))),
], ids=["causal-lm", "classifier", "bidirectional-encoder", "seq2seq"])
def test_load_model_rebuilds_every_model_class(tmp_path, model, inputs):
    manual_seed(0)
    original = model().eval()
    path = npformer.save_checkpoint(tmp_path / "ck.npz", original, step=3)
    rebuilt, ckpt = npformer.load_model(path)
    assert type(rebuilt) is type(original) and ckpt["model_class"] == type(original).__name__
    assert rebuilt.config == original.config and not rebuilt.training and ckpt["step"] == 3
    ours, theirs = rebuilt(*inputs()), original(*inputs())
    for a, b in zip(ours if isinstance(ours, tuple) else (ours,), theirs if isinstance(theirs, tuple) else (theirs,)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_load_model_keeps_float64_weights_and_moves_to_a_device(tmp_path):
    original = CausalLM(20, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, max_len=8).double()
    path = npformer.save_checkpoint(tmp_path / "ck.npz", original)
    rebuilt, _ = npformer.load_model(path, device="test")
    assert {p.dtype for p in rebuilt.parameters()} == {np.dtype("float64")}
    assert {p.device for p in rebuilt.parameters()} == {"test"}
    np.testing.assert_array_equal(rebuilt.tok_embed.weight.numpy(), original.tok_embed.weight.numpy())


def test_files_without_a_model_class_are_seq2seq_and_unknown_classes_are_refused(tmp_path):
    original = Seq2SeqTransformer(10, 12, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                  dim_feedforward=16)
    path = npformer.save_checkpoint(tmp_path / "ck.npz", original)
    meta = meta_of(path)
    del meta["model_class"]  # written before the class was stored
    rebuilt, _ = npformer.load_model(with_meta(path, tmp_path / "old.npz", meta))
    assert type(rebuilt) is Seq2SeqTransformer
    for name in ("TinyNet", "Module", "os.system", "__class__"):
        meta["model_class"] = name
        message = (rf"x\.npz: the checkpoint holds a {re.escape(repr(name))}; load_model rebuilds "
                   r"\['BidirectionalEncoder', 'CausalLM', 'EncoderClassifier', 'Seq2SeqTransformer'\]")
        with pytest.raises(checkpoint.CheckpointError, match=message):
            npformer.load_model(with_meta(path, tmp_path / "x.npz", meta))
    tiny = npformer.save_checkpoint(tmp_path / "tiny.npz", TinyNet())
    with pytest.raises(checkpoint.CheckpointError, match=r"'TinyNet'.*npformer\.load_checkpoint\(path, model\)"):
        npformer.load_model(tiny)


# -- saving: the file's mode, temporaries of killed saves, concurrent loads -----------------------------------
def test_saving_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    model, opt, _ = _setup()
    path = npformer.save_checkpoint(tmp_path / "ck.npz", model, opt)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask  # a new file: as open() makes it
    for mode in (0o600, 0o640):
        os.chmod(path, mode)
        npformer.save_checkpoint(path, model, opt)
        assert stat.S_IMODE(os.stat(path).st_mode) == mode


def test_saving_through_a_symlink_replaces_the_file_it_points_to(tmp_path):
    """As open() (torch.save, numpy.savez) writes: `latest.npz -> run/ck.npz` stays a link, and
    run/ck.npz, keeping its mode, holds the new checkpoint."""
    model, opt, _ = _setup()
    (tmp_path / "run").mkdir()
    target = npformer.save_checkpoint(tmp_path / "run" / "ck.npz", model, opt, step=1)
    os.chmod(target, 0o640)
    (tmp_path / "latest.npz").symlink_to("run/ck.npz")
    assert npformer.save_checkpoint(tmp_path / "latest.npz", model, opt, step=2) == str(tmp_path / "latest.npz")
    assert os.path.islink(tmp_path / "latest.npz") and stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert npformer.load_checkpoint(target, restore_rng=False)["step"] == 2
    (tmp_path / "new.npz").symlink_to("run/new.npz")  # a dangling link: open() creates the file it names
    npformer.save_checkpoint(tmp_path / "new.npz", model, step=3)
    assert os.path.islink(tmp_path / "new.npz") and npformer.load_checkpoint(tmp_path / "run" / "new.npz")["step"] == 3
    assert sorted(os.listdir(tmp_path)) == ["latest.npz", "new.npz", "run"]
    assert sorted(os.listdir(tmp_path / "run")) == ["ck.npz", "new.npz"]


def test_saving_where_no_regular_file_can_be_is_refused_before_writing(tmp_path):
    model, _, _ = _setup()
    (tmp_path / "folder").mkdir()
    folder = re.escape(str(tmp_path / "folder"))
    with pytest.raises(IsADirectoryError, match=f"cannot write {folder}: it is a directory"):
        npformer.save_checkpoint(tmp_path / "folder", model)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(OSError, match=r"cannot write .*fifo: not a regular file \(a device, FIFO or socket\)"):
            npformer.save_checkpoint(tmp_path / "fifo", model)
        assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileExistsError, match=r"cannot write .*file/ck\.npz: cannot create the folder .*file "
                                              r"\(File exists\)"):
        npformer.save_checkpoint(tmp_path / "file" / "ck.npz", model)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "file", "folder"][0 if hasattr(os, "mkfifo") else 1:]
    assert os.listdir(tmp_path / "folder") == []


def temporary(directory, name, pid, age_s):
    path = directory / f".{name}.{pid}.{age_s:08x}.tmp"
    path.write_bytes(b"PK\x03\x04 half a checkpoint")
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def finished_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    model, _, _ = _setup()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = finished_pid()
        stale = temporary(tmp_path, "ck.npz", dead, age_s=3600)
        fresh = temporary(tmp_path, "ck.npz", dead, age_s=2)  # its writer may be on another machine, mid-write
        live = temporary(tmp_path, "ck.npz", sleeper.pid, age_s=3600)  # a live save that stalled
        ours = temporary(tmp_path, "ck.npz", os.getpid(), age_s=3600)  # another thread of this process
        other_file = temporary(tmp_path, "other.npz", dead, age_s=3600)
        foreign = tmp_path / ".ck.npz.tmp"
        foreign.write_bytes(b"not ours")
        npformer.save_checkpoint(tmp_path / "ck.npz", model)
        assert not stale.exists()
        assert all(p.exists() for p in (fresh, live, ours, other_file, foreign))
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_temporary_of_a_save_killed_midway_is_removed_by_the_next_save(tmp_path):
    code = ("import os, sys; from npformer.files import atomic_write; "
            "atomic_write(sys.argv[1], lambda tmp: (open(tmp, 'wb').write(b'PK half'), os._exit(9)))")
    killed = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ck.npz")])
    assert killed.wait(timeout=60) == 9
    (left,) = tmp_path.glob(".ck.npz.*.tmp")
    assert left.name.startswith(f".ck.npz.{killed.pid}.")
    os.utime(left, (time.time() - 3600, time.time() - 3600))
    model, _, _ = _setup()
    npformer.save_checkpoint(tmp_path / "ck.npz", model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz"]


def test_loads_during_saves_always_see_a_whole_checkpoint(tmp_path):
    model, opt, sched = _setup()
    path = npformer.save_checkpoint(tmp_path / "ck.npz", model, opt, sched, step=0)
    saves, errors, loaded = 12, [], []
    done = threading.Event()

    def save(first):
        try:
            for step in range(first, saves, 2):
                npformer.save_checkpoint(path, model, opt, sched, step=step)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def load():
        while not done.is_set():
            try:
                loaded.append(npformer.load_checkpoint(path, restore_rng=False)["step"])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

    savers = [threading.Thread(target=save, args=(first,)) for first in (0, 1)]
    reader = threading.Thread(target=load)
    reader.start()
    for t in savers:
        t.start()
    for t in savers:
        t.join()
    done.set()
    reader.join()
    assert errors == [] and loaded and set(loaded) <= set(range(saves))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz"]


def test_a_folder_that_cannot_be_written_is_a_clear_error_and_nothing_changes(tmp_path, monkeypatch):
    model, opt, _ = _setup()
    path = tmp_path / "ck.npz"
    npformer.save_checkpoint(path, model, opt, step=1)
    before = sorted(os.listdir(tmp_path))
    if os.name == "posix" and os.geteuid() == 0:  # root writes into a mode 0o555 folder: refuse as the OS would
        real_open = os.open

        def read_only_open(file, flags, *args):
            if flags & os.O_CREAT and os.path.dirname(os.fspath(file)) == str(tmp_path):
                raise PermissionError(13, "Permission denied", file)
            return real_open(file, flags, *args)
        monkeypatch.setattr(npformer.files.os, "open", read_only_open)
    else:
        tmp_path.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"cannot write {re.escape(str(path))}: cannot create a file in "
                                                  f"{re.escape(str(tmp_path))} \\(Permission denied\\)"):
            npformer.save_checkpoint(path, model, opt, step=2)  # named only the temporary file
    finally:
        tmp_path.chmod(0o755)
    assert sorted(os.listdir(tmp_path)) == before
    assert npformer.load_checkpoint(path, restore_rng=False)["step"] == 1
