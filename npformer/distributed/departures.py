"""A rank that leaves the program before the others ends the whole job: no rank waits forever.

A collective waits for every rank, so a rank that is gone would leave the others waiting in
their next one (MPICH's progress engine spinning at 100% CPU). Every way of leaving is covered:

- an exception that reaches the top of any thread of a rank (`sys.excepthook`,
  `threading.excepthook`): its traceback, with the rank, and MPI_Abort, which ends every rank.
- a rank that leaves the program otherwise (its script ends, `sys.exit` with any code,
  `SystemExit`; none of them is an exception hook's business): at exit it tells every other
  rank how many collectives it started (`Departures`). A rank that has started, or starts,
  a later collective would wait for it forever: it names the rank that left and aborts the
  job at once. Ranks that all reach the end after the same collective wait for each other's
  notices and finish normally.
- a rank that vanishes without running any more code (killed, out of memory, `os._exit`):
  MPICH's `mpiexec` ends the other ranks itself (its auto-cleanup, within about a second), with
  the vanished rank's status (0 for `os._exit(0)`); npformer.distributed.launch then fails the
  job naming it.

See docs/distributed.md ("Faults").
"""
from __future__ import annotations

import atexit
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from . import reports

_LEFT = 1  # the tag of a notice: "I left after starting this many collectives"
_POLL_SECONDS = 0.05  # how often the listener looks for a notice (a test costs microseconds)


class Departures:
    """Counts this rank's collectives and hears of ranks that left the program.

    group: the ProcessGroup (its comm, mpi4py's MPI module, abort). Notices travel on a
    communicator of their own (a duplicate of the group's), so they never match a collective's
    messages; a daemon thread listens for them, which needs MPI_THREAD_MULTIPLE (mpi4py's
    default). At exit (atexit, before mpi4py's MPI_Finalize) this rank sends its own notice and
    waits for everyone else's."""

    def __init__(self, group: Any):
        if group.MPI.Query_thread() != group.MPI.THREAD_MULTIPLE:
            raise RuntimeError("npformer.distributed needs MPI_THREAD_MULTIPLE (mpi4py's default): do not lower "
                               "mpi4py.rc.thread_level, or use an MPI library that provides it")
        self.group, self.MPI = group, group.MPI
        self.comm = group.comm.Dup()
        self.rank, self.size = group.rank, group.size
        self.started = 0  # collectives this rank has started
        self.left = {}  # rank -> collectives it had started when it left the program
        self._lock = threading.Lock()
        self._everyone_else_left = threading.Event()
        threading.Thread(target=self._listen, name="npformer-departures", daemon=True).start()
        atexit.register(self._leave)

    def collective(self) -> None:
        """Count a collective this rank starts now; abort the job if a rank that left will never join it."""
        with self._lock:
            self.started += 1
            self._check()

    def _check(self):
        """Abort if a rank left before joining every collective this rank has started (lock held)."""
        for rank, joined in sorted(self.left.items()):
            if joined < self.started:
                _report(f"rank {self.rank} of {self.size}: rank {rank} left the program (its script ended, or "
                        f"sys.exit / SystemExit) after {joined} collectives, but this rank has started collective "
                        f"{joined + 1}, which rank {rank} will never join: aborting the MPI job")
                self.group.abort(1)

    def _listen(self):
        notice = np.zeros(1, dtype=np.int64)
        status = self.MPI.Status()
        for _ in range(self.size - 1):
            request = self.comm.Irecv(notice, source=self.MPI.ANY_SOURCE, tag=_LEFT)
            while not request.Test(status):  # not Wait: MPICH's Wait spins a core
                time.sleep(_POLL_SECONDS)
            with self._lock:
                self.left[status.Get_source()] = int(notice[0])
                self._check()
        self._everyone_else_left.set()

    def _leave(self):
        """At exit: tell every other rank how many collectives this one started, then wait until
        each has left too (a rank that still needs this one aborts the job instead)."""
        with self._lock:
            count = np.array([self.started], dtype=np.int64)
            sends = [self.comm.Isend(count, dest=r, tag=_LEFT) for r in range(self.size) if r != self.rank]
        self._everyone_else_left.wait()
        self.MPI.Request.Waitall(sends)
        reports.finish()  # a normal exit, for npformer.distributed.launch


def install_excepthooks(group: Any) -> None:
    """An exception that reaches the top of the main thread or of any other thread aborts the job."""
    previous_sys, previous_threading = sys.excepthook, threading.excepthook

    def sys_hook(kind, value, tb):
        _report(f"rank {group.rank} of {group.size}: unhandled exception, aborting the MPI job\n"
                + "".join(traceback.format_exception(kind, value, tb)))
        group.abort(1)
        previous_sys(kind, value, tb)  # only reached if Abort returned

    def threading_hook(args):
        name = args.thread.name if args.thread is not None else "?"
        _report(f"rank {group.rank} of {group.size}: unhandled exception in thread {name!r}, aborting the MPI job\n"
                + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
        group.abort(1)
        previous_threading(args)

    sys.excepthook, threading.excepthook = sys_hook, threading_hook


def _report(message):
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
