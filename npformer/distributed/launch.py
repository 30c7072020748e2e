"""Start an MPI job and fail it when a rank did not exit normally (torchrun's role, over mpiexec):

    python -m npformer.distributed.launch -n 4 [mpiexec options ...] script.py [script args ...]

runs `mpiexec -n 4 [mpiexec options ...] python script.py [script args ...]` (the mpiexec beside
this Python, else the one on PATH; this Python for the ranks) and exits with its status, except
when a rank that called `dist.init()` ended without its normal exit (killed, or `os._exit`):
then it prints which rank left before the others and exits non-zero, even when mpiexec said 0
(MPICH's mpiexec reports the vanished rank's own status, 0 for `os._exit(0)`, after killing
the others). Everything up to the first argument ending in ".py" goes to mpiexec.

How it knows: the ranks write marker files into a private temporary folder
(npformer.distributed.markers); while the job runs, the launcher watches the processes of the
ranks on this machine (a pidfd each, in one epoll set, which hands back exits in the order they
happened: the rank that left comes before those mpiexec killed after it). Ctrl-C and other
termination signals go to mpiexec (which passes the first Ctrl-C on to the ranks; a second
one forces the job down). See docs/distributed.md ("Faults").
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from . import markers

USAGE = "usage: python -m npformer.distributed.launch -n N [mpiexec options ...] script.py [script args ...]"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_POLL_SECONDS = 0.05  # how often the folder is read for ranks that started


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(mpiexec's options, [script, *its args]): the script is the first argument ending in ".py"."""
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            return argv[:i], argv[i:]
    raise ValueError(f"no script given (no argument ends in '.py') in {argv}")


def find_mpiexec() -> str:
    """mpiexec beside this Python (the `mpich` wheel puts it there), else on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(f"no mpiexec beside {sys.executable} or on PATH: pip install -e '.[mpi]'")
    return found


def watch(job: subprocess.Popen, folder: str) -> list[int]:
    """Wait for mpiexec to end; returns the ranks of this machine in the order their processes
    ended (empty where pidfds do not exist: not Linux)."""
    if not hasattr(os, "pidfd_open"):
        job.wait()
        return []
    ended, watched, seen = [], {}, set()  # watched: pidfd -> rank
    with select.epoll() as exits:
        def collect(timeout):
            for fd, _ in exits.poll(timeout):
                ended.append(watched.pop(fd))
                exits.unregister(fd)
                os.close(fd)
        while job.poll() is None:
            for rank, started in markers.read(folder)["started"].items():
                if rank not in seen and started["host"] == socket.gethostname():
                    seen.add(rank)
                    try:
                        fd = os.pidfd_open(started["pid"])
                    except ProcessLookupError:  # ended already: its place in the order is not known
                        continue
                    watched[fd] = rank
                    exits.register(fd, select.EPOLLIN)
            collect(_POLL_SECONDS)
        collect(0)  # the ranks end before mpiexec does
    for fd in watched:
        os.close(fd)
    return ended


def verdict(status: int, found: dict[str, dict[int, dict]], ended: list[int]) -> tuple[int, str | None]:
    """(the launcher's exit status, its message or None) from mpiexec's status, the markers and
    the order in which this machine's ranks ended."""
    if found["aborted"]:  # a rank ended the job on purpose and said why
        return status or 1, None
    unfinished = sorted(set(found["started"]) - set(found["finished"]))
    if not unfinished:
        return status, None
    why = "no normal exit: killed, or os._exit"
    first = next((rank for rank in ended if rank in unfinished), None)
    if first is None:
        message = (f"ranks {unfinished} did not exit normally ({why}); which one left first is not known "
                   "(not watched on this machine)")
    else:
        others = [rank for rank in unfinished if rank != first]
        message = f"rank {first} left before the others ({why})"
        if others:
            message += f"; mpiexec then ended rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    return status or 1, message + f" (mpiexec's exit status: {status})"


def run(argv: list[str]) -> int:
    """The launcher: returns the exit status (2 for a bad command line)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        options, program = split_command(argv)
        mpiexec = find_mpiexec()
    except (ValueError, FileNotFoundError) as e:
        print(f"npformer.distributed.launch: {e}\n{USAGE}", file=sys.stderr)
        return 2
    job = None

    def forward(signum, frame):
        if job is not None and job.poll() is None:
            job.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        with tempfile.TemporaryDirectory(prefix="npformer-launch-") as folder:
            # a session of its own: a Ctrl-C at the terminal reaches mpiexec once, through `forward`
            job = subprocess.Popen([mpiexec, *options, sys.executable, *program],
                                   env=dict(os.environ, **{markers.FOLDER_VARIABLE: folder}), start_new_session=True)
            ended = watch(job, folder)
            status = job.returncode if job.returncode >= 0 else 128 - job.returncode  # killed by a signal
            status, message = verdict(status, markers.read(folder), ended)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if message is not None:
        print(f"npformer.distributed.launch: {message}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
