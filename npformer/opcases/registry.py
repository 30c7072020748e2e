"""The registry of op cases and op families: `register` is the one way in, for the library's
own ops (each op folder's cases.py, npformer/opcases/modules.py) and a user's module of Functions alike.

    from npformer.opcases import OpCase, register
    register(OpCase("my_swish", lambda rng: [rng.standard_normal((3, 4))], Swish.apply,
                    lambda t, x: x * t.sigmoid(x)))

`python -m npformer.gradcheck --module mypkg.ops` and `pytest --gradcheck-module mypkg.ops`
import the module and check the cases it registered (`from_module`).
"""
import dataclasses
import importlib
import os
import pathlib
import sys
from typing import Optional

from .case import REQUIREMENTS, OpCase


@dataclasses.dataclass(frozen=True)
class Family:
    """An op family: the public names it covers (`ops`), where its code lives (`source`, a
    path, and the autograd.Function classes in it), its derivation (`section`, a heading of
    docs/backprop.md, or None) and its test file (`tests`, or None: its cases are then run by
    tests/opcases/test_registered_cases.py). tests/opcases checks what a family names."""
    name: str
    ops: tuple
    source: str
    functions: tuple = ()
    section: Optional[str] = None
    tests: Optional[str] = None


FAMILIES = {}   # name -> Family, in registration order
CASES = []      # every registered OpCase, in registration order
_ORIGINS = {}   # case name -> the name of the module that registered it


def register(*items: OpCase | Family) -> OpCase | Family | tuple:
    """Add op cases and families to the registry (a family before its cases); returns the item
    (or the items). A case's name must be new and its family None or registered; the module
    that calls register is remembered, for `from_module`."""
    origin = sys._getframe(1).f_globals.get("__name__", "")   # the caller's module, as warnings' stacklevel
    for item in items:
        if isinstance(item, Family):
            if item.name in FAMILIES:
                raise ValueError(f"register: a family named {item.name!r} is already registered")
            FAMILIES[item.name] = item
        elif isinstance(item, OpCase):
            if item.name in _ORIGINS:
                raise ValueError(f"register: a case named {item.name!r} is already registered "
                                 f"(by {_ORIGINS[item.name]})")
            if item.family is not None and item.family not in FAMILIES:
                raise ValueError(f"register: case {item.name!r} names family {item.family!r}, which is not "
                                 f"registered; register its Family first, or leave family=None "
                                 f"(the families are {sorted(FAMILIES)})")
            for field in ("inputs", "fn"):
                if not callable(getattr(item, field)):
                    raise TypeError(f"register: case {item.name!r}: {field} must be callable, "
                                    f"got {type(getattr(item, field)).__name__}")
            unknown = [r for r in item.require if r not in REQUIREMENTS] if isinstance(item.require, tuple) else None
            if unknown is None or unknown:
                raise ValueError(f"register: case {item.name!r}: require must be a tuple of {REQUIREMENTS}, "
                                 f"got {item.require!r}")
            CASES.append(item)
            _ORIGINS[item.name] = origin
        else:
            raise TypeError(f"register: expected OpCase or Family objects, got {type(item).__name__}")
    return items[0] if len(items) == 1 else items


def cases(family: Optional[str] = None) -> list:
    """Every registered case, or those of one family (a key of FAMILIES)."""
    if family is not None and family not in FAMILIES:
        raise KeyError(f"no op family {family!r}; the families are {sorted(FAMILIES)}")
    return [c for c in CASES if family is None or c.family == family]


def select(pattern: str = "", modules: bool = True, among: Optional[list] = None) -> list:
    """The cases (of `among`, by default every registered one) whose name or family contains
    `pattern` (case-insensitive); modules=False leaves out the nn modules' cases."""
    pattern = pattern.lower()
    return [c for c in (CASES if among is None else among)
            if (pattern in c.name.lower() or pattern in (c.family or "").lower()) and (modules or c.module is None)]


def module_name(spec: str, folder: str | os.PathLike | None = None) -> str:
    """The dotted name of a module given as `spec`: a dotted name ("mypkg.ops") as it is, or a path
    to its file ("mypkg/ops.py", relative to `folder`, by default the current one), whose name
    counts the packages (folders with an __init__.py) above it. The folder holding the top
    package (for a dotted name, `folder`) is put first on sys.path when it is not there, as
    `python -m` does for the current folder. FileNotFoundError for a path that is not a file."""
    folder = pathlib.Path(folder or os.getcwd()).resolve()
    if not (spec.endswith(".py") or "/" in spec or os.sep in spec):
        _on_path(folder)
        return spec
    path = (folder / spec).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{spec}: no such file (expected a module's .py file or a dotted name: mypkg.ops)")
    parts, top = ([] if path.name == "__init__.py" else [path.stem]), path.parent
    while (top / "__init__.py").is_file():
        parts.insert(0, top.name)
        top = top.parent
    _on_path(top)
    return ".".join(parts)


def _on_path(folder: pathlib.Path) -> None:
    """Put `folder` first on sys.path unless it is there (the current folder counts as "")."""
    if all(pathlib.Path(entry or os.getcwd()).resolve() != folder for entry in sys.path):
        sys.path.insert(0, str(folder))


def from_module(name: str, folder: str | os.PathLike | None = None) -> list:
    """Import the module `name` (a user's module of Functions and their cases, by the user's
    choice: a dotted name or a path to its file, see `module_name`) and return the cases that
    it, or a module inside it, registered."""
    name = module_name(name, folder)
    importlib.import_module(name)
    return [c for c in CASES if _ORIGINS[c.name] == name or _ORIGINS[c.name].startswith(name + ".")]
