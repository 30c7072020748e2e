"""Faults, for real: a training process is killed with SIGKILL while it is writing a checkpoint.
The previous checkpoint must survive intact, and resuming from it must end with exactly the
losses and held-out metrics of a run that was never interrupted."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import npformer
from npformer.checkpoint import CheckpointError

RUN = Path(__file__).with_name("fault_training_run.py")
STEPS, EVERY = 60, 20


def command(out, *options):
    return [sys.executable, str(RUN), str(out), "--steps", str(STEPS), "--checkpoint-every", str(EVERY), *options]


def run_to_the_end(out, *options):
    subprocess.run(command(out, *options), check=True, timeout=120, stdout=subprocess.DEVNULL)
    return json.loads((out / "metrics.json").read_text())


def temporary_files(out):
    return sorted(out.glob(".checkpoint.npz.*.tmp"))


def size(path):
    """The file's size, 0 when it is gone (a temporary file renamed into place since it was listed)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def kill_while_writing(out, deadline=60.0):
    """Start a run whose second save (step 40) writes slowly; SIGKILL it once the first save is
    complete and the second one's temporary file holds some but not all of its bytes."""
    process = subprocess.Popen(command(out, "--slow-save", "2"), stdout=subprocess.DEVNULL)
    try:
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            assert process.poll() is None, "the run ended before it could be killed"
            partial = [p for p in temporary_files(out) if size(p) > 0]
            if (out / "checkpoint.npz").exists() and partial:
                os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        else:
            pytest.fail("no checkpoint write was caught in progress")
    finally:
        process.kill()  # a no-op after SIGKILL; stops a run left over by a failed assertion
        process.wait(timeout=30)
    return process.returncode


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one_and_resume_matches(tmp_path):
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    uninterrupted.mkdir()
    interrupted.mkdir()
    expected = run_to_the_end(uninterrupted)

    assert kill_while_writing(interrupted) == -signal.SIGKILL
    # the kill landed during the write: the half-written temporary file is still there and unreadable
    (partial,) = temporary_files(interrupted)
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        npformer.load_checkpoint(partial)
    # ... and the checkpoint of step 20 is intact
    ckpt = npformer.load_checkpoint(interrupted / "checkpoint.npz", restore_rng=False)
    assert ckpt["step"] == EVERY
    np.testing.assert_array_equal(ckpt["trainer"]["history"]["loss"], expected["loss"][:EVERY])
    assert not (interrupted / "metrics.json").exists()

    resumed = run_to_the_end(interrupted, "--resume")
    assert resumed["loss"] == expected["loss"]          # steps 1..60, bit for bit
    assert resumed["lr"] == expected["lr"]
    assert resumed["final"] == expected["final"]        # held-out exact-sequence and token accuracy
    assert npformer.load_checkpoint(interrupted / "checkpoint.npz", restore_rng=False)["step"] == STEPS
