"""Write tests/cupy_api.txt: every name of CuPy's API under numpy's names ("numpy.exp",
"numpy.add.at", "numpy.random.Generator.random", ...), read by tests/conftest.py to check that
the test device is used only through names CuPy has. Needs CuPy installed, not a GPU:

    pip install cupy-cuda13x && python scripts/cupy_api.py
"""
import pathlib

import cupy
import cupy.lib.stride_tricks  # noqa: F401 (a submodule that numpy code reaches as numpy.lib.stride_tricks)

NAMESPACES = {"numpy": cupy, "numpy.random": cupy.random, "numpy.linalg": cupy.linalg, "numpy.fft": cupy.fft,
              "numpy.lib.stride_tricks": cupy.lib.stride_tricks, "numpy.random.Generator": cupy.random.Generator}
UFUNC_METHODS = ("at", "reduce", "reduceat", "accumulate", "outer")


def public(obj):
    return [n for n in dir(obj) if not n.startswith("_")]


def names():
    found = {"numpy.lib"}
    for prefix, namespace in NAMESPACES.items():
        for name in public(namespace):
            found.add(f"{prefix}.{name}")
            attr = getattr(namespace, name)
            if isinstance(attr, cupy.ufunc):
                found.update(f"{prefix}.{name}.{m}" for m in UFUNC_METHODS if hasattr(attr, m))
    return sorted(found)


if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "cupy_api.txt"
    header = (f"# CuPy {cupy.__version__}'s API under numpy's names, one per line; written by "
              "scripts/cupy_api.py, read by tests/conftest.py\n")
    out.write_text(header + "\n".join(names()) + "\n")
    print(f"wrote {out} ({len(names())} names)")
