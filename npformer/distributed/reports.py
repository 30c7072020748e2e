"""What each rank tells npformer's launcher (npformer.distributed.launch) over a Unix socket.

The launcher sets NPFORMER_LAUNCH_SOCKET to a socket in a private temporary folder; a rank whose
`init()` finds it connects and keeps the connection until its process ends, sending a line:

- `started R` at `init()`, then waits for the launcher's answer (one byte): from then on the
  launcher watches the connection, whose end tells it when this rank's process ended;
- `finished` at its normal exit (the atexit path, once every rank has said it left): a rank
  whose connection ends without it was killed or called `os._exit`;
- `aborted` just before it ends the job with MPI_Abort (it printed why itself).

Without the variable (a single process, plain `mpiexec`) nothing is sent. The variable leaves
the rank's environment at `init()`, so that processes it starts are not taken for ranks.
"""
from __future__ import annotations

import contextlib
import os
import socket

SOCKET_VARIABLE = "NPFORMER_LAUNCH_SOCKET"
WATCHING = b"+"  # the launcher's answer to `started R`
_link = None  # this rank's connection to the launcher, once init() ran under it


def start(rank: int) -> None:
    """At `init()`: under the launcher, connect, say `started R` and wait until it watches us."""
    global _link
    path = os.environ.pop(SOCKET_VARIABLE, None)
    if path is None:
        return
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        link.connect(path)
        link.sendall(f"started {rank}\n".encode())
        answer = link.recv(1)
    except OSError as e:
        raise RuntimeError(f"rank {rank} on {socket.gethostname()} cannot reach npformer.distributed.launch's socket "
                           f"{path!r} ({SOCKET_VARIABLE}): the launcher runs the ranks of its own machine; start a "
                           "job across machines with mpiexec") from e
    if answer != WATCHING:
        raise RuntimeError(f"rank {rank}: npformer.distributed.launch did not answer on {path!r} (it ended?)")
    _link = link


def finish() -> None:
    """At this rank's normal exit: say `finished` (under the launcher only)."""
    _say("finished")


def abort() -> None:
    """Before MPI_Abort: say `aborted` (under the launcher only)."""
    _say("aborted")


def _say(word):
    if _link is not None:
        with contextlib.suppress(OSError):  # the launcher is gone: no one to tell
            _link.sendall(f"{word}\n".encode())
