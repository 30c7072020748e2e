"""Atomic file writes that keep the file's mode, and cleanup of temporaries left by killed writers.

A write goes to `.<name>.<pid>.<random>.tmp` in the target's directory, is flushed and fsynced,
then renamed over the target (`os.replace`): readers see the old file or the new one, never a
part. The temporary gets the target's mode when the target exists (a 0600 file stays 0600),
else 0666 minus the umask, as `open` gives a new file. Before writing, temporaries of the same
target whose writer process is gone and which were not modified for STALE_AFTER_S seconds are
removed (a save killed midway leaves one); a live writer's temporary is never touched.
"""
import os
import re
import secrets
import stat
import time

STALE_AFTER_S = 60.0


def _temporary_name(name, pid):
    return f".{name}.{pid}.{secrets.token_hex(4)}.tmp"


def _process_exists(pid):
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # someone else's process / not a pid: leave it alone
        return True
    return True


def remove_stale_temporaries(directory, name):
    """Remove `directory`'s temporaries of `name` whose writer process no longer exists and that
    were not modified for STALE_AFTER_S seconds. Returns the paths removed."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness check only on POSIX
        return []
    pattern = re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]+\.tmp")
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or _process_exists(int(match.group(1))):
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or time.time() - entry.stat().st_mtime < STALE_AFTER_S:
                continue
            os.remove(entry.path)
            removed.append(entry.path)
        except OSError:  # removed meanwhile by another save, or not ours to remove
            pass
    return removed


def atomic_write(path, write):
    """Call `write(fileobj)` on a temporary file beside `path`, fsync it and rename it over
    `path`, keeping `path`'s mode when it exists. On any error the temporary is removed and
    `path` is untouched."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    os.makedirs(directory, exist_ok=True)
    remove_stale_temporaries(directory, name)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    tmp = os.path.join(directory, _temporary_name(name, os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)  # umask applies
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.chmod(tmp, mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable (POSIX; not possible on every platform)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path
