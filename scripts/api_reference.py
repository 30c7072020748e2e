"""Write the API reference (docs/api.md) from the public API's signatures and docstrings.

    python scripts/api_reference.py > docs/api.md

`public_api()` walks what users import: every name in the `__all__` of the modules in
`MODULES`, and every public method and property of the public classes (members starting with
`_` are private, except `__call__`). tests/docs/test_api_docs.py checks that each entry has a
docstring and type hints, and that docs/api.md equals `render()`, so the page cannot drift.
"""
import dataclasses
import importlib
import inspect
import re
import sys
import types

MODULES = ("autograd", "npformer.runtime", "npformer", "npformer.functional", "npformer.nn", "npformer.nn.init",
           "npformer.models", "npformer.optim", "npformer.data", "npformer.training", "npformer.decoding",
           "npformer.checkpoint", "npformer.interop", "npformer.distributed", "npformer.plots", "npformer.cuda",
           "npformer.exercises")
PROJECT = ("autograd", "npformer")
HEADER = """# API reference

Generated from the signatures and docstrings by `python scripts/api_reference.py > docs/api.md`
(tests/docs/test_api_docs.py fails when this page differs from the code). Grouped by module, in the
order of the layers (`autograd` -> `npformer.runtime` -> `npformer.functional` -> `npformer.nn` ->
`npformer.models` -> the rest); a name exported by several modules is documented once, where it is defined.

Types: `Array` is a numpy or CuPy array (`numpy.ndarray`, `cupy.ndarray`, or the "test" device's);
`ArrayLike` is anything that becomes one (a Tensor, an array, nested lists, a number); `DType` is a
dtype or its name (`"float32"`); shapes are written `(B, T, E)`: batch, positions, features.
"""


@dataclasses.dataclass
class Entry:
    """One documented object: `kind` is module, class, function, method, property or data."""

    module: str       # the module whose section lists it
    name: str         # "Tensor", "Tensor.backward", "manual_seed"
    kind: str
    obj: object
    skip_first: bool = False  # the signature's first parameter is self / cls
    base: type = None  # a class's nearest documented (or outside) base class, shown with it

    @property
    def function(self):
        """The function whose signature this entry shows: a class's constructor (its project
        `__init__`, else the class), a property's getter; None for modules and data."""
        if self.kind == "class":
            return constructor(self.obj)
        if self.kind == "property":
            return self.obj.fget
        return self.obj if self.kind in ("function", "method") else None


def constructor(cls):
    """The `__init__` that a project class (or its nearest project base) defines, else the
    class itself (NamedTuples, classes without arguments)."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and klass.__module__.startswith(PROJECT):
            return vars(klass)["__init__"]
    return cls


def exported_names(module):
    """`module.__all__`, or (for a module without one) the public functions and classes defined in it."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, obj in vars(module).items() if not name.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__]


def _home(obj, exporters):
    """The module among `exporters` that documents `obj`: the one it is defined in (the longest
    prefix of its `__module__`), else the first exporter."""
    defined = getattr(obj, "__module__", None) or ""
    prefixes = [m for m in exporters if defined == m or defined.startswith(m + ".")]
    return max(prefixes, key=len) if prefixes else exporters[0]


def class_members(cls, documented=()):
    """(name, raw member, defining class) for the public methods and properties of `cls` defined
    in its own body or in a project base class that is not in `documented` (the public classes,
    whose members are documented with them)."""
    seen = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(PROJECT) or (klass is not cls and klass in documented):
            continue
        for name, member in vars(klass).items():
            if name in seen or (name.startswith("_") and name != "__call__"):
                continue
            if isinstance(member, (staticmethod, classmethod, property, types.FunctionType)):
                seen.add(name)
                yield name, member, klass


def _base(cls, documented):
    for base in cls.__mro__[1:]:
        if base in documented or not base.__module__.startswith(PROJECT):
            return None if base is object else base
    return None


def public_api():
    """Every public entry of `MODULES`, each object once (under its home module), in module order."""
    modules = {name: importlib.import_module(name) for name in MODULES}
    exporters = {}
    for module_name, module in modules.items():
        for name in exported_names(module):
            exporters.setdefault(id(getattr(module, name)), []).append(module_name)
    documented = {getattr(modules[m], name) for m in MODULES for name in exported_names(modules[m])
                  if inspect.isclass(getattr(modules[m], name))}
    entries, done = [], set()
    for module_name, module in modules.items():
        entries.append(Entry(module_name, module_name, "module", module))
        for name in exported_names(module):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__ not in MODULES:
                    entries.append(Entry(module_name, name, "module", obj))
                continue
            if id(obj) in done or _home(obj, exporters[id(obj)]) != module_name:
                continue
            done.add(id(obj))
            if inspect.isclass(obj):
                entries.append(Entry(module_name, name, "class", obj, skip_first=constructor(obj) is not obj,
                                     base=_base(obj, documented)))
                for member_name, member, _ in class_members(obj, documented):
                    kind = "property" if isinstance(member, property) else "method"
                    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    entries.append(Entry(module_name, f"{name}.{member_name}", kind, function,
                                         skip_first=not isinstance(member, staticmethod)))
            elif callable(obj):
                entries.append(Entry(module_name, name, "function", obj))
            else:
                entries.append(Entry(module_name, name, "data", obj))
    return entries


def _annotation(annotation):
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _default(value):
    """A default's text, the same on every machine (no memory addresses)."""
    if callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    text = repr(value)
    return "..." if " at 0x" in text else text


def _defaults_of(entry):
    """{parameter: text} for defaults that a repr would not show: a dataclass's default factories."""
    cls = entry.obj if entry.kind == "class" else None
    if cls is None or not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f"{f.default_factory.__name__}()" for f in dataclasses.fields(cls)
            if f.default_factory is not dataclasses.MISSING}


def signature(entry, prefix=""):
    """`prefix name(param: type = default, ...) -> type`, annotations as written in the source;
    one parameter per line when that is long."""
    name = prefix + (entry.name.rsplit(".", 1)[-1] if entry.kind in ("method", "property") else entry.name)
    try:
        sig = inspect.signature(entry.function)
    except ValueError:  # a class whose constructor is a builtin's (an exception class)
        return name
    params = list(sig.parameters.values())[1 if entry.skip_first else 0:]
    factories = _defaults_of(entry)
    parts, keyword_only = [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
        keyword_only = keyword_only or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            default = factories.get(p.name) or _default(p.default)
            text += f" = {default}" if p.annotation is not p.empty else f"={default}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    returns = "" if sig.return_annotation is sig.empty or entry.kind == "class" else \
        f" -> {_annotation(sig.return_annotation)}"
    line = f"{name}({', '.join(parts)}){returns}"
    if len(line) <= 100:
        return line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def _anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9_ -]", "", heading.lower()).replace(" ", "-")


def _markdown(doc):
    """A docstring as Markdown: indented blocks after a blank line stay code; elsewhere the
    characters Markdown would take as markup (`*`, `_`, `<`) are escaped outside `code`."""
    out, code = [], False
    for line in doc.split("\n"):
        indented = line.startswith("    ")
        after_colon = bool(out) and out[-1].rstrip().endswith(":") and not code
        code = indented and (code or not out or not out[-1].strip() or after_colon)
        if code and after_colon:
            out.append("")  # Markdown starts a code block only after a blank line
        if code or not line.strip():
            out.append(line)
            continue
        parts = line.split("`")
        for i in range(0, len(parts), 2 if len(parts) % 2 else 1):  # unbalanced backticks: escape all
            parts[i] = re.sub(r"([*_])", r"\\\1", parts[i]).replace("<", "&lt;")
        out.append("`".join(parts))
    return "\n".join(out)


def _summary(doc):
    """A module docstring's first paragraph (with the next ones while a paragraph ends with a colon)."""
    paragraphs = doc.split("\n\n")
    count = 1
    while count < len(paragraphs) and paragraphs[count - 1].rstrip().endswith(":"):
        count += 1
    return "\n\n".join(paragraphs[:count])


def _doc(obj):
    return _markdown((inspect.getdoc(obj) or "(undocumented)").strip())


def render(entries=None):
    """The Markdown of docs/api.md."""
    entries = public_api() if entries is None else entries
    lines = [HEADER, "## Contents", ""]
    lines += [f"- [`{e.name}`](#{_anchor(e.name)})" for e in entries if e.kind == "module" and e.name == e.module]
    homes = {id(e.obj): e.module for e in entries if e.kind in ("class", "function", "data")}
    for e in entries:
        if e.kind == "module" and e.name == e.module:
            module = importlib.import_module(e.name)
            elsewhere = [(name, homes[id(getattr(module, name))]) for name in exported_names(module)
                         if homes.get(id(getattr(module, name)), e.name) != e.name]
            lines += ["", f"## {e.name}", "", _doc(e.obj)]
            if elsewhere:
                lines += ["", "Also exported here: " + ", ".join(
                    f"[`{name}`](#{_anchor(f'{home}.{name}')}) ({home})" for name, home in elsewhere) + "."]
        elif e.kind == "module":
            lines += ["", f"### {e.module}.{e.name}", "", f"Module. {_summary(_doc(e.obj))}"]
        elif e.kind == "data":
            value = _default(e.obj) if len(repr(e.obj)) <= 80 else f"a {type(e.obj).__name__}"
            lines += ["", f"### {e.module}.{e.name}", "", f"Constant: `{value}`."]
        elif e.kind in ("class", "function"):
            lines += ["", f"### {e.module}.{e.name}", "", "```python",
                      signature(e, "class " if e.kind == "class" else ""), "```", ""]
            if e.base is not None:
                home = homes.get(id(e.base))
                base = f"[`{e.base.__name__}`](#{_anchor(f'{home}.{e.base.__name__}')})" if home \
                    else f"`{e.base.__name__}`"
                lines += [f"Subclass of {base}.", ""]
            lines.append(_doc(e.obj))
        else:
            returns = inspect.signature(e.function).return_annotation
            text = signature(e) if e.kind == "method" else "property " + e.name.rsplit(".", 1)[-1] + (
                "" if returns is inspect.Signature.empty else f": {_annotation(returns)}")
            lines += ["", f"#### {e.module}.{e.name}", "", "```python", text, "```", "", _doc(e.obj)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
