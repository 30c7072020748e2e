"""Reading a checkpoint file without trusting it: say what a foreign file is, and read arrays
one at a time, each only after its declared size was checked against the file.

An npformer checkpoint is a zip archive of `.npy` members (what `numpy.savez` writes, stored
uncompressed): `meta.npy` (a 0-d unicode array holding the JSON metadata) and one member per
array that the metadata references. `Archive` opens such a file and reads:

- only `meta.npy` and the members the metadata names (`array(key)`), never every member;
- each member's `.npy` header first (numpy's own header parser, no pickle): a plain bool or
  numeric dtype (no object, no structured dtype), non-negative dimensions, and a byte count
  (shape x itemsize) equal to the member's size minus its header; arrays come back in native
  byte order;
- members only when their stored bytes lie inside the file (a member stored uncompressed holds
  exactly its size) and their size is plausible for their compressed size (at most
  MAX_COMPRESSION_RATIO times it, plus SIZE_SLACK) and while the total of the members read stays
  under MAX_COMPRESSION_RATIO times the file's size (plus SIZE_SLACK): a zip bomb is refused
  before anything is allocated.
"""
import os
import tokenize
import zipfile
import zlib

import numpy as np

from ..files import loads_json

MAX_COMPRESSION_RATIO = 100     # npformer stores members uncompressed: its own files have ratio 1
SIZE_SLACK = 1 << 20            # bytes any member, or the total, may have beyond the ratio
META = "meta"
DATA_KINDS = "biufc"           # bool, signed and unsigned integers, floats, complex
_READ_CHUNK = 1 << 22           # bytes decompressed per read
_HEAD = 4096                    # bytes looked at to tell what a foreign file is


class CheckpointError(ValueError):
    """A file that is not a readable npformer checkpoint (truncated, corrupted, foreign or malformed)."""


def plain_dtype(dtype, kinds=DATA_KINDS):
    """Whether a checkpoint may hold arrays of `dtype`: bool or numeric by default (no objects,
    no structured or subarray dtypes). Saving and loading apply the same rule."""
    return dtype.kind in kinds and dtype.fields is None and dtype.subdtype is None and dtype.itemsize > 0


def _corrupted(path, detail):
    return CheckpointError(f"{path}: not a readable npformer checkpoint, the file is truncated or corrupted "
                           f"({detail})")


def _describe_foreign(path, head):
    """The error for a file that is not a zip archive, saying what it looks like."""
    if not head:
        return CheckpointError(f"{path}: not a readable npformer checkpoint: the file is empty (0 bytes; "
                               "truncated or corrupted, e.g. by a copy that did not finish)")
    if head.startswith(b"PK\x03\x04"):
        return _corrupted(path, "a zip archive without its central directory")
    if head.startswith(b"\x93NUMPY"):
        return CheckpointError(f"{path}: not an npformer checkpoint but a single numpy array (a .npy file; "
                               "checkpoints are .npz archives written by npformer.save_checkpoint)")
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return CheckpointError(f"{path}: not an npformer checkpoint but a Python pickle (e.g. PyTorch's legacy "
                               "torch.save format); npformer never unpickles files. If it is a PyTorch "
                               "checkpoint, load it with torch and convert with npformer.interop.from_torch")
    text = _as_text(head)
    if text is not None:
        first = text.strip().splitlines()[0][:60] if text.strip() else ""
        return CheckpointError(f"{path}: not an npformer checkpoint but a text file (it begins {first!r}; "
                               "checkpoints are .npz archives written by npformer.save_checkpoint)")
    return _corrupted(path, "not a zip archive")


def _as_text(head):
    """The start of the file as text when it is UTF-8 without control characters, else None."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of `head`
            return None
        text = head[:e.start].decode("utf-8")
    return text if all(c.isprintable() or c in "\t\n\r\f" for c in text) else None


def _describe_foreign_zip(path, names):
    """The error for a zip archive without npformer's `meta.npy`."""
    if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        return CheckpointError(f"{path}: not an npformer checkpoint but a PyTorch checkpoint (torch.save's zip "
                               "format); npformer never unpickles files. Load it with torch and convert with "
                               "npformer.interop.from_torch")
    arrays = [n[:-4] for n in names if n.endswith(".npy")]
    shown = ", ".join(arrays[:5]) + (f", ... ({len(arrays)} in all)" if len(arrays) > 5 else "")
    if arrays:
        return CheckpointError(f"{path}: not an npformer checkpoint but a plain numpy .npz archive (arrays: "
                               f"{shown}) without npformer's '{META}' entry; read it with numpy.load, or write "
                               "checkpoints with npformer.save_checkpoint")
    return CheckpointError(f"{path}: not an npformer checkpoint but a zip archive without numpy arrays (members: "
                           f"{', '.join(names[:5])})")


class Archive:
    """An open checkpoint file: `meta` (the parsed JSON metadata) and `array(key)` (one array,
    read after its header was checked). Use as a context manager. Raises FileNotFoundError,
    IsADirectoryError, or CheckpointError naming the path and saying what the file is."""

    def __init__(self, path):
        self.path = path
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path}: a directory, not a checkpoint file (pass the .npz file inside it)")
        self._file = open(path, "rb")
        try:
            self._zip = self._open_zip()
            self._size = os.fstat(self._file.fileno()).st_size
            self._budget = MAX_COMPRESSION_RATIO * self._size + SIZE_SLACK   # bytes all members read may hold
            self._arrays = {}
            self.meta = self._read_meta()
        except BaseException:
            self._file.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def _open_zip(self):
        head = self._file.read(_HEAD)
        self._file.seek(0)
        if not zipfile.is_zipfile(self._file):
            raise _describe_foreign(self.path, head)
        try:
            archive = zipfile.ZipFile(self._file)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
            raise _corrupted(self.path, f"{type(e).__name__}: {e}") from e
        if f"{META}.npy" not in archive.NameToInfo:
            raise _describe_foreign_zip(self.path, archive.namelist())
        if len(archive.NameToInfo) != len(archive.infolist()):  # zipfile keeps the last: the file means two things
            names = archive.namelist()
            twice = sorted({n for n in names if names.count(n) > 1})
            raise _corrupted(self.path, f"the archive holds the members {twice[:5]} more than once")
        return archive

    def _read_meta(self):
        meta = self._read(META, "U")
        if meta.shape != ():
            raise _corrupted(self.path, f"the '{META}' entry is a {meta.shape} array, not one string")
        try:
            return loads_json(meta.item())
        except (ValueError, RecursionError) as e:  # JSONDecodeError, a key twice; deep nesting recurses
            raise CheckpointError(f"{self.path}: the metadata is not valid JSON ({type(e).__name__}: "
                                  f"{str(e)[:200]})") from e

    def array(self, key, where):
        """The array stored under `key` (read once, then shared); `where` names the metadata entry
        that references it, for the error when the file has no such array."""
        if not isinstance(key, str) or key == META or f"{key}.npy" not in self._zip.NameToInfo:
            raise CheckpointError(f"{self.path}: metadata {where} references the array {key!r}, which the "
                                  "file does not hold")
        if key not in self._arrays:
            self._arrays[key] = self._read(key, DATA_KINDS)
        return self._arrays[key]

    def _read(self, key, kinds):
        """Read member `key`.npy as an array whose dtype kind is in `kinds`, checking sizes first."""
        info = self._zip.NameToInfo[f"{key}.npy"]
        what = f"array {key!r}"
        if info.header_offset + info.compress_size > self._size:
            raise _corrupted(self.path, f"{what} declares {info.compress_size} bytes at offset {info.header_offset}, "
                                        f"past the end of the file ({self._size} bytes)")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise _corrupted(self.path, f"{what} is stored uncompressed but declares {info.file_size} bytes in "
                                        f"{info.compress_size}")
        if info.flag_bits & 0x1:
            raise CheckpointError(f"{self.path}: {what} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CheckpointError(f"{self.path}: {what} uses zip compression method {info.compress_type}; "
                                  "checkpoints are stored uncompressed (or deflated)")
        if info.file_size > MAX_COMPRESSION_RATIO * info.compress_size + SIZE_SLACK:
            raise CheckpointError(f"{self.path}: {what} declares {info.file_size} bytes compressed into "
                                  f"{info.compress_size} (ratio above {MAX_COMPRESSION_RATIO}): refusing a "
                                  "likely zip bomb")
        self._budget -= info.file_size
        if self._budget < 0:
            raise CheckpointError(f"{self.path}: the arrays read so far declare more than "
                                  f"{MAX_COMPRESSION_RATIO} times the file's size: refusing a likely zip bomb")
        try:
            with self._zip.open(info) as member:
                shape, fortran_order, dtype = self._header(member, what)
                if not plain_dtype(dtype, kinds):
                    raise CheckpointError(f"{self.path}: {what} has dtype {dtype}; a checkpoint holds "
                                          + ("one JSON string there" if kinds == "U" else
                                             "bool and numeric arrays only (no objects, no structured dtypes)"))
                count = 1
                for n in shape:
                    count *= n
                data_size = info.file_size - member.tell()
                if count * dtype.itemsize != data_size:
                    raise CheckpointError(f"{self.path}: {what} declares shape {shape} of {dtype} "
                                          f"({count * dtype.itemsize} bytes) but holds {data_size} bytes")
                flat = np.empty(count, dtype=dtype)
                self._fill(member, flat.view(np.uint8), what)
        # a damaged stream, a CRC mismatch, or a local header whose name is not the UTF-8 it claims to be
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, UnicodeDecodeError) as e:
            raise _corrupted(self.path, f"{what}: {type(e).__name__}: {e}") from e
        if not dtype.isnative:  # e.g. a big-endian member: the values, in this machine's byte order
            flat = flat.astype(dtype.newbyteorder("="))
        if fortran_order:
            return flat.reshape(shape[::-1]).transpose()
        return flat.reshape(shape)

    def _header(self, member, what):
        """(shape, fortran_order, dtype) from the .npy header, parsed by numpy without pickle."""
        try:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(member)
            else:
                raise ValueError(f".npy format version {version} (npformer reads 1.0 and 2.0)")
        except (ValueError, TypeError, SyntaxError, tokenize.TokenError, RecursionError, MemoryError) as e:
            # what numpy's header parser raises on bytes that are not a header
            raise _corrupted(self.path, f"{what}: bad .npy header: {type(e).__name__}: {str(e)[:200]}") from e
        if any(n < 0 for n in shape):
            raise _corrupted(self.path, f"{what}: negative dimension in shape {shape}")
        return shape, fortran_order, dtype

    def _fill(self, member, out, what):
        """Read exactly len(out) bytes of `member` into `out` (this also checks the member's CRC)."""
        done = 0
        while done < len(out):
            chunk = member.read(min(_READ_CHUNK, len(out) - done))
            if not chunk:
                raise _corrupted(self.path, f"{what}: ends after {done} of {len(out)} bytes")
            out[done:done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            done += len(chunk)
        if member.read(1):
            raise _corrupted(self.path, f"{what}: holds more bytes than its header declares")
