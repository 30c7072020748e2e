"""Run npformer's CUDA kernels on the CPU (tests/cuda_emulator.h): a .cu source compiled with g++
against the emulator, its kernels launched through ctypes with CuPy's argument rules, so that the
launchers of npformer.functional.cuda run unchanged on host arrays (their array module comes from
the data):

    with emulated_kernels(monkeypatch):          # npformer.functional.cuda's loader -> the emulator
        y = layer_norm_forward_cuda(x, w, b, 1e-5)  # numpy arrays in, the real launcher and kernel run

    emulator = build_or_skip()                    # or an Emulator: .function(source, kernel, dtype, extra),
    monkeypatch.setattr(npformer.functional.attention.cuda, "function", emulator.function)   # .launches, .seed

Arguments follow CuPy's RawKernel conventions: an array passes its pointer, a numpy scalar its
bytes, a Python int a long long, a float a double, a bool a bool; each is checked against the type
of the kernel's parameter (a Python int passed for an `int` parameter, or a float64 array for a
`float*`, are bugs CuPy would not report; a Python int 0 is the null pointer of an optional array).
Every array is checked for writes past either end (guard bytes around a copy), and the emulator
reports blocks whose threads miss a barrier.
"""
import contextlib
import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from npformer.functional import cuda

HEADER = pathlib.Path(__file__).with_name("cuda_emulator.h")
GUARD = 256  # bytes before and after every array, checked after each launch
GUARD_BYTE = 0xA5
# the emulator's type codes (cuda_emulator.h, TypeCode) of numpy dtypes: pointers, scalars
POINTER_CODES = {"float32": "F", "float64": "D", "bool": "B", "int64": "X", "uint64": "U", "uint32": "W"}
SCALAR_CODES = {"float32": "f", "float64": "d", "int32": "i", "int64": "l", "uint32": "I", "uint64": "L", "bool": "?"}


def compiler():
    return shutil.which("g++") or shutil.which("c++")


class LaunchError(RuntimeError):
    """The emulator refused a launch (divergent barriers, a deadlock, writes out of an array)."""


class ArgumentError(LaunchError, TypeError):
    """An argument that does not fit its kernel parameter (CuPy would pass it without a word)."""


class Module:
    """One .cu source compiled with the emulator: `get_function("kernel<float>")`."""

    def __init__(self, source):
        code = (cuda.SOURCE_DIR / f"{source}.cu").read_text()
        instances = cuda.name_expressions(source)
        wrapper = (f'#include "{HEADER}"\n#include "{source}.cu"\n'
                   f"EMULATED_KERNELS({' '.join(f'EMULATED({e})' for e in instances)})\n")
        headers = "".join(p.read_text() for p in sorted(cuda.SOURCE_DIR.glob("*.cuh")))
        key = hashlib.sha256((HEADER.read_text() + headers + code + wrapper).encode()).hexdigest()[:16]
        build = pathlib.Path(tempfile.gettempdir()) / f"npformer-cuda-emulator-{os.getuid()}"
        build.mkdir(exist_ok=True)
        library = build / f"{source}-{key}.so"
        if not library.exists():
            cpp = build / f"{source}-{key}.cpp"
            cpp.write_text(wrapper)
            partial = library.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([compiler(), "-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-ffp-contract=off",
                            f"-I{cuda.SOURCE_DIR}", str(cpp), "-o", str(partial)], check=True,
                           capture_output=True, text=True)
            os.replace(partial, library)
        self.lib = ctypes.CDLL(str(library))
        self.lib.emu_name.restype = ctypes.c_char_p
        self.lib.emu_error.restype = ctypes.c_char_p
        self.lib.emu_param_size.restype = ctypes.c_size_t
        self.lib.emu_param_types.restype = ctypes.c_char_p
        self.lib.emu_set_seed.argtypes = [ctypes.c_ulonglong]
        self.kernels = {self.lib.emu_name(i).decode().replace(" ", ""): i for i in range(self.lib.emu_count())}

    def get_function(self, name, symbol=None, emulator=None):
        return Kernel(self, self.kernels[name.replace(" ", "")], name, symbol or name, emulator)


def _dims(d):
    d = tuple(int(v) for v in d) + (1, 1, 1)
    return d[:3]


class Kernel:
    def __init__(self, module, index, name, symbol, emulator=None):
        self.lib, self.index, self.name, self.symbol, self.emulator = module.lib, index, name, symbol, emulator
        self.sizes = [self.lib.emu_param_size(index, j) for j in range(self.lib.emu_params(index))]
        self.types = self.lib.emu_param_types(index).decode()

    def __call__(self, grid, block, args, shared_mem=0):
        if len(args) != len(self.sizes):
            raise ArgumentError(f"{self.name}: {len(args)} arguments for {len(self.sizes)} parameters")
        buffers, guarded = [], []
        for j, (a, code) in enumerate(zip(args, self.types)):
            if isinstance(a, np.ndarray):
                if not a.flags.c_contiguous:
                    raise ArgumentError(f"{self.name}: argument {j} is not C-contiguous (shape {a.shape}, strides "
                                      f"{a.strides}): a kernel would read it as if it were")
                given = POINTER_CODES.get(str(a.dtype), "?array")
                padded = np.full(a.nbytes + 2 * GUARD, GUARD_BYTE, dtype=np.uint8)
                padded[GUARD:GUARD + a.nbytes] = a.reshape(-1).view(np.uint8) if a.size else padded[:0]
                guarded.append((a, padded))
                value = ctypes.c_void_p(padded.ctypes.data + GUARD)
            else:
                if isinstance(a, np.generic):
                    given, raw = SCALAR_CODES.get(str(a.dtype), "?scalar"), a.tobytes()
                elif isinstance(a, bool):
                    given, raw = "?", np.bool_(a).tobytes()
                elif isinstance(a, int):  # CuPy: a long long; 0 also serves as a null pointer
                    given, raw = ("null" if a == 0 and code.isupper() else "l"), np.int64(a).tobytes()
                elif isinstance(a, float):
                    given, raw = "d", np.float64(a).tobytes()
                else:
                    raise ArgumentError(f"{self.name}: argument {j} has type {type(a).__name__}, which CuPy cannot pass")
                value = ctypes.create_string_buffer(raw, len(raw))
            if given != code and not (given == "null" and code.isupper()):
                raise ArgumentError(f"{self.name}: argument {j} is a {type(a).__name__}"
                                  f"{' of ' + str(a.dtype) if hasattr(a, 'dtype') else ''} (type code {given!r}) for a "
                                  f"parameter of type code {code!r} ({self.sizes[j]} bytes; see TypeCode in "
                                  "cuda_emulator.h)")
            buffers.append(value)
        params = (ctypes.c_void_p * max(1, len(buffers)))(*[ctypes.addressof(b) for b in buffers])
        self.lib.emu_set_seed(self.emulator.seed if self.emulator is not None else 0)
        if self.lib.emu_launch(self.index, *_dims(grid), *_dims(block), params):
            raise LaunchError(f"{self.name}: {self.lib.emu_error().decode()}")
        if self.emulator is not None:
            self.emulator.launches.append((self.symbol, _dims(grid)[0], _dims(block)[0]))
        for a, padded in guarded:
            if (padded[:GUARD] != GUARD_BYTE).any() or (padded[GUARD + a.nbytes:] != GUARD_BYTE).any():
                raise LaunchError(f"{self.name}: a write past the end of an argument of shape {a.shape}")
            if not a.size:
                continue
            if a.flags.writeable:
                a.reshape(-1).view(np.uint8)[...] = padded[GUARD:GUARD + a.nbytes]
            elif (a.reshape(-1).view(np.uint8) != padded[GUARD:GUARD + a.nbytes]).any():
                raise LaunchError(f"{self.name}: a write into a read-only argument of shape {a.shape}")


_modules = {}


def _module(source):
    if source not in _modules:
        _modules[source] = Module(source)
    return _modules[source]


def load(source, kernel, dtype, extra=None):
    """Drop-in for npformer.functional.cuda's loader: the emulated `kernel<T>` (or `kernel<T, extra>`)
    of `source`.cu."""
    return _module(source).get_function(cuda.instance(kernel, cuda.CTYPES[str(dtype)], extra))


class Emulator:
    """The emulator as a loader with a record: `function(source, kernel, dtype, extra=None)` (the
    signature of npformer.functional.cuda.function) returns the emulated kernel; each launch is
    appended to `launches` as (kernel_ctype[_extra], blocks, threads); `seed` orders the threads of
    every round (tests set it to look for missing barriers)."""

    def __init__(self, seed=0):
        self.seed, self.launches = seed, []

    def function(self, source, kernel, dtype, extra=None):
        ctype = cuda.CTYPES[str(dtype)]
        symbol = f"{kernel}_{ctype}" + (f"_{extra}" if extra is not None else "")
        return _module(source).get_function(cuda.instance(kernel, ctype, extra), symbol, self)


def build_or_skip(directory=None):
    """An Emulator; without a C++ compiler the test is skipped (under CI it fails). `directory` is
    not needed (the compiled sources are cached in the temporary directory by content)."""
    if compiler() is None:
        if os.environ.get("CI"):
            pytest.fail("a C++ compiler (g++) is required under CI to run the CUDA kernels' emulator")
        pytest.skip("no C++ compiler: the CUDA emulator cannot be built")
    return Emulator()


@contextlib.contextmanager
def emulated_kernels(monkeypatch):
    """Within the block, every CUDA launcher of npformer runs its kernels on the emulator."""
    monkeypatch.setattr(cuda, "_loader", load)
    yield
