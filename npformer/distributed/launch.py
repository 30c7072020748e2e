"""Start an MPI job and fail it when a rank did not exit normally (torchrun's role, over mpiexec):

    python -m npformer.distributed.launch -n 4 [mpiexec options ...] script.py [script args ...]

runs `mpiexec -n 4 [mpiexec options ...] python script.py [script args ...]` (the mpiexec beside
this Python, else the one on PATH; this Python for the ranks) and exits with its status, except
when a rank that called `dist.init()` ended without its normal exit (killed, or `os._exit`):
then it prints which rank left before the others and exits non-zero, even when mpiexec said 0
(MPICH's mpiexec reports the vanished rank's own status, 0 for `os._exit(0)`, after killing
the others). Everything up to the first argument ending in ".py" goes to mpiexec.

How it knows: every rank that calls `dist.init()` connects to a Unix socket of the launcher
(npformer.distributed.reports) and, at its normal exit, says so. The launcher waits on all the
connections in one epoll set (Linux; `selectors`), which hands back their ends in the order
they happened (the rank that left comes before those that mpiexec killed after it). Ctrl-C and the other
termination signals go to mpiexec (which passes the first Ctrl-C on to the ranks; a second one
forces the job down). The launcher runs the ranks of its own machine. See docs/distributed.md
("Faults").
"""
from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from . import reports

USAGE = "usage: python -m npformer.distributed.launch -n N [mpiexec options ...] script.py [script args ...]"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_POLL_SECONDS = 0.05  # how often the launcher looks whether mpiexec ended


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


class Rank:
    """What the launcher heard from one rank's connection."""

    def __init__(self, link):
        self.link, self.number, self.said, self.pending = link, None, set(), b""

    def read(self) -> bool:
        """Take in what the rank sent (answering `started R`); False once its connection ended."""
        while True:
            try:
                data = self.link.recv(4096)
            except BlockingIOError:
                return True
            except ConnectionResetError:
                return False
            if not data:
                return False
            *lines, self.pending = (self.pending + data).split(b"\n")
            for line in lines:
                word, _, number = line.decode().partition(" ")
                self.said.add(word)
                if word == "started":
                    self.number = int(number)
                    with contextlib.suppress(BrokenPipeError):  # the rank has ended already
                        self.link.sendall(reports.WATCHING)


def watch(job: subprocess.Popen, server: socket.socket) -> list[Rank]:
    """Serve the ranks' connections until mpiexec ends; returns the ranks in the order their
    connections ended (their processes ended), the still open ones last."""
    ended, ranks = [], {}  # ranks: socket -> Rank
    with selectors.DefaultSelector() as ready:  # epoll on Linux: events in the order they happened
        ready.register(server, selectors.EVENT_READ)
        while True:
            finished = job.poll() is not None  # then every rank has ended: take in what is left
            events = ready.select(0 if finished else _POLL_SECONDS)
            for key, _ in events:
                if key.fileobj is server:
                    link, _ = server.accept()
                    link.setblocking(False)
                    ranks[link] = Rank(link)
                    ready.register(link, selectors.EVENT_READ)
                elif not ranks[key.fileobj].read():
                    ready.unregister(key.fileobj)
                    ended.append(ranks.pop(key.fileobj))
            if finished and not events:
                break
    for rank in ended + list(ranks.values()):
        rank.link.close()
    return ended + list(ranks.values())


def verdict(status: int, ranks: list[Rank]) -> tuple[int, str | None]:
    """(the launcher's exit status, its message or None) from mpiexec's status and what the
    ranks said, in the order they ended."""
    if any("aborted" in rank.said for rank in ranks):  # a rank ended the job on purpose and said why
        return status or 1, None
    unfinished = [rank.number for rank in ranks if rank.number is not None and "finished" not in rank.said]
    if not unfinished:
        return status, None
    first, others = unfinished[0], sorted(unfinished[1:])
    message = f"rank {first} left before the others (no normal exit: killed, or os._exit)"
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
        with tempfile.TemporaryDirectory(prefix="npformer-launch-") as folder, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            path = os.path.join(folder, "ranks")
            try:
                server.bind(path)
            except OSError as e:  # a Unix socket's path has at most about 100 characters
                print(f"npformer.distributed.launch: cannot make its socket {path!r} ({e}): set TMPDIR to a "
                      "shorter folder", file=sys.stderr)
                return 2
            server.listen()
            # a session of its own: a Ctrl-C at the terminal reaches mpiexec once, through `forward`
            job = subprocess.Popen([mpiexec, *options, sys.executable, *program],
                                   env=dict(os.environ, **{reports.SOCKET_VARIABLE: path}), start_new_session=True)
            ranks = watch(job, server)
            status = job.returncode if job.returncode >= 0 else 128 - job.returncode  # killed by a signal
            status, message = verdict(status, ranks)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if message is not None:
        print(f"npformer.distributed.launch: {message}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
