"""Atomic file writes, shared by the savers: a write that fails or is killed midway never leaves
a half-written file where a good one was. And `loads_json`, shared by the loaders: JSON whose
objects name each key once.

The temporary file is `.<name>.<pid>.<random>.tmp` beside the target. A writer killed midway
leaves it behind; the next write of the same target removes the temporaries whose writer process
no longer exists and that were not modified for STALE_AFTER_S seconds (a live writer's, in this
process or another, is never touched)."""
import contextlib
import errno
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable

STALE_AFTER_S = 60.0


def _fsync_path(path, flags=os.O_RDONLY):
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_exists(pid):
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's process, or not a pid: leave it alone
        return True
    return True


def remove_stale_temporaries(directory: str, name: str) -> list[str]:
    """Remove `directory`'s temporaries of the file `name` whose writer process no longer exists
    and that were not modified for STALE_AFTER_S seconds. Returns the paths removed (none where
    os.kill(pid, 0) is not a liveness check: outside POSIX)."""
    if os.name != "posix":
        return []
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]+\.tmp")
    removed = []
    with contextlib.suppress(OSError):
        for entry in list(os.scandir(directory)):
            match = pattern.fullmatch(entry.name)
            if match is None or _process_exists(int(match.group(1))):
                continue
            with contextlib.suppress(OSError):  # removed meanwhile by another writer, or not ours to remove
                if entry.is_file(follow_symlinks=False) and time.time() - entry.stat().st_mtime >= STALE_AFTER_S:
                    os.remove(entry.path)
                    removed.append(entry.path)
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> str:
    """Write `path` atomically: `write(tmp)` fills a new temporary file in path's directory,
    which is fsynced and renamed over `path` (os.replace), then the directory is fsynced.
    A symbolic link is written through, as open() writes (the file it points to is replaced;
    the link stays). The file keeps the mode of the file it replaces (a new file gets 0o666
    less the umask, like open()). If `write` raises, `path` is untouched and the temporary file
    removed; temporaries left by killed writers of `path` are removed first (see
    remove_stale_temporaries). Returns path. OSError naming `path`, before anything is written,
    when its folder cannot take a new file (e.g. PermissionError) or `path` is a directory
    (IsADirectoryError) or another file than a regular one (a device, a FIFO)."""
    path = os.fspath(path)
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # a file where a folder of the path should be, a read-only parent, ...
        raise type(e)(e.errno, f"cannot write {path}: cannot create the folder {directory} ({e.strerror})") from e
    remove_stale_temporaries(directory, os.path.basename(target))
    try:
        status = os.stat(target)
    except FileNotFoundError:
        mode = None
    else:
        if stat.S_ISDIR(status.st_mode):
            raise IsADirectoryError(errno.EISDIR, f"cannot write {path}: it is a directory")
        if not stat.S_ISREG(status.st_mode):  # os.replace would put a regular file in a device's place
            raise OSError(errno.EINVAL, f"cannot write {path}: not a regular file (a device, FIFO or socket)")
        mode = stat.S_IMODE(status.st_mode)
    while True:
        tmp = os.path.join(directory, f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies
            break
        except FileExistsError:
            continue
        except OSError as e:  # a read-only folder, a full disk, ...: name the file being written, not the temporary
            raise type(e)(e.errno, f"cannot write {path}: cannot create a file in {directory} ({e.strerror})") from e
    try:
        if mode is None:
            mode = stat.S_IMODE(os.stat(tmp).st_mode)
        write(tmp)
        os.chmod(tmp, mode)  # `write` may have replaced the file (e.g. with a private 0o600 one)
        _fsync_path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not on every platform)
        _fsync_path(directory)
    return path


def _unique_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one JSON object")
        out[key] = value
    return out


def loads_json(text: str):
    """json.loads(text), refusing an object that names a key twice (json.loads would keep the
    last: the file would mean two things) with a ValueError, as invalid JSON is refused."""
    return json.loads(text, object_pairs_hook=_unique_keys)
