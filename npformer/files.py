"""Atomic file writes, shared by the savers: a write that fails or is killed midway never leaves
a half-written file where a good one was."""
import contextlib
import os
import secrets
import stat
from collections.abc import Callable


def _fsync_path(path, flags=os.O_RDONLY):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> str:
    """Write `path` atomically: `write(tmp)` fills a new temporary file in path's directory,
    which is fsynced and renamed over `path` (os.replace), then the directory is fsynced.
    The file keeps the mode of the file it replaces (a new file gets 0o666 less the umask, like
    open()). If `write` raises, `path` is untouched and the temporary file removed. Returns path."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    while True:
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies
            break
        except FileExistsError:
            continue
    try:
        if mode is None:
            mode = stat.S_IMODE(os.stat(tmp).st_mode)
        write(tmp)
        os.chmod(tmp, mode)  # `write` may have replaced the file (e.g. with a private 0o600 one)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not on every platform)
        _fsync_path(directory)
    return path
