"""Host memory: keep freed arrays' pages for the next arrays, like a caching allocator.

A training step makes and drops hundreds of temporary arrays of 0.1-8 MB. With glibc's default
settings malloc hands most of them back to the operating system when they are freed (blocks over
the mmap threshold are unmapped; free memory at the top of the heap over the trim threshold is
trimmed), so the next array of that size faults in fresh, zeroed pages, thousands a step (BENCHMARKS.md
has the figures). PyTorch keeps such blocks itself (its caching allocators); npformer's arrays
are numpy's, allocated by malloc, so npformer sets two of glibc's malloc parameters instead:

- M_MMAP_THRESHOLD = 32 MiB (glibc's own upper bound for its dynamic threshold): smaller arrays
  come from the heap and go back to it.
- M_TRIM_THRESHOLD = 256 MiB: up to that much free memory stays at the top of the heap.

Then a step faults a few pages instead of thousands. Peak memory is unchanged; what
changes is that up to 256 MiB of freed memory stays with the process for reuse. This happens once,
when npformer's runtime starts (`import npformer`; `import autograd` alone leaves malloc as it is),
on glibc (Linux) only; set NPFORMER_HOST_MEMORY=release before the import to keep glibc's defaults.
Setting either parameter turns off glibc's dynamic threshold, which is why both are set: either
alone makes the step fault more.
"""
import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
MODES = ("keep", "release")


def mode() -> str:
    """NPFORMER_HOST_MEMORY: "keep" (the default) or "release" (glibc's own settings)."""
    value = os.environ.get("NPFORMER_HOST_MEMORY", "keep")
    if value not in MODES:
        raise ValueError(f"NPFORMER_HOST_MEMORY must be one of {MODES}, got {value!r}")
    return value


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring) unless NPFORMER_HOST_MEMORY
    is "release". Returns whether they were set: False on another C library or when released."""
    if mode() == "release" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)                                  # the process's own C library
    return (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
