"""npformer's CUDA kernels on the CPU: tests/cuda_emulator/kernels.cpp (the .cu files compiled with
g++ against the fiber-based emulator of tests/cuda_emulator/emulator.h), called through ctypes
with CuPy's calling convention, so that the launchers of npformer.functional.cuda run unchanged
on host arrays (their array module comes from the data):

    emulator = Emulator.build(directory)          # None without a C++ compiler
    monkeypatch.setattr(flash_attention, "function", emulator.function)

Each launch checks what a GPU would not report: the type of every argument against the kernel's
parameter (a Python int where the kernel takes an int, a float64 array where it takes float*),
C-contiguous arrays, and writes outside an array (each array is copied between guard bytes)."""
import ctypes
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from npformer.functional import cuda

SOURCE = pathlib.Path(__file__).resolve().parent / "cuda_emulator"
SCALARS = {"int32": ("i", ctypes.c_int32), "int64": ("l", ctypes.c_int64), "uint32": ("I", ctypes.c_uint32),
           "uint64": ("L", ctypes.c_uint64), "float32": ("f", ctypes.c_float), "float64": ("d", ctypes.c_double)}
POINTERS = {"float32": "F", "float64": "D", "bool": "B", "int64": "X"}
GUARD = 256  # bytes before and after every array, which the kernels must leave alone


def build_or_skip(directory):
    """The Emulator built in `directory`; without a C++ compiler the test is skipped (under CI it fails)."""
    built = Emulator.build(directory)
    if built is None:
        if os.environ.get("CI"):
            pytest.fail("a C++ compiler (g++) is required under CI to run the CUDA kernels' emulator")
        pytest.skip("no C++ compiler: the CUDA emulator cannot be built")
    return built


class Emulator:
    def __init__(self, library, seed=0):
        self.library, self.seed, self.launches = library, seed, []

    @classmethod
    def build(cls, directory):
        """Compile the kernels into `directory`; None when there is no C++ compiler."""
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            return None
        out = pathlib.Path(directory) / "kernels.so"
        subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{SOURCE}", f"-I{cuda.SOURCE_DIR}",
                        str(SOURCE / "kernels.cpp"), "-o", str(out)], check=True)
        return cls(ctypes.CDLL(str(out)))

    def function(self, source, kernel, dtype, extra=None):
        """npformer.functional.cuda.function's signature: the launcher of an emulated instance."""
        symbol = f"{kernel}_{cuda.CTYPES[str(dtype)]}" + (f"_{extra}" if extra is not None else "")
        entry = getattr(self.library, symbol)

        def launch(grid, block, args):
            (blocks,), (threads,) = grid, block
            values, guarded, codes = [], [], ""
            for i, a in enumerate(args):
                if isinstance(a, np.ndarray):
                    if not a.flags.c_contiguous or str(a.dtype) not in POINTERS:
                        raise TypeError(f"{symbol} argument {i}: a C-contiguous array of {sorted(POINTERS)}, "
                                        f"got {a.dtype} {a.shape} contiguous={a.flags.c_contiguous}")
                    buffer = np.full(a.nbytes + 2 * GUARD, 0xFF, dtype=np.uint8)
                    inner = buffer[GUARD:GUARD + a.nbytes].view(a.dtype).reshape(a.shape)
                    inner[...] = a
                    guarded.append((a, buffer, inner))
                    values.append(ctypes.c_void_p(inner.ctypes.data))
                    codes += POINTERS[str(a.dtype)]
                elif isinstance(a, np.generic) and str(a.dtype) in SCALARS:
                    code, ctype = SCALARS[str(a.dtype)]
                    values.append(ctype(a.item()))
                    codes += code
                else:  # CuPy would pass a Python int as long long and a float as double
                    raise TypeError(f"{symbol} argument {i}: pass numpy/CuPy scalars of the parameter types, "
                                    f"got {type(a).__name__} {a!r}")
            pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            expected = ctypes.create_string_buffer(len(values) + 1)
            if entry(ctypes.c_uint(blocks), ctypes.c_uint(threads), pointers, ctypes.c_ulonglong(self.seed),
                     codes.encode(), expected):
                raise TypeError(f"{symbol}: the arguments have the types {codes!r}, the kernel takes "
                                f"{expected.value.decode()!r}")
            for i, (a, buffer, inner) in enumerate(guarded):
                if (buffer[:GUARD] != 0xFF).any() or (buffer[GUARD + a.nbytes:] != 0xFF).any():
                    raise AssertionError(f"{symbol} wrote outside array argument {i}")
                if a.flags.writeable:
                    a[...] = inner
                elif not np.array_equal(a, inner, equal_nan=a.dtype.kind == "f"):
                    raise AssertionError(f"{symbol} wrote into the read-only array argument {i}")
            self.launches.append((symbol, blocks, threads))
        return launch
