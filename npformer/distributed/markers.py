"""What each rank tells npformer's launcher (npformer.distributed.launch), as files in its folder.

The launcher sets NPFORMER_LAUNCH_DIR to a private temporary folder; a rank whose `init()`
finds it writes there:

- `started.R` at `init()`: {"pid": ..., "host": ...}, so that the launcher can watch it;
- `finished.R` at its normal exit (the atexit path, once every rank has said it left): a rank
  that started and wrote none was killed or called `os._exit`;
- `aborted.R` just before it ends the job with MPI_Abort (it printed why itself).

Without the variable (a single process, plain `mpiexec`) nothing is written. Each file is
written whole (a temporary name, then a rename), so the launcher never reads half of one.
"""
from __future__ import annotations

import json
import os
import socket

FOLDER_VARIABLE = "NPFORMER_LAUNCH_DIR"
KINDS = ("started", "finished", "aborted")
_mine = None  # (folder, rank) once init() ran under the launcher


def start(rank: int) -> None:
    """At `init()`: under the launcher, write started.R. The variable leaves this process's
    environment, so that processes the rank starts are not taken for ranks of the job."""
    global _mine
    folder = os.environ.pop(FOLDER_VARIABLE, None)
    if folder is None:
        return
    if not os.path.isdir(folder):
        raise RuntimeError(f"npformer.distributed.launch's folder {folder!r} ({FOLDER_VARIABLE}) does not exist "
                           f"on {socket.gethostname()} (rank {rank}): the launcher needs every rank to see it (one "
                           "machine, or TMPDIR on a shared file system); start a job across machines with mpiexec")
    _mine = (folder, rank)
    _write("started", pid=os.getpid(), host=socket.gethostname())


def finish() -> None:
    """At this rank's normal exit: write finished.R (under the launcher only)."""
    _write("finished")


def abort() -> None:
    """Before MPI_Abort: write aborted.R (under the launcher only)."""
    _write("aborted")


def _write(kind, **fields):
    if _mine is None:
        return
    folder, rank = _mine
    temporary = os.path.join(folder, f".{kind}.{rank}.tmp")
    with open(temporary, "w") as f:
        json.dump(fields, f)
    os.replace(temporary, os.path.join(folder, f"{kind}.{rank}"))


def read(folder: str) -> dict[str, dict[int, dict]]:
    """The launcher's side: {kind: {rank: fields}} for the files in `folder` (other names are ignored)."""
    found = {kind: {} for kind in KINDS}
    for name in os.listdir(folder):
        kind, _, rank = name.partition(".")
        if kind in found and rank.isdigit():
            with open(os.path.join(folder, name)) as f:
                found[kind][int(rank)] = json.load(f)
    return found
