"""Compile npformer's CUDA sources to PTX with NVRTC, through ctypes: no GPU, no driver and no
CuPy needed, only libnvrtc (the `nvidia-cuda-nvrtc` wheel of the dev extra, or a CUDA toolkit).
The test suite uses it so that a CUDA source that does not compile cannot land:

    python -m npformer.functional.cuda.nvrtc      # compiles every source, prints the errors

On a GPU the same sources are compiled by CuPy's RawModule (which calls NVRTC too) when first used.
"""
import ctypes
import ctypes.util
import glob
import os
import sys

from . import OPTIONS, SOURCE_DIR, SOURCES, name_expressions

ARCH = "compute_90"  # Hopper (H100/H200); any virtual architecture >= compute_70 has what we use


class CompileError(RuntimeError):
    """NVRTC refused a source; the message holds its log."""


def find_library():
    """Path of libnvrtc: $NPFORMER_NVRTC, the nvidia-cuda-nvrtc wheel in this environment, or the
    system's; None when there is none."""
    if os.environ.get("NPFORMER_NVRTC"):
        return os.environ["NPFORMER_NVRTC"]
    for root in sys.path:
        found = sorted(glob.glob(os.path.join(root or ".", "nvidia", "*", "lib", "libnvrtc.so*")))
        found = [f for f in found if ".alt." not in f and "builtins" not in f]
        if found:
            return found[-1]
    return ctypes.util.find_library("nvrtc")


_library = None


def _nvrtc():
    global _library
    if _library is None:
        path = find_library()
        if path is None:
            raise OSError("libnvrtc was not found: install the dev extra (pip install -e .[dev], which brings "
                          "nvidia-cuda-nvrtc) or a CUDA toolkit, or set NPFORMER_NVRTC to its path")
        # libnvrtc dlopens libnvrtc-builtins by name: load the one beside it first, so that it is found
        for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*")):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        _library = ctypes.CDLL(path)
        _library.nvrtcGetErrorString.restype = ctypes.c_char_p
    return _library


def _check(result, what):
    if result != 0:
        raise CompileError(f"{what}: {_nvrtc().nvrtcGetErrorString(result).decode()}")


def compile_ptx(code, name, expressions=(), options=(), arch=ARCH):
    """PTX text of the CUDA C++ `code`, with the template instances `expressions` (e.g.
    "softmax_forward<float>") instantiated. Raises CompileError with NVRTC's log."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(program), code.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for expression in expressions:
            _check(lib.nvrtcAddNameExpression(program, expression.encode()), f"nvrtcAddNameExpression({expression})")
        args = [f"-arch={arch}", *options]
        argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
        result = lib.nvrtcCompileProgram(program, len(args), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        if result != 0:
            raise CompileError(f"{name} does not compile:\n{log.value.decode(errors='replace')}")
        lib.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
        for expression in expressions:  # each instance has a symbol in the PTX
            lowered = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(lowered)),
                   f"nvrtcGetLoweredName({expression})")
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def compile_source(source, arch=ARCH):
    """PTX of npformer's `source`.cu with the options and instances CuPy uses at run time."""
    path = SOURCE_DIR / f"{source}.cu"
    return compile_ptx(path.read_text(), path.name, name_expressions(source),
                       OPTIONS + (f"-I{SOURCE_DIR}",), arch)


def main():
    failed = 0
    for source in SOURCES:
        try:
            ptx = compile_source(source)
            print(f"{source}.cu: ok ({len(ptx):,} bytes of PTX for {ARCH})")
        except CompileError as e:
            failed += 1
            print(e)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
