"""Static checks of the architecture: one backend switch, and dependencies pointing one way."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# layers left to right; a module may import only from its own layer or those to its left
LAYERS = [
    ("autograd",),
    ("npformer.functional", "npformer.files", "npformer.safetensors_file"),  # these need only autograd
    ("npformer.nn",),
    ("npformer.models",),
    ("npformer.optim", "npformer.data", "npformer.training", "npformer.decoding",
     "npformer.checkpoint", "npformer.interop", "npformer.plots", "npformer.opcases", "npformer.gradcheck",
     "npformer.progress", "npformer.distributed", "npformer.cuda", "npformer.exercises"),
]
# op math lives here: only the backend switch and its CuPy stand-in may import numpy or cupy
NO_ARRAY_LIBRARY = ("autograd", "npformer.functional", "npformer.nn", "npformer.models", "npformer.optim")
# optional packages: imported only inside functions (lazily) of these modules
OPTIONAL = {"torch": ("npformer.interop",), "transformers": ("npformer.interop",),
            "safetensors": ("npformer.safetensors_file",)}


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name):
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def imports(path):
    """(imported module, line, whether at module level) for every import in a file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top_level
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base + "." + a.name for a in node.names] if not node.module or node.level else [base]
            for name in names:
                yield name, node.lineno, id(node) in top_level


ENGINE_FILES = sorted(p for d in ("autograd", "npformer") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_left_and_op_math_uses_the_backend_switch(path):
    name = module_name(path)
    own_layer = layer_of(name)
    for imported, line, top in imports(path):
        root = imported.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
        if root in ("numpy", "cupy", "cupyx"):
            assert not any(name == p or name.startswith(p + ".") for p in NO_ARRAY_LIBRARY) \
                or name in ("autograd.backend", "autograd.testdevice"), f"{where}: get xp from autograd.backend instead"
        if root in OPTIONAL:
            assert any(name == p or name.startswith(p + ".") for p in OPTIONAL[root]) and not top, \
                f"{where}: {root} is optional, imported only inside functions of {OPTIONAL[root]}"
        if own_layer is not None and layer_of(imported) is not None:
            assert layer_of(imported) <= own_layer, f"{where}: a layer imports from one to its right"


def test_importing_npformer_imports_no_optional_package():
    """torch, transformers and safetensors load only when a function that needs them is called."""
    code = ("import sys, npformer, npformer.interop, npformer.models, npformer.safetensors_file; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
