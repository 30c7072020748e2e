"""Intra-op threads on the CPU, like torch's: `set_num_threads(n)`.

numpy releases the GIL inside its loops (ufuncs, reductions, BLAS, random draws), so a
kernel run on n blocks of rows in n threads takes about 1/n of the time on n cores. With
n > 1 threads the ops of npformer.functional split their work into row blocks: the GEMMs
of linear and attention, softmax, layer norm, dropout (masks too), ReLU, cross-entropy.
A kernel covers rows [start, stop) and writes only there (or returns a partial result),
so row-wise results do not depend on n (column sums, e.g. a bias gradient, add one partial
sum per block). CuPy arrays and small work (under MIN_PARALLEL_ENTRIES) run as one block.

Because npformer then splits the GEMMs itself, numpy's BLAS must run one thread: with its
own threads the two pools would compete for the cores (OpenBLAS's idle workers spin for a
while after every GEMM). set_num_threads(n > 1) does that through threadpoolctl when it is
installed (and restores BLAS's threads at set_num_threads(1)); without it, set
OPENBLAS_NUM_THREADS=1 (or MKL_NUM_THREADS=1) yourself.

Default: 1 thread (each op runs in the caller; BLAS keeps its own threads), or the
NPFORMER_NUM_THREADS environment variable.
"""
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

from autograd import backend
from autograd.checks import check_int

# below this many entries touched, handing a block to a thread (~20 us) costs more than it saves
MIN_PARALLEL_ENTRIES = 1 << 16

_state = {"threads": None, "pool": None, "blas_limit": None}
_lock = threading.Lock()     # guards _state: set_num_threads may run while other threads run ops
_local = threading.local()  # .busy: this thread is running a block (nested splits run whole)


def get_num_threads():
    """Threads that npformer's ops use on the CPU (like torch.get_num_threads)."""
    if _state["threads"] is None:
        value = os.environ.get("NPFORMER_NUM_THREADS", "1")
        if not value.strip().isdigit():
            raise ValueError(f"NPFORMER_NUM_THREADS must be an integer >= 1, got {value!r}")
        set_num_threads(int(value))
    return _state["threads"]


def set_num_threads(n):
    """Split the work of every op across `n` threads (an int >= 1) on the CPU; with n > 1
    numpy's BLAS is limited to one thread (via threadpoolctl), since npformer splits the GEMMs."""
    n = check_int(n, "n", "set_num_threads", at_least=1)
    with _lock:
        if n > 1 and _state["blas_limit"] is None:
            _state["blas_limit"] = _limit_blas_threads()
        elif n == 1 and _state["blas_limit"] is not None:
            _state["blas_limit"].restore_original_limits()
            _state["blas_limit"] = None
        # the old pool is dropped, not shut down: ops in flight in other threads keep using it,
        # and its idle workers exit once the last of them lets go of it (garbage collection)
        _state.update(threads=n, pool=None)


def _limit_blas_threads():
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        warnings.warn("npformer.set_num_threads(n > 1) splits the GEMMs across its own threads; install "
                      "threadpoolctl or set OPENBLAS_NUM_THREADS=1 so that numpy's BLAS does not also "
                      "start threads", stacklevel=3)
        return None
    return threadpool_limits(1, user_api="blas")


def _forget_pool():  # a forked child has none of the parent's threads (and a lock nobody will release)
    global _lock
    _lock = threading.Lock()
    _state["pool"] = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def row_blocks(rows, entries, like=None):
    """[(start, stop), ...]: contiguous blocks covering range(rows), one per thread when the
    array `like` lives in host memory (None: it does; "cuda" and "test" do not) and the work touches at least
    MIN_PARALLEL_ENTRIES `entries`; otherwise the single block (0, rows)."""
    threads = min(get_num_threads(), rows)
    if (threads < 2 or entries < MIN_PARALLEL_ENTRIES or getattr(_local, "busy", False)
            or (like is not None and backend.device_of(like) != "cpu")):
        return [(0, rows)]
    bounds = [rows * i // threads for i in range(threads + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _run_marked(kernel, start, stop):
    _local.busy = True
    try:
        return kernel(start, stop)
    finally:
        _local.busy = False


def run_blocks(kernel, blocks):
    """[kernel(start, stop) for each block], the first block in the caller, the others in the pool."""
    if len(blocks) == 1:
        return [kernel(*blocks[0])]
    with _lock:
        if _state["pool"] is None:
            _state["pool"] = ThreadPoolExecutor(max(_state["threads"] - 1, 1), thread_name_prefix="npformer")
        pool = _state["pool"]
    futures = [pool.submit(_run_marked, kernel, *block) for block in blocks[1:]]
    try:
        first = _run_marked(kernel, *blocks[0])
    finally:  # never leave a block running behind the caller's back, even on an error
        wait(futures)
    return [first] + [f.result() for f in futures]


def for_rows(kernel, rows, entries, like=None):
    """run_blocks(kernel, row_blocks(rows, entries, like)): kernel(start, stop) per block of rows."""
    return run_blocks(kernel, row_blocks(rows, entries, like))
