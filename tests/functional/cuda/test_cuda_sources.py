"""The CUDA sources in npformer/functional/cuda compile (NVRTC through ctypes: no GPU needed), and
the Philox generator of philox.cuh gives the bits of npformer.runtime.random, checked on the host by
compiling the header as plain C++. Under CI a missing libnvrtc fails instead of skipping."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from npformer.runtime import random
from npformer.functional import cuda
from npformer.functional.cuda import nvrtc

IN_CI = bool(os.environ.get("CI"))


@pytest.fixture(scope="module")
def compiler():
    if nvrtc.find_library() is None:
        if IN_CI:
            pytest.fail("libnvrtc is required under CI: the dev extra installs nvidia-cuda-nvrtc")
        pytest.skip("libnvrtc not found: pip install -e .[dev] (nvidia-cuda-nvrtc)")
    return nvrtc


@pytest.mark.parametrize("source", sorted(cuda.SOURCES))
def test_every_cuda_source_compiles_with_every_kernel_instance(compiler, source):
    ptx = compiler.compile_source(source)
    for kernel in cuda.SOURCES[source]:
        assert kernel in ptx  # the mangled name of each instance contains the kernel's name


def test_a_cuda_error_is_reported_with_the_compiler_log(compiler):
    with pytest.raises(compiler.CompileError, match=r"(?s)broken\.cu does not compile.*undefined_name"):
        compiler.compile_ptx("__global__ void k(float* x) { x[0] = undefined_name; }", "broken.cu")


HOST_PHILOX = r"""
#include <cstdio>
#define __device__
#define __forceinline__ inline
static unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * b) >> 32);
}
#include "philox.cuh"
int main() {
    const unsigned long long seeds[3] = {0ull, 123456789012345ull, 18446744073709551615ull};
    for (int s = 0; s < 3; ++s)
        for (unsigned long long i = 0; i < 40; ++i)
            printf("%u\n", philox_bits16(seeds[s], 1000000000000ull + i));
}
"""


def test_philox_header_gives_the_bits_of_autograd_random(tmp_path):
    """philox.cuh compiled for the host (the CUDA intrinsics replaced by their definitions)
    draws exactly what npformer.runtime.random.bits16 draws, at offsets past 2^32 counters too."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    (tmp_path / "main.cpp").write_text(HOST_PHILOX)
    subprocess.run([cxx, "-std=c++17", f"-I{cuda.SOURCE_DIR}", "main.cpp", "-o", "main"], cwd=tmp_path, check=True)
    out = subprocess.run([str(tmp_path / "main")], capture_output=True, text=True, check=True).stdout.split()
    ours = np.concatenate([random.bits16(seed, 1000000000000, 40)
                           for seed in (0, 123456789012345, 18446744073709551615)])
    np.testing.assert_array_equal(np.array(out, dtype=np.uint16), ours)
