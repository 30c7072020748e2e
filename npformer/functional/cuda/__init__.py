"""Hand-written CUDA kernels' sources, their loader and compiler check: what every op folder's
`cuda.py` launches (Adam's too: adam.cu, launched by npformer/functional/adam/cuda.py).

The CUDA code lives in npformer.functional, and not beside the user's `npformer.cuda`, because a
launcher registers with the kernel table of its op, and the tables are in npformer.functional:
from a layer further right the kernels could not be imported by the ops that dispatch to them.
`npformer.cuda` keeps only the public API of CUDA graphs (`graphed`), and what a captured step
rewrites before each replay is graph capture's (npformer.runtime.graphs).

One `.cu` file per op family in this folder, read like the reference it is tested against
(the derivation of each gradient in comments), plus shared headers (`reduce.cuh`: block
reductions; `philox.cuh`: the dropout generator). CuPy compiles a file with NVRTC the first time
one of its kernels runs (and caches the binary); `SOURCES` lists each file's kernels, every one
a template instantiated for float and double (and, for the files in `TEMPLATE_ARGS`, for each
value of a second template argument, e.g. the head dims of flash attention). Without a GPU
nothing here runs on a GPU, but every source is compiled in the test suite (`nvrtc.py`), so a
typo cannot land, and tests/cuda_emulator.py runs every kernel on the CPU through its launcher
(tests/functional/cuda/test_kernels_emulated.py, test_dropout.py, test_flash_attention.py).

The Python side of each family, its folder's `cuda.py` (`softmax/cuda.py`, ...), registers its
launchers with the tables, e.g. `@softmax_forward.register("cuda", supports=...)`; arguments the
kernels do not support fall back to the reference.
"""
import pathlib

from autograd import backend

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
SOURCES = {  # file (without .cu) -> its kernels
    "softmax": ("softmax_forward", "softmax_backward"),
    "layer_norm": ("layer_norm_forward", "layer_norm_backward_input", "layer_norm_backward_params", "column_sum"),
    "cross_entropy": ("log_softmax_forward", "log_softmax_backward", "cross_entropy_forward",
                      "cross_entropy_backward"),
    "activation": ("bias_relu_forward", "relu_backward", "bias_gelu_forward", "gelu_backward"),
    "dropout": ("dropout_apply", "dropout_add_forward"),
    "embedding": ("embedding_backward",),
    "adam": ("adam_step",),
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


def load_raw_module(source, kernel, dtype, extra=None):
    """The compiled `kernel<T>` (or `kernel<T, extra>`) of `source`.cu for arrays of `dtype` on the
    current GPU (CuPy's RawModule: NVRTC compiles the file the first time, CuPy caches the binary)."""
    cupy = backend.cupy
    key = (source, cupy.cuda.Device().id)
    if key not in _modules:
        _modules[key] = cupy.RawModule(code=(SOURCE_DIR / f"{source}.cu").read_text(),
                                       options=OPTIONS + (f"-I{SOURCE_DIR}",),
                                       name_expressions=name_expressions(source))
    return _modules[key].get_function(instance(kernel, CTYPES[str(dtype)], extra))


_loader = load_raw_module  # the tests swap in a host emulator of the kernels (tests/cuda_emulator.py)


def function(source, kernel, dtype, extra=None):
    """The kernel `kernel<T>` (or `kernel<T, extra>`) of `source`.cu for arrays of `dtype`, called
    as `function(...)((blocks,), (threads,), (arg, ...))` like a CuPy RawKernel."""
    return _loader(source, kernel, dtype, extra)


def supported_dtype(*arrays):
    return all(str(a.dtype) in CTYPES for a in arrays)


def contiguous_floats(*arrays):
    """The arrays (None skipped) are C-contiguous, of one dtype that the kernels are built for:
    what the row kernels need."""
    arrays = [a for a in arrays if a is not None]
    return (supported_dtype(*arrays) and len({a.dtype for a in arrays}) == 1
            and all(a.flags.c_contiguous for a in arrays))


def null(array):
    """An optional array argument: the array, or 0 (a null pointer: CuPy passes a Python int as a
    64-bit value) for None; the kernels test the pointer."""
    return 0 if array is None else array


MAX_ROW_LENGTH = 2**31 - 1 - MAX_THREADS  # the kernels step through a row with an int: i + blockDim.x < 2^31


def short_rows(n):
    """Rows of n entries fit the row kernels: their (int) row length and indices do not overflow;
    longer rows are left to the reference."""
    return n <= MAX_ROW_LENGTH


def row_threads(n):
    """Threads per block for a kernel that gives one block to each row of n entries: a multiple
    of 32 (whole warps, as the block reductions need), one entry per thread up to 1024."""
    return min(MAX_THREADS, max(32, -(-n // 32) * 32))


def row_shape(xp, rows, n):
    """(rows, n) as the kernels' (long long, int) arguments: CuPy passes a Python int as a
    long long, so the int is made explicit."""
    return xp.int64(rows), xp.int32(n)


def row_grid(rows):
    """Blocks for `rows` rows (the kernels loop when there are more rows than blocks)."""
    return max(1, min(rows, 2**31 - 1))


MAX_ENTRY_BLOCKS = 65536  # blocks of an elementwise kernel (its threads loop over the rest)


def entry_grid(size, threads):
    """Blocks for an elementwise kernel of `threads` threads per block over `size` entries."""
    return max(1, min(-(-size // threads), MAX_ENTRY_BLOCKS))


