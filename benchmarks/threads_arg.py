"""The benchmarks' --threads N, read from the command line before numpy loads OpenBLAS (which
sizes its thread pool once, at import): this module imports nothing that imports numpy."""
import os

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def threads_arg(argv, default):
    """The value of --threads N or --threads=N in argv (a string), or `default` when absent."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return default


def set_blas_threads(n):
    """Give numpy's BLAS (OpenBLAS, OpenMP, MKL) `n` threads, unless the environment already sets them."""
    for var in BLAS_THREAD_VARIABLES:
        os.environ.setdefault(var, n)
