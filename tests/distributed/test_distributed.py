"""Data parallelism for real: 2-rank MPI jobs (`mpiexec -n 2`, started here as subprocesses
with timeouts) run tests/distributed/distributed_worker.py. 2 ranks with B/2 each end with the float64
parameters of one process with B, on every rank; through the Trainer with padding and
ignore_index; ZeRO-1 equals unsharded; checkpoints move between 1 and 2 ranks; a rank that
leaves early (an exception in any thread, sys.exit, os._exit, SIGKILL) ends the whole job within
seconds, and the last checkpoint stays loadable; under npformer.distributed.launch a rank that
vanishes (os._exit(0), SIGKILL) also fails the job naming it, and Ctrl-C reaches the ranks;
ranks with different models are told how.

Skipped (with the reason) without mpi4py or mpiexec; under CI (CI set) their absence fails."""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import npformer
from npformer.runtime import threads
from npformer.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")
IN_CI = bool(os.environ.get("CI"))
TOLERANCE = 1e-10  # parameters of order 0.1-1 after 20 steps; every sum differs only in its order
SCENARIOS = ["sgd", "adam", "test_device", "trainer_padding", "zero", "lm_trainer", "no_sync",
             "unused_parameters", "resume_across_world_sizes", "collectives",
             "failed_backward", "unfrozen_after_wrapping"]


def find_mpiexec():
    """mpiexec beside this Python (the `mpich` wheel puts it there) or on PATH; None if absent or
    if mpi4py is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="module")
def mpiexec():
    found = find_mpiexec()
    if found is None:
        if IN_CI:
            pytest.fail("mpi4py and mpiexec are required under CI: install the dev extra (`make test`)")
        pytest.skip("mpi4py or mpiexec not installed: pip install -e '.[mpi]'")
    return found


def environment():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def launch(mpiexec, *args, ranks=2):
    return [mpiexec, "-n", str(ranks), sys.executable, *map(str, args)]


def launcher(mpiexec, *args, ranks=2):
    """The same job through npformer's launcher (which finds the same mpiexec beside this Python)."""
    return [sys.executable, "-m", "npformer.distributed.launch", "-n", str(ranks), *map(str, args)]


@pytest.fixture(scope="module")
def results(mpiexec, tmp_path_factory):
    """Every scenario in one 2-rank job: {rank: {scenario: results}}."""
    out = tmp_path_factory.mktemp("ddp")
    run = subprocess.run(launch(mpiexec, WORKER, out, *SCENARIOS), env=environment(), capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)} | {"out": out}


ENDS_LIKE_ONE_PROCESS = {  # scenario: 2 ranks with B/2 each against one process with B, float64
    "sgd": "20 steps of SGD with momentum, the README's loop",
    "adam": "20 steps of Adam",
    "test_device": "Adam on the 'test' device: buckets staged through host buffers (CUDA without "
                   "CUDA-aware MPI takes this path)",
    "lm_trainer": "the generic Trainer: a causal LM on padded batches sharded by RandomBatches",
    "no_sync": "the gradient after two micro-batches under no_sync and a third that synchronises",
}


@pytest.mark.parametrize("scenario", ENDS_LIKE_ONE_PROCESS)
def test_two_ranks_with_half_batches_end_like_one_process(results, scenario):
    for rank in (0, 1):
        assert results[rank][scenario]["max_difference"] < TOLERANCE, (rank, results[rank][scenario])


def test_trainer_with_padding_and_ignore_index_matches_one_process(results):
    for rank in (0, 1):
        r = results[rank]["trainer_padding"]
        assert r["first_batch_tokens_per_rank"][0] != r["first_batch_tokens_per_rank"][1]  # unequal shards
        assert r["max_difference"] < TOLERANCE and r["loss_difference"] < TOLERANCE
        # the held-out set split across the ranks and gathered scores like one process
        assert r["result"] == r["reference_result"]


def test_zero1_equals_unsharded_and_keeps_half_the_state(results):
    for rank in (0, 1):
        r = results[rank]["zero"]
        assert r["max_difference"] == 0.0  # the same arithmetic on the same gradients
        assert r["state_numel"] < 0.6 * r["unsharded_state_numel"]
    assert results[0]["zero"]["state_numel"] + results[1]["zero"]["state_numel"] == \
        results[0]["zero"]["unsharded_state_numel"]


def test_no_sync_accumulates_then_synchronises(results):
    for rank in (0, 1):
        assert results[rank]["no_sync"]["max_difference"] < TOLERANCE


def test_parameters_unused_on_some_ranks(results):
    for rank in (0, 1):
        r = results[rank]["unused_parameters"]
        assert r["max_difference"] == 0.0 and r["never_grad_is_none"]


def test_a_backward_that_raised_on_every_rank_leaves_the_next_one_averaged(results):
    for rank in (0, 1):
        assert results[rank]["failed_backward"]["max_difference"] < TOLERANCE


def test_a_parameter_unfrozen_after_wrapping_is_averaged(results):
    for rank in (0, 1):
        r = results[rank]["unfrozen_after_wrapping"]
        assert r["max_difference"] < TOLERANCE and not r["b_grad_none"]


def test_collectives_on_views_0d_empty_and_integer_arrays(results):
    for rank in (0, 1):
        assert results[rank]["collectives"]["wrong"] == [], rank


def test_checkpoints_move_between_one_and_two_ranks(results):
    for rank in (0, 1):  # saved by one process, continued on 2 ranks (ZeRO-1)
        assert results[rank]["resume_across_world_sizes"]["one_to_two_max_difference"] < TOLERANCE
    # saved by 2 ranks at step 5 (sharded optimizer state, gathered on rank 0), continued here alone
    import distributed_worker as worker
    trainer = worker.seq2seq_trainer(worker.seq2seq(seed=9))
    trainer.resume(results["out"] / "two_ranks.npz")
    assert trainer.step == 5
    trainer.fit(10)
    expected = results[0]["resume_across_world_sizes"]["two_ranks_final"]
    for name, p in trainer.module.named_parameters():
        np.testing.assert_allclose(p.data, expected[name], rtol=0, atol=TOLERANCE, err_msg=name)


FAULT_SECONDS = 30  # docs/distributed.md promises a few seconds; generous for a loaded machine


def run_fault(mpiexec, out, scenario, through=launch, env=None):
    """Run a fault scenario as a 2-rank job (`through`: launch, plain mpiexec, or launcher);
    returns (returncode, stderr, seconds). A job still running after FAULT_SECONDS is a hang:
    it is killed (the launcher's mpiexec too) and the test fails."""
    start = time.monotonic()
    job = subprocess.Popen(through(mpiexec, WORKER, out, scenario), env=env or environment(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=FAULT_SECONDS)
    except subprocess.TimeoutExpired:
        kill_job(job, out)
        _, stderr = job.communicate()
        pytest.fail(f"{scenario}: the job still ran after {FAULT_SECONDS} s (a rank waits forever)\n{stderr}")
    return job.returncode, stderr, time.monotonic() - start


def kill_job(job, out):
    """SIGKILL the job's process group and the ranks that wrote OUT/pid<r> (the launcher starts
    mpiexec in a session of its own, and mpiexec each rank in one)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    for pid_file in out.glob("pid*"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_an_exception_on_one_rank_aborts_the_job(mpiexec, tmp_path):
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, "raise")
    assert returncode != 0
    assert "rank 1 of 2: unhandled exception" in stderr and "a deliberate failure on rank 1" in stderr


@pytest.mark.parametrize("scenario", ["sys_exit", "sys_exit_zero"])
def test_a_rank_that_leaves_the_program_early_ends_the_job(mpiexec, tmp_path, scenario):
    """Rank 1 calls sys.exit(3) / sys.exit(0) after step 3 (SystemExit reaches no exception hook):
    rank 0, waiting in a collective rank 1 never joins, names it and aborts the job."""
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, scenario)
    assert returncode != 0, stderr
    assert "rank 0 of 2: rank 1 left the program" in stderr and "which rank 1 will never join" in stderr, stderr


def test_an_exception_in_a_thread_aborts_the_job(mpiexec, tmp_path):
    """Rank 1's training thread raises; its main thread would then end normally."""
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, "thread_raises")
    assert returncode != 0, stderr
    assert "rank 1 of 2: unhandled exception in thread 'trainer'" in stderr, stderr
    assert "a deliberate failure in a thread" in stderr


def test_a_rank_that_vanishes_with_os_exit_ends_the_job(mpiexec, tmp_path):
    """os._exit(0) on rank 1 runs no more code: MPICH's mpiexec ends rank 0, and its exit status
    is the vanished rank's own, 0 here (what the launcher is for; see docs/distributed.md)."""
    returncode, _, _ = run_fault(mpiexec, tmp_path, "os_exit")
    assert not list(tmp_path.glob("rank*.json"))  # neither rank reached the end
    assert returncode == 0


def launcher_environment(tmp_path):
    """environment() with TMPDIR in tmp_path, to see that the launcher removes its folder."""
    (tmp_path / "tmp").mkdir()
    return dict(environment(), TMPDIR=str(tmp_path / "tmp"))


LEFT = "npformer.distributed.launch: rank 1 left before the others (no normal exit: killed, or os._exit)"


def test_under_the_launcher_a_rank_that_vanishes_with_os_exit_fails_the_job(mpiexec, tmp_path):
    env = launcher_environment(tmp_path)
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, "os_exit", through=launcher, env=env)
    assert returncode == 1, stderr
    assert LEFT + "; mpiexec then ended rank 0 (mpiexec's exit status: 0)" in stderr, stderr
    assert not list((tmp_path / "tmp").iterdir())  # the launcher's folder is gone


def test_under_the_launcher_a_normal_job_exits_0(mpiexec, tmp_path):
    env = launcher_environment(tmp_path)
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, "uneven_end", through=launcher, env=env)
    assert returncode == 0, stderr
    assert "npformer.distributed.launch" not in stderr
    assert {p.name for p in tmp_path.glob("rank*.json")} == {"rank0.json", "rank1.json"}
    assert not list((tmp_path / "tmp").iterdir())


@pytest.mark.parametrize("scenario", ["raise", "sys_exit"])
def test_under_the_launcher_a_rank_that_aborts_keeps_its_message(mpiexec, tmp_path, scenario):
    """The rank that ends the job with MPI_Abort says why; the launcher blames no one."""
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, scenario, through=launcher)
    assert returncode != 0, stderr
    assert ("a deliberate failure on rank 1" if scenario == "raise" else "rank 1 left the program") in stderr
    assert "npformer.distributed.launch" not in stderr, stderr


def test_ranks_that_end_at_different_times_finish_normally(mpiexec, tmp_path):
    """Rank 0 works alone for a while after the last collective (figures, say), rank 1 ends first."""
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, "uneven_end")
    assert returncode == 0, stderr
    assert {p.name for p in tmp_path.glob("rank*.json")} == {"rank0.json", "rank1.json"}


def test_ranks_with_different_models_are_told_the_first_difference(mpiexec, tmp_path):
    returncode, stderr, _ = run_fault(mpiexec, tmp_path, "different_models")
    assert returncode != 0
    assert ("DistributedDataParallel expects the same model on every rank: parameter "
            "'transformer.encoder.layers.0.linear1.weight': shape (32, 16) on rank 0, (48, 16) on rank 1") in stderr


def start_training(mpiexec, tmp_path, through):
    """A 2-rank job training for a long time (a checkpoint every 2 steps), once it has saved one."""
    job = subprocess.Popen(through(mpiexec, WORKER, tmp_path, "train_with_checkpoints"), env=environment(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ((tmp_path / "checkpoint.npz").exists() and (tmp_path / "pid0").exists()
               and (tmp_path / "pid1").exists()):
        assert job.poll() is None, job.stderr.read()
        if time.monotonic() > deadline:
            kill_job(job, tmp_path)
            pytest.fail("no checkpoint within 60 s")
        time.sleep(0.05)
    time.sleep(0.3)  # in the middle of training, perhaps of a save
    return job


@pytest.mark.parametrize("through", [launch, launcher])
def test_a_rank_killed_with_sigkill_ends_the_job_and_the_checkpoint_loads(mpiexec, tmp_path, through):
    job = start_training(mpiexec, tmp_path, through)
    try:
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = job.communicate(timeout=60)
        assert job.returncode != 0 and time.monotonic() - killed < 60
        if through is launcher:
            assert LEFT in stderr, stderr
    finally:
        if job.poll() is None:
            kill_job(job, tmp_path)
            job.wait()
    ckpt = load_checkpoint(tmp_path / "checkpoint.npz", restore_rng=False)
    assert ckpt["step"] > 0 and ckpt["step"] % 2 == 0
    model, _ = npformer.load_model(tmp_path / "checkpoint.npz")
    assert sum(p.size for p in model.parameters()) > 0


def test_the_launcher_passes_ctrl_c_to_the_ranks(mpiexec, tmp_path):
    """SIGINT to the launcher alone (its mpiexec runs in a session of its own) reaches the ranks
    through mpiexec: KeyboardInterrupt on each ends the job."""
    job = start_training(mpiexec, tmp_path, launcher)
    try:
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=FAULT_SECONDS)
        assert job.returncode != 0 and "KeyboardInterrupt" in stderr, stderr
    finally:
        if job.poll() is None:
            kill_job(job, tmp_path)
            job.wait()
    assert not [pid for pid in (int(p.read_text()) for p in tmp_path.glob("pid*")) if running(pid)]


def running(pid):
    """Whether a process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the demo's figures need matplotlib")
def test_reverse_demo_distributed(mpiexec, tmp_path):
    run = subprocess.run(launch(mpiexec, ROOT / "demos" / "reverse.py", "--distributed", "--preset", "seed",
                                "--steps", "12", "--out", tmp_path, "--quiet"),
                         env=environment(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["ranks"] == 2 and metrics["steps"] == 12 and metrics["heldout_sequences"] == 1000
    if "NPFORMER_NUM_THREADS" not in os.environ:  # the two ranks share the cores
        assert metrics["threads_per_rank"] == max(1, threads.available_cores() // 2)
    assert {"checkpoint.npz", "curves.png", "grad_norms.png"} <= {p.name for p in tmp_path.iterdir()}
    assert run.stdout.count("held-out (1000 unseen sequences)") == 1  # rank 0 alone reports (results on stdout)
    assert load_checkpoint(tmp_path / "checkpoint.npz", restore_rng=False)["step"] == 12
