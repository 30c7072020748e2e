"""Global modes are per thread, like torch's: grad mode (`no_grad`), anomaly mode
(`detect_anomaly`) and the composite twins (`composite.installed()`) set in one thread never
change another; `set_num_threads` swaps the pool while other threads run ops in it; two
Trainers train side by side in two threads exactly as they train alone; and `detect_anomaly`
finds the user's line in a checkout that is itself named `npformer` (as `git clone` names it).

Threads meet at events in a fixed order, so each interleaving is forced, not left to luck."""
import math
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor
from npformer import optim
from npformer.data import PAD, SequenceTask
from npformer.functional import composite
from npformer.functional.linear import linear_backward, linear_forward
from npformer.models import Seq2SeqTransformer
from npformer.runtime import threads
from npformer.training import Seq2SeqTrainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
WAIT = 30  # seconds before a missed event fails the test instead of hanging it


class Worker(threading.Thread):
    """Runs `target` in a thread and keeps its exception (re-raised by `finish`)."""

    def __init__(self, target):
        super().__init__(daemon=True)
        self.target, self.error = target, None

    def run(self):
        try:
            self.target()
        except BaseException as error:  # noqa: BLE001  (handed to the test's thread)
            self.error = error

    def finish(self):
        self.join(WAIT)
        assert not self.is_alive(), "the worker thread did not finish"
        if self.error is not None:
            raise self.error


def wait(event):
    assert event.wait(WAIT), "a thread did not reach its step"


def inside_and_outside(mode, probe):
    """probe() run by a worker thread inside `with mode():` and, while it is still inside, by
    this thread: (the worker's result, this thread's)."""
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def inside():
        with mode():
            seen["inside"] = probe()
            entered.set()
            wait(checked)

    worker = Worker(inside)
    worker.start()
    wait(entered)
    try:
        seen["outside"] = probe()
    finally:
        checked.set()
        worker.finish()
    return seen["inside"], seen["outside"]


def records_a_graph():
    x = Tensor(np.ones(3), requires_grad=True)
    return (x * 2.0).sum().requires_grad


def grad_mode():
    return autograd.is_grad_enabled(), records_a_graph()


# -- grad mode ---------------------------------------------------------------------------------------
def test_no_grad_in_one_thread_leaves_gradients_on_in_another():
    assert inside_and_outside(autograd.no_grad, grad_mode) == ((False, False), (True, True))


def test_a_new_thread_starts_with_gradients_on_while_its_creator_is_in_no_grad():
    seen = []
    with autograd.no_grad():
        worker = Worker(lambda: seen.append(grad_mode()))
        worker.start()
        worker.finish()
        assert not autograd.is_grad_enabled()
    assert seen == [(True, True)]


def test_two_threads_entering_and_leaving_no_grad_interleaved_leave_gradients_on():
    """A enters, B enters, A leaves, B leaves: with one process-wide flag, B's exit would restore
    the False it saw on entry, leaving gradients off for the whole process."""
    steps = {name: threading.Event() for name in ("a_in", "b_in", "a_out")}
    after = {}

    def a():
        with autograd.no_grad():
            steps["a_in"].set()
            wait(steps["b_in"])
        after["a"] = grad_mode()
        steps["a_out"].set()

    def b():
        wait(steps["a_in"])
        with autograd.no_grad():
            steps["b_in"].set()
            wait(steps["a_out"])
        after["b"] = grad_mode()

    workers = [Worker(a), Worker(b)]
    for w in workers:
        w.start()
    for w in workers:
        w.finish()
    assert after == {"a": (True, True), "b": (True, True)} and grad_mode() == (True, True)


# -- anomaly mode ------------------------------------------------------------------------------------
def detects_a_nan():
    """Whether the detector stops an op whose forward makes a NaN (log(-1))."""
    with np.errstate(invalid="ignore"):
        try:
            Tensor(np.array([-1.0]), requires_grad=True).log()
        except FloatingPointError:
            return True
    return False


def test_detect_anomaly_is_per_thread():
    assert inside_and_outside(autograd.detect_anomaly, detects_a_nan) == (True, False)
    seen = []
    with autograd.detect_anomaly():                                # a thread started inside it has none
        worker = Worker(lambda: seen.append(detects_a_nan()))
        worker.start()
        worker.finish()
        assert detects_a_nan()
    assert seen == [False]


# -- composite twins ---------------------------------------------------------------------------------
def softmax_op():
    """The Function that made F.softmax's output: SoftmaxFunction (fused) or an autograd primitive (twin)."""
    y = F.softmax(Tensor(np.array([[1.0, 2.0, 3.0]]), requires_grad=True))
    return type(y.creator).__name__


def test_composite_installed_only_in_the_thread_that_installed_it():
    inside, outside = inside_and_outside(composite.installed, softmax_op)
    assert outside == "SoftmaxFunction" and inside != "SoftmaxFunction", (inside, outside)


# -- set_num_threads while other threads run ops -------------------------------------------------------
@pytest.fixture
def restore_num_threads():
    saved = threads.get_num_threads()
    yield
    threads.set_num_threads(saved)


def test_npformer_num_threads_must_be_an_integer(monkeypatch):
    monkeypatch.setenv("NPFORMER_NUM_THREADS", "two")
    monkeypatch.setitem(threads._state, "threads", None)          # not set yet: read from the environment
    with pytest.raises(ValueError, match="NPFORMER_NUM_THREADS must be an integer >= 1, got 'two'"):
        threads.get_num_threads()


def test_set_num_threads_from_one_thread_never_breaks_ops_in_flight_in_others(restore_num_threads,
                                                                              frequent_switches):
    """Three threads each run 50 rounds of ops big enough to use the pool (relu, softmax,
    linear) while this one keeps changing the number of threads (1 to 4) until they finish;
    every result equals the one computed alone: relu's and softmax's exactly (row blocks write
    only their own rows), linear's to rounding (OpenBLAS rounds a block of 341 rows, or a GEMM
    on one thread instead of two, differently from the whole product: ~1e-16 relative)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 256))
    w = rng.standard_normal((256, 256))
    assert x.size >= threads.MIN_PARALLEL_ENTRIES and x.size * w.shape[0] >= threads.MIN_PARALLEL_MACS

    def ops():
        return [F.relu(Tensor(x)).numpy(), F.softmax(Tensor(x)).numpy(), F.linear(Tensor(x), Tensor(w)).numpy()]

    threads.set_num_threads(1)
    expected = ops()
    bound = (np.abs(x) @ np.abs(w).T).max()

    def run_ops():
        for _ in range(50):
            relu, softmax, linear = ops()
            np.testing.assert_array_equal(relu, expected[0])
            np.testing.assert_array_equal(softmax, expected[1])
            # each entry a dot product of 256 terms: rounding within 256 eps of the sum of |terms|
            np.testing.assert_allclose(linear, expected[2], rtol=0, atol=256 * np.finfo(float).eps * bound)

    workers = [Worker(run_ops) for _ in range(3)]
    for w_ in workers:
        w_.start()
    changes = 0
    while any(w_.is_alive() for w_ in workers) or changes < 100:
        threads.set_num_threads(1 + changes % 4)
        changes += 1
    for w_ in workers:
        w_.finish()


def blas_threads():
    from threadpoolctl import threadpool_info
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_generate_runs_its_own_ops_in_the_caller_and_leaves_other_threads_and_the_setting_alone(
        restore_num_threads):
    """generate gives numpy's BLAS its threads for its few-row products and runs its ops whole
    in its own thread: other threads keep npformer's split, and a set_num_threads call made
    meanwhile stands after it (generate used to set the process's count to 1 and back)."""
    pytest.importorskip("threadpoolctl")
    from npformer import decoding, models
    threads.set_num_threads(2)
    limited = blas_threads()
    model = models.CausalLM(16, d_model=8, nhead=2, num_layers=1, dim_feedforward=16, max_len=32)
    step, seen = model.decode_step, {}
    entered, checked = threading.Event(), threading.Event()

    def decode_step(*args, **kwargs):  # the first step of generate, in the worker thread
        if not entered.is_set():
            seen["inside"] = threads.row_blocks(1024, threads.MIN_PARALLEL_ENTRIES), blas_threads()
            entered.set()
            wait(checked)
        return step(*args, **kwargs)

    model.decode_step = decode_step
    worker = Worker(lambda: decoding.generate(model, np.ones((2, 3), dtype=np.int64), 4, temperature=0.0))
    worker.start()
    wait(entered)
    try:
        outside = threads.row_blocks(1024, threads.MIN_PARALLEL_ENTRIES)
        threads.set_num_threads(3)
    finally:
        checked.set()
        worker.finish()
    assert seen["inside"][0] == [(0, 1024)] and seen["inside"][1] != limited  # in the caller, BLAS threaded
    assert outside == [(0, 512), (512, 1024)]  # this thread kept npformer's split
    assert threads.get_num_threads() == 3 and blas_threads() == limited  # the setting made meanwhile stands


def test_blas_threads_in_caller_blocks_nest_and_overlap_across_threads(restore_num_threads):
    pytest.importorskip("threadpoolctl")
    threads.set_num_threads(2)
    limited = blas_threads()
    entered, left = threading.Event(), threading.Event()

    def other():
        with threads.blas_threads_in_caller():
            entered.set()
            wait(left)

    worker = Worker(other)
    with threads.blas_threads_in_caller():
        freed = blas_threads()
        with threads.blas_threads_in_caller():
            worker.start()
            wait(entered)
        assert blas_threads() == freed  # the other thread's block is still open
    assert blas_threads() == freed and threads.row_blocks(1024, 1 << 20) == [(0, 512), (512, 1024)]
    left.set()
    worker.finish()
    assert freed != limited and blas_threads() == limited  # the last block to close limits BLAS again


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_products_too_small_to_split_run_on_blas_threads_and_give_them_back(restore_num_threads, monkeypatch,
                                                                           direction, rng):
    """A product of linear between MIN_BLAS_THREADS_MACS and the split's threshold runs whole in
    the caller with numpy's BLAS on npformer's threads; BLAS is held to one thread again after it,
    after an error inside it too, and in a block of a split (busy) nothing changes."""
    pytest.importorskip("threadpoolctl")
    threads.set_num_threads(2)
    limited = blas_threads()
    table = {"forward": linear_forward, "backward": linear_backward}[direction]
    x = rng.standard_normal((256, 64)).astype(np.float32)       # 256 * 64 * 128 = 2^21 multiply-adds
    w = rng.standard_normal((128, 64)).astype(np.float32)
    dy = rng.standard_normal((256, 128)).astype(np.float32)
    args = (np, x, w, None) if direction == "forward" else (np, dy, x, w, True, True, True)
    assert threads.MIN_BLAS_THREADS_MACS <= 256 * 64 * 128 < threads.MIN_PARALLEL_MACS
    assert dy.size + x.size < threads.MIN_PARALLEL_ENTRIES
    seen, reference = [], table.reference

    def watched(*a):
        seen.append(blas_threads())
        return reference(*a)

    monkeypatch.setattr(table, "reference", watched)
    got = table(*args)
    given = min(2, threads._state["blas_own_threads"])   # BLAS's own count caps it (every core by default)
    assert seen == [[given] * len(limited)] and blas_threads() == limited
    expected = reference(*args)
    as_tuple = (lambda r: r if isinstance(r, tuple) else (r,))
    for g, e in zip(as_tuple(got), as_tuple(expected)):
        scale = np.abs(e).max()   # float32 sums of 64-256 terms of unit size: BLAS's threads may round differently
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * scale)

    def failing(*a):
        raise FloatingPointError("inside the product")

    monkeypatch.setattr(table, "reference", failing)
    with pytest.raises(FloatingPointError):
        table(*args)
    assert blas_threads() == limited

    monkeypatch.setattr(table, "reference", watched)
    seen.clear()
    monkeypatch.setattr(threads._local, "busy", True)   # as inside a block of a split
    table(*args)
    assert seen == [limited]


def test_blas_libraries_with_different_thread_counts_settle_on_the_fewest_without_a_warning(restore_num_threads,
                                                                                          monkeypatch):
    """Two BLAS libraries loaded with different thread counts (numpy's OpenBLAS beside another
    library's): holding BLAS to one thread keeps the fewest as its own count, and warns nothing
    (threadpoolctl's get_original_num_threads warns there, an error under `-W error`: generate()
    failed so inside a test that turns warnings into errors)."""
    class Library:
        def __init__(self, n):
            self.num_threads = n

    class Limit:
        def restore_original_limits(self):
            pass

    libraries = [Library(4), Library(2)]
    threads.set_num_threads(1)
    monkeypatch.setattr(threads, "_blas_controllers", lambda: libraries)
    monkeypatch.setattr(threads, "_limit_blas_threads", Limit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads.set_num_threads(2)
    assert threads._state["blas_own_threads"] == 2 and list(threads._state["blas_libs"]) == libraries
    threads.set_num_threads(1)                                # the fake limit given back before the fixture's


def test_set_num_threads_from_another_thread_sets_blas_threads_too(restore_num_threads):
    """threadpoolctl (>= 3.8) ignores, silently, a BLAS limit set by a thread other than the one
    that set the last: set_num_threads(1) in a worker left numpy's BLAS on one thread."""
    pytest.importorskip("threadpoolctl")
    threads.set_num_threads(2)
    limited = blas_threads()
    worker = Worker(lambda: threads.set_num_threads(1))
    worker.start()
    worker.finish()
    freed = blas_threads()
    worker = Worker(lambda: threads.set_num_threads(2))
    worker.start()
    worker.finish()
    assert freed != limited and blas_threads() == limited


# A thread still training when the script's last line has run, and an atexit handler: both run after
# Python's thread pools stop taking work (concurrent.futures, at threading's shutdown)
AFTER_THE_SCRIPT = """
import atexit, threading
import numpy as np
import npformer.functional as F
from autograd import Tensor
from npformer.runtime import random, threads
threads.set_num_threads(2)
x = Tensor(np.linspace(-1.0, 1.0, 1 << 19).reshape(1024, 512), requires_grad=True)

def step():  # ops split into blocks, and dropout masks drawn ahead from the second pass on
    stream = random.Philox(3)
    y = F.dropout(F.relu(x), 0.2, generator=stream) + F.dropout(x, 0.5, generator=stream)
    y.sum().backward()
    return F.softmax(y).numpy()

expected = [step(), step()]

def check(who):
    for want in expected:
        assert np.array_equal(step(), want)
    print(who, "ok", flush=True)

def late_thread():
    while threading.main_thread().is_alive():  # until the script has ended
        threading.Event().wait(0.01)
    check("thread")

threading.Thread(target=late_thread).start()
atexit.register(check, "atexit")
"""


def test_ops_still_run_after_the_script_ends_in_a_thread_and_at_exit():
    """A training thread that outlives the script's last line (Python waits for it) and an atexit
    handler (a last evaluation or save) run ops split across threads, and draw masks ahead, after
    Python's thread pools stopped taking work: they run in the caller, with the same results."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", AFTER_THE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.split("\n")[:2] == ["thread ok", "atexit ok"] and not run.stderr, run.stdout + run.stderr


# -- two trainers in two threads -----------------------------------------------------------------------
def trainer(seed):
    """A small seq2seq model without dropout on its own reversal task; it evaluates (decoding
    under no_grad) every 4 steps, so one thread's evaluations overlap the other's training."""
    npformer.manual_seed(seed)
    model = Seq2SeqTransformer(10, 10, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.0, max_len=8, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=10, min_len=4, seed=seed, heldout_size=16)
    return Seq2SeqTrainer(model, optim.Adam(model.parameters(), lr=3e-3), task, batch_size=8, eval_every=4,
                          eval_size=8, grad_norm_every=0, progress=False)


def fit(trainer_, steps=24):
    result = trainer_.fit(steps)
    return trainer_.history["loss"], trainer_.history["eval_exact_match"], result


def test_two_trainers_in_two_threads_train_exactly_as_alone():
    alone = [fit(trainer(seed)) for seed in (1, 2)]
    assert all(len(losses) == 24 and all(map(math.isfinite, losses)) for losses, _, _ in alone)
    for _ in range(3):                                 # the interleaving differs from run to run
        trainers = [trainer(seed) for seed in (1, 2)]  # built here: initialisation uses the global generator
        results = [None, None]

        def run(i):
            results[i] = fit(trainers[i])

        workers = [Worker(lambda i=i: run(i)) for i in (0, 1)]
        for w in workers:
            w.start()
        for w in workers:
            w.finish()
        assert results == alone


# -- detect_anomaly in a checkout named npformer --------------------------------------------------------
def test_detect_anomaly_names_the_users_line_in_a_checkout_named_npformer(tmp_path):
    """A copy of this checkout's packages and anomaly tests in <tmp>/npformer: every path there
    contains '/npformer/', yet the reported line is the test's, not '(unknown)'."""
    clone = tmp_path / "npformer"
    for name in ("autograd", "npformer"):
        shutil.copytree(ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "tests" / "models").mkdir(parents=True)
    for name in ("conftest.py", "cupy_api.txt", "models/test_numerics.py"):
        shutil.copy(ROOT / "tests" / name, clone / "tests" / name)
    shutil.copy(ROOT / "setup.cfg", clone / "setup.cfg")
    # not under CI's rules: the three tests run here compare with no torch reference
    env = {**{k: v for k, v in os.environ.items() if k != "CI"}, "PYTHONPATH": str(clone)}
    where = subprocess.run([sys.executable, "-c", "import autograd, npformer; print(autograd.__file__, "
                            "npformer.__file__)"], cwd=clone, env=env, capture_output=True, text=True, check=True)
    where = where.stdout.split()
    assert all(pathlib.Path(f).is_relative_to(clone) for f in where), where       # the copy runs, not this checkout
    run = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider",
                          "tests/models/test_numerics.py", "-k", "detect_anomaly"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout + run.stderr
