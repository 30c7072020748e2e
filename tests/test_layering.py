"""Static checks of the architecture: one backend switch, dependencies pointing one way, and a core
(autograd/) that imports only itself and changes nothing in the process when imported."""
import ast
import json
import os
import pathlib
import platform
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# layers left to right; a module may import only from its own layer or those to its left
LAYERS = [
    ("autograd",),
    ("npformer.runtime",),  # threads, kernel tables, random streams...: plugs into the core's hooks
    ("npformer.functional", "npformer.files", "npformer.safetensors_file"),  # these need only autograd
    ("npformer.nn",),
    ("npformer.models",),
    ("npformer.optim", "npformer.data", "npformer.training", "npformer.decoding",
     "npformer.checkpoint", "npformer.interop", "npformer.plots", "npformer.opcases", "npformer.gradcheck",
     "npformer.progress", "npformer.distributed", "npformer.cuda", "npformer.recording",
     "npformer.exercises", "npformer.explore"),
]
# op math lives here: only the backend switch and its CuPy stand-in may import numpy or cupy (and an op
# folder's cases.py, whose registry cases draw host inputs)
NO_ARRAY_LIBRARY = ("autograd", "npformer.runtime", "npformer.functional", "npformer.nn", "npformer.models", "npformer.optim")
# optional packages: imported only inside functions (lazily) of these modules
OPTIONAL = {"torch": ("npformer.interop",), "transformers": ("npformer.interop",),
            "safetensors": ("npformer.safetensors_file",)}


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name):
    if name.startswith("npformer.functional.") and name.endswith(".cases"):
        return layer_of("npformer.opcases")   # an op folder's registry cases: the registry's layer, imported by it
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
                or name in ("autograd.backend", "npformer.runtime.testdevice") \
                or name.endswith(".cases"), \
                f"{where}: get xp from autograd.backend instead"
        if root in OPTIONAL:
            assert any(name == p or name.startswith(p + ".") for p in OPTIONAL[root]) and not top, \
                f"{where}: {root} is optional, imported only inside functions of {OPTIONAL[root]}"
        if own_layer is not None and layer_of(imported) is not None:
            assert layer_of(imported) <= own_layer, f"{where}: a layer imports from one to its right"


MATH_FILES = sorted((ROOT / "npformer" / "functional").glob("*/math.py"))


@pytest.mark.parametrize("path", MATH_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_math_files_import_no_engine(path):
    """An op folder's math.py is the formulas alone, on the `xp` it is given: it imports nothing
    from the core (autograd: Tensor, Function, the backend) or the runtime (kernel tables,
    threads); only the standard library and other ops' math modules."""
    for imported, line, _ in imports(path):
        where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
        assert not any(imported == p or imported.startswith(p + ".") for p in ("autograd", "npformer.runtime")), \
            f"{where}: math.py takes xp as a parameter and imports no engine"


def test_importing_npformer_imports_no_optional_package():
    """torch, transformers and safetensors load only when a function that needs them is called."""
    code = ("import sys, npformer, npformer.interop, npformer.models, npformer.safetensors_file; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


MATH_FILES = sorted((ROOT / "npformer" / "functional").glob("*/math.py"))


@pytest.mark.parametrize("path", MATH_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_math_files_import_no_engine(path):
    """An op's math.py (its formulas, on the xp it is given) imports nothing from the engine: no
    autograd, no npformer.runtime, no array library; only the standard library and other math."""
    for imported, line, _ in imports(path):
        root = imported.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
        assert root in sys.stdlib_module_names or root == "__future__" or imported.startswith("npformer.functional."), \
            where
        assert not imported.startswith(("autograd", "npformer.runtime")), f"{where}: math takes no engine"


CORE_FILES = sorted((ROOT / "autograd").rglob("*.py"))


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_only_the_core(path):
    """autograd/ is the whole core: its files import autograd, the standard library and, in the
    backend switch only, numpy and cupy. The runtime plugs in through autograd.hooks."""
    for imported, line, _ in imports(path):
        root = imported.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
        if root in ("numpy", "cupy"):
            assert module_name(path) == "autograd.backend", f"{where}: only the backend switch imports {root}"
        else:
            assert root == "autograd" or root in sys.stdlib_module_names or root == "__future__", \
                f"{where}: the core imports only itself (register a hook in autograd.hooks instead)"


def test_importing_the_core_changes_nothing_in_the_process():
    """`import autograd` loads no npformer module, starts no thread and leaves malloc alone (no
    C-library handle is opened, so mallopt is never called); `import npformer` starts the runtime,
    which plugs into the core's hooks and keeps freed memory."""
    code = """if True:
        import ctypes, json, sys, threading
        opened, real_cdll = [], ctypes.CDLL

        def cdll(name, *args, **kwargs):  # host_memory's mallopt goes through CDLL(None), the process's libc
            opened.extend([name] if name is None else [])
            return real_cdll(name, *args, **kwargs)
        ctypes.CDLL = cdll
        threads_before = threading.active_count()
        import autograd
        core = dict(npformer=sorted(m for m in sys.modules if m.split(".")[0] == "npformer"),
                    threads=threading.active_count() - threads_before, libc_opened=len(opened),
                    hooks=len(autograd.hooks.backward_started) + len(autograd.hooks.host_read),
                    devices=list(autograd.backend.DEVICES))
        import npformer
        from npformer.runtime import deferred, lookahead
        runtime = dict(backward_started=autograd.hooks.backward_started == [lookahead.end_pass],
                       host_read=autograd.hooks.host_read == [deferred.raise_pending],
                       devices=list(autograd.backend.DEVICES), libc_opened=len(opened) > 0)
        print(json.dumps(dict(core=core, runtime=runtime)))
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), NPFORMER_HOST_MEMORY="keep")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout)
    assert result["core"] == dict(npformer=[], threads=0, libc_opened=0, hooks=0, devices=["cpu", "cuda"]), out.stdout
    keeps = platform.libc_ver()[0] == "glibc"  # host_memory opens the C library on glibc only
    assert result["runtime"] == dict(backward_started=True, host_read=True, devices=["cpu", "cuda", "test"],
                                     libc_opened=keeps), out.stdout


RUNTIME_MODULES = sorted(module_name(p) for p in (ROOT / "npformer" / "runtime").glob("*.py"))


def test_each_runtime_module_imports_first_without_a_cycle():
    """Whichever runtime module a program imports first (npformer's __init__ then runs around it),
    the import completes and the runtime is plugged in."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in RUNTIME_MODULES:
        code = f"import {name}, autograd; assert autograd.hooks.host_read and 'test' in autograd.backend.DEVICES"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert out.returncode == 0, f"import {name} first: {out.stderr}"


MATH_FILES = sorted((ROOT / "npformer" / "functional").glob("*/math.py"))


@pytest.mark.parametrize("path", MATH_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_math_files_import_no_engine(path):
    """An op's math.py (the formulas on `xp`) imports only the standard library and other math-style
    modules of npformer.functional (another op's math.py, or a formula module such as activation's
    erf.py): nothing from autograd or npformer.runtime, no kernel table, Tensor or Function; and so
    do the npformer modules it imports."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for imported, line, _ in imports(current):
            root = imported.split(".")[0]
            where = f"{current.relative_to(ROOT)}:{line} imports {imported}"
            if root in sys.stdlib_module_names or root == "__future__":
                continue
            assert imported.startswith("npformer.functional."), f"{where}: math files import no engine code"
            parts = imported.split(".")
            target = next((ROOT.joinpath(*parts[:n]).with_suffix(".py") for n in (len(parts), len(parts) - 1)
                           if ROOT.joinpath(*parts[:n]).with_suffix(".py").is_file()), None)
            assert target is not None and target.name not in ("__init__.py", "cpu.py", "cuda.py"), \
                f"{where}: only other math-style modules"
            todo.append(target)
