"""Crafting checkpoint files byte by byte for the tests: zip archives written by hand (any
declared sizes, any compression), members replaced, metadata rewritten."""
import io
import json
import struct
import zipfile
import zlib

import numpy as np

from npformer.checkpoint import packing


def members(path):
    """{name: bytes} of every member of a zip file."""
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name) for name in z.namelist()}


def npy(array):
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def meta_of(path):
    with np.load(path) as npz:
        return json.loads(npz["meta"].item())


def write_zip(path, entries):
    """A zip file written byte by byte: entries are (name, payload, method, crc, size); payload
    is what the archive stores (deflated data for method 8), size the member's declared size."""
    data, directory = bytearray(), bytearray()
    for name, payload, method, crc, size in entries:
        encoded, offset = name.encode(), len(data)
        data += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), size,
                            len(encoded), 0) + encoded + payload
        directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(payload),
                                 size, len(encoded), 0, 0, 0, 0, 0, offset) + encoded
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), len(data), 0)
    path.write_bytes(bytes(data + directory + end))
    return path


def stored(name, payload):
    return (name, payload, zipfile.ZIP_STORED, zlib.crc32(payload), len(payload))


def with_members(src, dst, **replace):
    """A copy of checkpoint `src` at `dst` with members replaced or added (name without .npy ->
    bytes; for "meta" also a JSON-able value)."""
    contents = members(src)
    for name, value in replace.items():
        contents[f"{name}.npy"] = value if isinstance(value, bytes) else npy(np.array(json.dumps(value)))
    return write_zip(dst, [stored(name, payload) for name, payload in contents.items()])


def with_meta(src, dst, meta):
    return with_members(src, dst, meta=meta)


def minimal_meta(**extra):
    """The metadata of a checkpoint holding nothing but `extra` state."""
    return {"format": "npformer-checkpoint", "version": 1, "config": None, "model": None, "optimizer": None,
            "scheduler": None, "rng": {}, **extra}


def file_with_state(path, **state):
    """A checkpoint holding nothing but `state`, packed as save_checkpoint packs it (arrays as
    members); a value ("generator", state dict) is packed as a numpy Generator with that state."""
    arrays = {}
    packed = {k: {"__generator__": packing.pack(v[1], k, arrays)} if isinstance(v, tuple) else
              packing.pack(v, k, arrays) for k, v in state.items()}
    return write_zip(path, [stored("meta.npy", npy(np.array(json.dumps(minimal_meta(**packed)))))]
                     + [stored(f"{k}.npy", npy(v)) for k, v in arrays.items()])
