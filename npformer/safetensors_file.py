"""safetensors files: {name: array} plus string metadata, read only after the header checks out.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian N, an N-byte JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the data bytes, every tensor C-ordered little-endian at [begin, end) of the data.
Reading checks the whole header before allocating anything: a known dtype, a shape of
non-negative ints, end - begin = bytes of the shape, tensors tiling the data exactly, and the
data ending where the file ends; then the `safetensors` package's NumPy API reads the arrays.
bfloat16 tensors (most Hugging Face Llama-family downloads), which NumPy cannot hold, are read
here and widened exactly to float32 (a bfloat16 is the upper half of a float32's bits).
A file that fails raises SafetensorsError naming it. Nothing in a file is executed (no pickle).
Writing is atomic (npformer.files.atomic_write). The `safetensors` package (the optional
extra `npformer[safetensors]`) is imported inside these functions only.
"""
import math
import os

import numpy as np

from .files import atomic_write, loads_json

MAX_HEADER = 100 * 1024 * 1024  # the safetensors package's own limit
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32", "I16": "int16",
          "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
BFLOAT16 = "bfloat16"  # read_header's name for a BF16 tensor, which read_safetensors gives as float32


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file (foreign, truncated, damaged), or whose
    contents do not fit what it is loaded into; the message names the file."""


def _safetensors_numpy():
    try:
        import safetensors.numpy  # optional: pip install npformer[safetensors]
    except ImportError as e:
        raise ImportError("safetensors files need the `safetensors` package: pip install safetensors "
                          "(or npformer[safetensors])") from e
    return safetensors.numpy


def _entry(path, name, entry):
    """(dtype, shape, begin, end) of one header entry, checked."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{path}: header entry {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES and dtype != "BF16":
        raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dtype!r} (known: "
                               f"{sorted(DTYPES) + ['BF16']})")

    def counts(value):
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in value)
    if not counts(shape):
        raise SafetensorsError(f"{path}: tensor {name!r} has shape {shape!r}, expected a list of ints >= 0")
    if not counts(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise SafetensorsError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, expected [begin, end] "
                               f"with 0 <= begin <= end")
    size = math.prod(shape) * (2 if dtype == "BF16" else np.dtype(DTYPES[dtype]).itemsize)
    if offsets[1] - offsets[0] != size:
        raise SafetensorsError(f"{path}: tensor {name!r} ({dtype} {shape}) needs {size} bytes but its data_offsets "
                               f"{offsets} span {offsets[1] - offsets[0]}")
    return DTYPES.get(dtype, BFLOAT16), tuple(shape), offsets[0], offsets[1]


def read_header(path: str | os.PathLike) -> tuple[dict, dict]:
    """({name: (numpy dtype name, or "bfloat16", shape)}, metadata {str: str}) of a safetensors
    file, after checking every entry against the file's size (see the module docstring). Reads
    only the header. Raises FileNotFoundError, IsADirectoryError or SafetensorsError."""
    entries, metadata, _ = _checked_header(os.fspath(path))
    return {name: (dtype, shape) for name, (dtype, shape, _, _) in entries.items()}, metadata


def _checked_header(path):
    """({name: (dtype name, shape, begin, end)}, metadata, where the data starts in the file)."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 8:
            raise SafetensorsError(f"{path}: not a safetensors file ({file_size} bytes, too short for a header)")
        length = int.from_bytes(f.read(8), "little")
        if length > min(file_size - 8, MAX_HEADER):
            raise SafetensorsError(f"{path}: not a safetensors file, or truncated: the header claims {length} bytes "
                                   f"but the file has {file_size - 8} after the length")
        raw = f.read(length)
    try:
        header = loads_json(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, a name twice, JSON nested too deep
        raise SafetensorsError(f"{path}: not a safetensors file (the header is not JSON: "
                               f"{type(e).__name__}: {e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: not a safetensors file (the header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    entries = {name: _entry(path, name, entry) for name, entry in header.items()}
    position = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != position:
            raise SafetensorsError(f"{path}: damaged: tensor {name!r} starts at byte {begin} of the data, expected "
                                   f"{position} (tensors must tile the data without gaps or overlaps)")
        position = end
    data_size = file_size - 8 - length
    if position != data_size:
        raise SafetensorsError(f"{path}: truncated or damaged: the header describes {position} bytes of data, "
                               f"the file holds {data_size}")
    return entries, metadata, 8 + length


def read_safetensors(path: str | os.PathLike) -> tuple[dict, dict]:
    """({name: numpy array (a copy)}, metadata) of a safetensors file whose header checks out
    (read_header); bfloat16 tensors come back as float32 (exactly). Raises FileNotFoundError,
    IsADirectoryError or SafetensorsError."""
    path = os.fspath(path)
    entries, metadata, data_start = _checked_header(path)
    header = {name: ("float32" if dtype == BFLOAT16 else dtype, shape) for name, (dtype, shape, _, _) in entries.items()}
    try:
        arrays = {}
        with _safetensors_numpy().safe_open(path, framework="np") as f:
            for name, (dtype, shape, begin, end) in entries.items():
                if dtype != BFLOAT16:
                    arrays[name] = np.array(f.get_tensor(name), copy=True)
        with open(path, "rb") as f:
            for name, (dtype, shape, begin, end) in entries.items():
                if dtype == BFLOAT16:
                    f.seek(data_start + begin)
                    arrays[name] = _widened_bfloat16(f.read(end - begin), shape)
    except Exception as e:
        raise SafetensorsError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from e
    for name, (dtype, shape) in header.items():
        if arrays[name].dtype != np.dtype(dtype) or arrays[name].shape != shape:
            raise SafetensorsError(f"{path}: tensor {name!r} read as {arrays[name].dtype} {arrays[name].shape}, "
                                   f"the header says {dtype} {shape}")
    return arrays, metadata


def _widened_bfloat16(raw, shape):
    """Little-endian bfloat16 bytes as float32 of `shape`: a bfloat16 is the upper 16 bits of
    the float32 with the same value, so widening is exact."""
    halves = np.frombuffer(raw, dtype="<u2")                                       # (n,) bfloat16 bits
    return (halves.astype(np.uint32) << 16).view(np.float32).reshape(shape)       # exact float32


def write_safetensors(path: str | os.PathLike, arrays: dict, metadata: dict | None = None) -> str:
    """Write {name: array} (numpy, or anything numpy.asarray takes) and string metadata to
    `path` as a safetensors file, atomically. Returns path."""
    if not all(isinstance(k, str) for k in arrays):
        raise TypeError("write_safetensors: tensor names must be strings")
    if "__metadata__" in arrays:
        raise ValueError("write_safetensors: '__metadata__' is the header's metadata entry, not a tensor name")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                        for k, v in metadata.items())):
        raise TypeError(f"write_safetensors: metadata must map strings to strings (a dict), got "
                        f"{type(metadata).__name__}")
    host = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    for name, a in host.items():
        if a.dtype.name not in DTYPES.values():
            raise TypeError(f"write_safetensors: {name!r} has dtype {a.dtype}, which safetensors does not store "
                            f"(use one of {sorted(set(DTYPES.values()))})")
    save_file = _safetensors_numpy().save_file
    return atomic_write(path, lambda tmp: save_file(host, tmp, metadata=metadata))
