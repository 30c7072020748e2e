"""Hand-written CUDA kernels, plugged into the kernel tables of npformer.functional.

One `.cu` file per op family in this folder, read like the reference it is tested against
(the derivation of each gradient in comments), plus shared headers (`reduce.cuh`: block
reductions; `philox.cuh`: the dropout generator). CuPy compiles a file with NVRTC the first time
one of its kernels runs (and caches the binary); `SOURCES` lists each file's kernels, every one
a template instantiated for float and double (and, for the files in `TEMPLATE_ARGS`, for each
value of a second template argument, e.g. the head dims of flash attention). Without a GPU
nothing here runs on a GPU, but every source is compiled in the test suite (`nvrtc.py`), so a
typo cannot land, and tests/emulated_cuda.py runs the dropout and flash-attention kernels on
the CPU through their launchers.

The Python side of each family (`softmax.py`, ...) registers its launchers with the tables,
e.g. `@softmax_forward.register("cuda", supports=...)`; arguments the kernels do not support
fall back to the reference.
"""
import pathlib

from autograd import backend

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
SOURCES = {  # file (without .cu) -> its kernels
    "softmax": ("softmax_forward", "softmax_backward"),
    "dropout": ("dropout_apply",),
    "flash_attention": ("flash_attention_forward", "flash_attention_backward_dq", "flash_attention_backward_dkdv"),
}
TEMPLATE_ARGS = {  # file -> the values of each kernel's second template argument, if it has one
    "flash_attention": ("32", "64", "128"),  # head dims
}
CTYPES = {"float32": "float", "float64": "double"}
OPTIONS = ("-std=c++17",)
MAX_THREADS = 1024  # threads per block


def instance(kernel, ctype, extra=None):
    """The name expression of one template instance: 'softmax_forward<float>', 'k<double, 64>'."""
    return f"{kernel}<{ctype}>" if extra is None else f"{kernel}<{ctype}, {extra}>"


def name_expressions(source):
    """The template instances of a source that are compiled: 'softmax_forward<float>', ..."""
    return [instance(kernel, ctype, extra) for kernel in SOURCES[source] for ctype in CTYPES.values()
            for extra in TEMPLATE_ARGS.get(source, (None,))]


_modules = {}


def function(source, kernel, dtype, extra=None):
    """The compiled `kernel<T>` (or `kernel<T, extra>`) of `source`.cu for arrays of `dtype`, on the current GPU."""
    cupy = backend.cupy
    key = (source, cupy.cuda.Device().id)
    if key not in _modules:
        _modules[key] = cupy.RawModule(code=(SOURCE_DIR / f"{source}.cu").read_text(),
                                       options=OPTIONS + (f"-I{SOURCE_DIR}",),
                                       name_expressions=name_expressions(source))
    return _modules[key].get_function(instance(kernel, CTYPES[str(dtype)], extra))


def supported_dtype(*arrays):
    return all(str(a.dtype) in CTYPES for a in arrays)


def row_threads(n):
    """Threads per block for a kernel that gives one block to each row of n entries: a multiple
    of 32 (whole warps, as the block reductions need), one entry per thread up to 1024."""
    return min(MAX_THREADS, max(32, -(-n // 32) * 32))


def row_shape(rows, n):
    """(rows, n) as the kernels' (long long, int) arguments: CuPy passes a Python int as a
    long long, so the int is made explicit."""
    return backend.cupy.int64(rows), backend.cupy.int32(n)


def row_grid(rows):
    """Blocks for `rows` rows (the kernels loop when there are more rows than blocks)."""
    return max(1, min(rows, 2**31 - 1))


from . import dropout, flash_attention, softmax  # noqa: E402,F401  (register the kernels)
