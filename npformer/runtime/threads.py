"""Intra-op threads on the CPU, like torch's: `set_num_threads(n)`.

numpy releases the GIL inside its loops (ufuncs, reductions, BLAS, random draws), so a
kernel run on n blocks of rows in n threads takes about 1/n of the time on n cores. With
n > 1 threads the ops of npformer.functional split their work into row blocks: the GEMMs
of linear and attention, softmax, layer norm, GELU, ReLU, the dropout masks.
A kernel covers rows [start, stop) and writes only there (or returns a partial result),
so row-wise results do not depend on n (column sums, e.g. a bias gradient, add one partial
sum per block). CuPy arrays and small work (under MIN_PARALLEL_ENTRIES) run as one block.

Because npformer then splits the GEMMs itself, numpy's BLAS must run one thread: with its
own threads the two pools would compete for the cores (OpenBLAS's idle workers spin for a
while after every GEMM). set_num_threads(n > 1) does that through threadpoolctl when it is
installed (and restores BLAS's threads at set_num_threads(1)); without it, set
OPENBLAS_NUM_THREADS=1 (or MKL_NUM_THREADS=1) yourself (set_num_threads(n > 1) warns). A product
of linear too small to split but big enough (MIN_BLAS_THREADS_MACS) runs whole in the caller with
BLAS's threads given back for the call (run_on_blas_threads).

Default, like torch's intra-op threads: NPFORMER_NUM_THREADS when set, else one thread per
core this process may run on (len(os.sched_getaffinity(0)), os.cpu_count() where that is
missing) when threadpoolctl is installed. Without threadpoolctl (numpy is npformer's only
dependency) the default is 1, silently: each op runs in the caller and numpy's BLAS threads
the GEMMs with its own threads, since npformer could not stop BLAS from competing with its
pool. Results are the same for any number of threads, bit for bit, except the GEMMs' last
bits: BLAS may round a block of rows differently from the whole product, and a product on its
own threads differently from one on one thread (OpenBLAS does). The default is chosen at the first op
(or get_num_threads()), not at import.
"""
import contextlib
import os
import queue
import sys
import threading
import warnings
import weakref

from autograd import backend
from autograd.checks import check_int

# below this many entries touched, a block handed to a thread costs more than it saves (the hand-off,
# and two threads of short numpy calls waiting on each other for the GIL): BENCHMARKS.md, "Thresholds"
MIN_PARALLEL_ENTRIES = 1 << 18
# a product (m, k) @ (k, n) is split when it has at least this many multiply-adds m k n, whatever its
# output's size (a weight gradient (out, N) @ (N, in) has few entries and many multiply-adds)
MIN_PARALLEL_MACS = 1 << 24
# linear's products too small to split but with at least this many multiply-adds run whole on numpy's
# BLAS threads (run_on_blas_threads), whose idle workers spin and so start at once
MIN_BLAS_THREADS_MACS = 1 << 21

# blas_callers: thread ident -> depth of its open blas_threads_in_caller blocks
# blas_products: run_on_blas_threads calls in flight; blas_libs: threadpoolctl's BLAS controllers while
# npformer limits BLAS, and blas_own_threads BLAS's thread count before it did
_state = {"threads": None, "pool": None, "blas_limit": None, "blas_callers": {}, "blas_products": 0, "blas_libs": (),
          "blas_own_threads": 1}
_lock = threading.Lock()     # guards _state: set_num_threads may run while other threads run ops


class _Local(threading.local):
    busy = False  # this thread is running a block (nested splits run whole)


_local = _Local()


def get_num_threads() -> int:
    """Threads that npformer's ops use on the CPU (like torch.get_num_threads)."""
    if _state["threads"] is None:
        set_num_threads(default_num_threads())
    return _state["threads"]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads() -> int:
    """NPFORMER_NUM_THREADS (an integer >= 1) when set; else available_cores() when
    threadpoolctl can hold numpy's BLAS to one thread; else 1 (see the module docstring)."""
    value = os.environ.get("NPFORMER_NUM_THREADS")
    if value is not None:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"NPFORMER_NUM_THREADS must be an integer >= 1, got {value!r}")
        return n
    return available_cores() if _has_threadpoolctl() else 1


def _has_threadpoolctl():
    try:
        import threadpoolctl  # noqa: F401  (an optional package)
    except ImportError:
        return False
    return True


def set_num_threads(n: int) -> None:
    """Split the work of every op across `n` threads (an int >= 1) on the CPU; with n > 1
    numpy's BLAS is limited to one thread (via threadpoolctl), since npformer splits the GEMMs."""
    n = check_int(n, "n", "set_num_threads", at_least=1)
    with _lock:
        # the old pool is dropped, not shut down: ops in flight in other threads keep using it,
        # and its idle workers exit once the last of them lets go of it (garbage collection)
        _state.update(threads=n, pool=None)
        _settle_blas_threads()


@contextlib.contextmanager
def blas_threads_in_caller():
    """Within the block, this thread's ops run whole in the caller and numpy's BLAS threads the
    products with its own threads (its thread count is one setting per process, so other threads'
    products get them too meanwhile); other threads keep npformer's split, and set_num_threads
    keeps its meaning. For products of a few rows (a decoding step), which OpenBLAS's threads run
    faster than npformer's split of the rows."""
    get_num_threads()  # the default is settled before the block, not inside it
    me = threading.get_ident()
    busy, _local.busy = _local.busy, True
    with _lock:
        _state["blas_callers"][me] = _state["blas_callers"].get(me, 0) + 1
        _settle_blas_threads()
    try:
        yield
    finally:
        _local.busy = busy
        with _lock:
            depth = _state["blas_callers"].pop(me) - 1
            if depth:
                _state["blas_callers"][me] = depth
            _settle_blas_threads()


def run_on_blas_threads(kernel, *args):
    """kernel(*args) whole in the caller, its products on numpy's BLAS with get_num_threads() threads
    (at most BLAS's own count) instead of the one that npformer holds it to: for products too small
    to split and big enough for BLAS's threads (MIN_BLAS_THREADS_MACS). As in blas_threads_in_caller,
    BLAS's thread count is one setting per process: other threads' products get the threads too
    meanwhile. Inside a block of a split, or where BLAS is not held to one thread, kernel(*args) as
    it is."""
    if _state["blas_limit"] is None or _local.busy:
        return kernel(*args)
    with _lock:
        _state["blas_products"] += 1
        if _state["blas_products"] == 1 and _state["blas_limit"] is not None:
            _set_blas_threads(min(_state["threads"], _state["blas_own_threads"]))
    try:
        return kernel(*args)
    finally:
        with _lock:
            _state["blas_products"] -= 1
            if not _state["blas_products"] and _state["blas_limit"] is not None:
                _set_blas_threads(1)


def _set_blas_threads(n):
    """(holding _lock) numpy's BLAS on n threads, while npformer's limit stays in place to restore."""
    _take_blas_control()
    for library in _state["blas_libs"]:
        library.set_num_threads(n)


def _settle_blas_threads():
    """(holding _lock) numpy's BLAS on one thread while npformer splits the products (threads > 1)
    and no blas_threads_in_caller block is open; its own threads otherwise."""
    split = _state["threads"] > 1 and not _state["blas_callers"]
    if split and _state["blas_limit"] is None:
        _take_blas_control()
        libs = _blas_controllers()
        # their counts before the limit, the fewest (numpy's OpenBLAS and a BLAS another package loads may
        # differ): what the limit's get_original_num_threads returns, without the warning it gives then
        own = min((lib.num_threads for lib in libs), default=1) or 1
        _state["blas_limit"] = _limit_blas_threads()
        if _state["blas_limit"] is not None:
            _state["blas_libs"], _state["blas_own_threads"] = libs, own
    elif not split and _state["blas_limit"] is not None:
        _take_blas_control()
        _state["blas_limit"].restore_original_limits()
        _state["blas_limit"], _state["blas_libs"] = None, ()


def _take_blas_control():
    """threadpoolctl (>= 3.8) lets only the Python thread that last limited OpenBLAS change its
    process-wide thread count and silently ignores the others; npformer's changes, made one at a
    time under _lock from whichever thread calls, take that control over."""
    controller = getattr(sys.modules.get("threadpoolctl"), "OpenBLASController", None)
    if hasattr(controller, "clear_controlling_thread"):
        controller.clear_controlling_thread(force=True)


def _blas_controllers():
    """threadpoolctl's controllers of the BLAS libraries loaded, () without threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return ()
    return ThreadpoolController().select(user_api="blas").lib_controllers


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
    if _state["pool"] is not None:
        _state["pool"].forget()
    _state["pool"], _state["blas_products"] = None, 0
    me = threading.get_ident()  # the one thread the child has; other threads' blocks never close there
    _state["blas_callers"] = {me: _state["blas_callers"][me]} if me in _state["blas_callers"] else {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def row_blocks(rows, entries, like=None):
    """[(start, stop), ...]: contiguous blocks covering range(rows), one per thread when the
    array `like` lives in host memory (None: it does; "cuda" and "test" do not) and the work touches at least
    MIN_PARALLEL_ENTRIES `entries`; otherwise the single block (0, rows)."""
    threads = min(get_num_threads(), rows)
    if (threads < 2 or entries < MIN_PARALLEL_ENTRIES or _local.busy
            or (like is not None and backend.device_of(like) != "cpu")):
        return [(0, rows)]
    bounds = [rows * i // threads for i in range(threads + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _run_marked(kernel, *args):
    busy, _local.busy = _local.busy, True
    try:
        return kernel(*args)
    finally:
        _local.busy = busy


def run_blocks(kernel, blocks):
    """[kernel(start, stop) for each block], the first block in the caller, the others in the pool."""
    return run_tasks([(kernel, start, stop) for start, stop in blocks])


def run_tasks(tasks):
    """[kernel(start, stop) for each (kernel, start, stop) of `tasks`]: run_blocks for blocks of
    different kernels (e.g. two products that need not wait for each other), the first task in
    the caller, the others in the pool."""
    if len(tasks) == 1:
        kernel, start, stop = tasks[0]
        return [kernel(start, stop)]
    if sys.is_finalizing():  # the pool's threads (daemons) no longer run: every task here
        return [_run_marked(*task) for task in tasks]
    pool = _pool()
    handed = [pool.submit(_run_marked, *task) for task in tasks[1:]]
    try:
        first = _run_marked(*tasks[0])
        # a task the pool has not started (its threads busy, e.g. drawing masks ahead) runs here
        rest = [_run_marked(*task) if task_ahead.cancel() else None for task, task_ahead in zip(tasks[1:], handed)]
    finally:  # never leave a block running behind the caller's back, even on an error
        for task_ahead in handed:
            if not task_ahead.cancelled():
                task_ahead.wait()
    return [first] + [r if t.cancelled() else t.result() for r, t in zip(rest, handed)]


def submit(fn, *args):
    """fn(*args) in the pool (marked as a block: splits inside it run whole), a Task (its
    cancel(), done() and result() as a Future's); None when npformer runs one thread (there is no pool) or
    the interpreter is finalizing (the pool's threads no longer run)."""
    if get_num_threads() < 2 or sys.is_finalizing():
        return None
    return _pool().submit(_run_marked, fn, *args)


class Task:
    """fn(*args) handed to a pool thread, with what a fork-join needs of a Future and no more:
    whoever takes `_claim` first runs it, the pool thread or a caller cancelling it (cancel() is True
    when it had not started: it never will, and the caller runs it itself); `_done` is released once
    it has run. A lighter hand-off than concurrent.futures' Future, its Condition and wait
    (BENCHMARKS.md, "Thresholds")."""
    __slots__ = ("fn", "args", "value", "error", "_claim", "_done", "_cancelled", "_ran")

    def __init__(self, fn, args):
        self.fn, self.args, self.value, self.error = fn, args, None, None
        self._claim, self._done = threading.Lock(), threading.Lock()
        self._done.acquire()
        self._cancelled = self._ran = False

    def run(self):
        """In a pool thread: fn(*args), its value or its error kept, unless it was cancelled."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.value = self.fn(*self.args)
        except BaseException as error:  # raised in the caller, by result()
            self.error = error
        finally:
            self._ran = True
            self._done.release()

    def cancel(self):
        """True when the task has not started (then it never runs); False when it runs or has run."""
        if not self._cancelled:
            self._cancelled = self._claim.acquire(blocking=False)
        return self._cancelled

    def cancelled(self):
        return self._cancelled

    def done(self):
        """True once it has run or was cancelled (not the done lock's state: a waiter holds it
        for a moment)."""
        return self._cancelled or self._ran

    def wait(self, timeout=None):
        """Until the task has run, or for `timeout` seconds: whether it has run (a cancelled one
        never does: check cancelled() first)."""
        if not self._done.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._done.release()
        return True

    def result(self, timeout=None):
        """fn's value once the task has run, or its error raised here; TimeoutError after `timeout`
        seconds."""
        if not self.wait(timeout):
            raise TimeoutError(f"the task did not run within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.value


class Pool:
    """`workers` daemon threads running the Tasks that any thread submits, from one queue. Daemons:
    a thread still training after the script's last line and an atexit handler keep the pool (only
    a finalizing interpreter stops them, see run_tasks). The threads exit once the pool is dropped
    (set_num_threads) and garbage collected."""

    def __init__(self, workers):
        self._tasks = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=_work, args=(self._tasks,), name=f"npformer_{i}", daemon=True).start()
        self._finalizer = weakref.finalize(self, _stop_workers, self._tasks, workers)
        self._finalizer.atexit = False   # at exit the daemons stay (see above)

    def submit(self, fn, *args):
        task = Task(fn, args)
        self._tasks.put(task)
        return task

    def forget(self):
        """In a forked child: drop the pool without touching its queue (the parent's threads, which
        the child does not have, may have held its lock at the fork)."""
        self._finalizer.detach()


def _work(tasks):
    while (task := tasks.get()) is not None:
        task.run()


def _stop_workers(tasks, workers):
    for _ in range(workers):
        tasks.put(None)


def _pool():
    with _lock:
        if _state["pool"] is None:
            _state["pool"] = Pool(max(_state["threads"] - 1, 1))
        return _state["pool"]


def split_blocks(threads, sizes):
    """Share `threads` (>= 2) between len(sizes) independent pieces of work of about equal cost,
    piece i covering range(sizes[i]): [blocks of piece 0, blocks of piece 1, ...], each piece cut
    into threads // len(sizes) blocks (at least one), for run_tasks."""
    share = max(threads // len(sizes), 1)
    return [[(n * i // share, n * (i + 1) // share) for i in range(share)] for n in sizes]


def side_by_side(pieces, entries, like=None):
    """Independent pieces of work of about equal cost, each (kernel, rows, entries of its own) with
    kernel(start, stop) covering range(rows) (e.g. two GEMMs): when the whole work (`entries`)
    splits on the first piece's rows (row_blocks), one hand-off with the threads shared between the
    pieces (split_blocks; on 2 threads each piece whole on its own thread, where blocks of each, one
    piece after the other, would join twice and run four smaller calls); else each piece by
    for_rows on its own entries, one after the other."""
    threads = len(row_blocks(pieces[0][1], entries, like))
    if threads < 2:
        for kernel, rows, own in pieces:
            for_rows(kernel, rows, own, like)
        return
    shares = split_blocks(threads, [rows for _, rows, _ in pieces])
    run_tasks([(kernel, *block) for (kernel, _, _), blocks in zip(pieces, shares) for block in blocks])


def for_rows(kernel, rows, entries, like=None):
    """run_blocks(kernel, row_blocks(rows, entries, like)): kernel(start, stop) per block of rows."""
    return run_blocks(kernel, row_blocks(rows, entries, like))


def on_row_blocks(fn, args, cut, combine, like=None):
    """fn(*args) computed on blocks of rows, one per thread, for a row-wise fn: the arguments at
    the indices `cut` (arrays with the same number of rows, axis 0, or None) are sliced to each
    block, the others pass whole. fn returns a tuple of outputs (each None or an array), put back
    together by `combine`, one entry per output: "rows" (concatenated along axis 0) or "sum"
    (added over the blocks: column sums); or one array, when combine is the one string "rows".
    Work under MIN_PARALLEL_ENTRIES entries (of the cut arguments) runs fn(*args) whole."""
    cut_arrays = [args[i] for i in cut if args[i] is not None]
    blocks = row_blocks(cut_arrays[0].shape[0], sum(a.size for a in cut_arrays), like)
    if len(blocks) == 1:
        return fn(*args)
    cut = set(cut)

    def block(start, stop):
        return fn(*[a[start:stop] if i in cut and a is not None else a for i, a in enumerate(args)])

    parts = run_blocks(block, blocks)
    if isinstance(combine, str):  # one output
        return backend.get_array_module(parts[0]).concatenate(parts)
    results = []
    for j, how in enumerate(combine):
        pieces = [p[j] for p in parts]
        if pieces[0] is None:
            results.append(None)
        elif how == "rows":
            results.append(backend.get_array_module(pieces[0]).concatenate(pieces))
        else:
            total = pieces[0].copy()
            for piece in pieces[1:]:
                total += piece
            results.append(total)
    return tuple(results)
