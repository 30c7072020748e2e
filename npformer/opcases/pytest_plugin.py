"""The pytest plugin (installed with npformer, entry point `pytest11`): each case that your
module registers becomes a test.

    pytest --gradcheck-module mypkg.ops          (or --gradcheck-module mypkg/ops.py)

run from the folder that holds mypkg (which is put on sys.path, as `python -m pytest` does),
imports mypkg.ops (your Functions and the `npformer.opcases.register(OpCase(...))` calls
next to them) and adds one test per case, `mypkg/ops.py::<case name>` (the module's file and
the case), which runs the row of `python -m npformer.gradcheck --module mypkg.ops` (finite
differences, torch in float64 and float32 when torch is installed and the case has a reference,
the twin when it has one, create_graph, second order and forward mode: "not defined" for an op
without a double backward or a jvp rule unless the case or --gradcheck-require requires it).
A failing test's summary line names the column, the input and the worst entry; its report is
the row and the messages under it. A test id reruns as printed:

    pytest --gradcheck-module mypkg.ops "mypkg/ops.py::forgetful swish"

Each case runs under --gradcheck-time-limit (a case that never returns fails, "did not return
within N s"). Without --gradcheck-module the plugin does nothing.
"""
import contextlib
import io
import pathlib
import sys
import warnings

import pytest


def pytest_addoption(parser):
    """--gradcheck-module MODULE (repeatable), --gradcheck-require, --gradcheck-time-limit."""
    group = parser.getgroup("npformer")
    group.addoption("--gradcheck-module", action="append", default=[], metavar="MODULE",
                    help="run every op case that this module (a dotted name or a path to its file) registers with "
                         "npformer.opcases.register (repeatable)")
    group.addoption("--gradcheck-require", default="", metavar="COLUMNS",
                    help="higher columns every case must define: second-order,forward-mode (as gradcheck --require)")
    group.addoption("--gradcheck-time-limit", type=float, default=None, metavar="SECONDS",
                    help="a case that does not return within this many seconds fails (0: no limit; default: "
                         "python -m npformer.gradcheck's)")


_MODULES = pytest.StashKey[dict]()     # module name -> (its file, its cases)
_COLLECTED = pytest.StashKey[set]()    # the files collected from the command line's paths


def _modules(config):
    """{module name: (its file as a Path, or None; its cases)} of every --gradcheck-module,
    imported once; pytest.UsageError for one that cannot be imported or registers no case."""
    if _MODULES in config.stash:
        return config.stash[_MODULES]
    from npformer import opcases   # only when asked: every pytest run in the environment loads the plugin

    modules = {}
    for spec in config.getoption("gradcheck_module"):
        try:
            with _quiet_third_party():
                name = opcases.module_name(spec, config.invocation_params.dir)
                cases = opcases.from_module(name)
        except Exception as e:  # noqa: BLE001  (the user's module: what importing it raised)
            raise pytest.UsageError(f"--gradcheck-module {spec}: importing it raised {type(e).__name__}: {e}") from e
        if not cases:
            raise pytest.UsageError(f"--gradcheck-module {spec}: it registers no case "
                                    "(call npformer.opcases.register(OpCase(...)) in it)")
        file = getattr(sys.modules[name], "__file__", None)
        modules[name] = (pathlib.Path(file).resolve() if file else None, cases)
    config.stash[_MODULES] = modules
    return modules


@contextlib.contextmanager
def _quiet_third_party():
    """Silence the DeprecationWarnings that torch raises when it loads its own parts
    (torch.jit.script in its forward-AD decompositions): they are torch's, not the user's module's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
        yield


def pytest_configure(config):
    """The --gradcheck-require value checked before any collection."""
    from_option = config.getoption("gradcheck_require")
    if from_option:
        known = ("second-order", "forward-mode")
        unknown = [r for r in from_option.split(",") if r.strip() and r.strip() not in known]
        if unknown:
            raise pytest.UsageError(f"--gradcheck-require: expected a comma-separated list of {', '.join(known)}, "
                                    f"got {', '.join(unknown)}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    """Import the --gradcheck-module modules before collecting: a usage error comes first."""
    if session.config.getoption("gradcheck_module"):
        _modules(session.config)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path, parent):
    """A --gradcheck-module's file named on the command line ("mypkg/ops.py::forgetful swish", a
    test id as printed) is collected as its cases, never imported as a test module."""
    if not parent.config.getoption("gradcheck_module"):
        return None
    for name, (file, cases) in _modules(parent.config).items():
        if file is not None and file == pathlib.Path(module_path).resolve():
            parent.config.stash.setdefault(_COLLECTED, set()).add(name)
            return CaseModule.from_parent(parent, path=pathlib.Path(module_path), cases=cases)
    return None


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect items, so that they select these too
def pytest_collection_modifyitems(session, config, items):
    """Each --gradcheck-module's cases, added to the collected tests (and counted), unless its
    file was named on the command line (then collected from there)."""
    if not config.getoption("gradcheck_module"):
        return
    collected = config.stash.get(_COLLECTED, set())
    for name, (file, cases) in _modules(config).items():
        if name in collected:
            continue
        if file is not None:
            module = CaseModule.from_parent(session, path=file, cases=cases)
        else:   # a namespace package: no file, its name as the id
            module = CaseModule.from_parent(session, path=config.rootpath, name=name, nodeid=name, cases=cases)
        found = list(module.collect())
        config.hook.pytest_collectreport(report=pytest.CollectReport(module.nodeid, "passed", None, found))
        items.extend(found)   # the report counts them in "collected N items"


class CaseModule(pytest.File):
    """The cases one module registered, as the tests of its file: `mypkg/ops.py::<case name>`."""

    def __init__(self, *, cases, **kwargs):
        super().__init__(**kwargs)
        self.cases = cases

    def collect(self):
        """One CaseItem per case."""
        return [CaseItem.from_parent(self, name=case.name, case=case) for case in self.cases]


class CaseFailed(Exception):
    """A case's row failed; the message is one summary line (the column, the input, the worst
    entry), then the row and what failed, as the command prints them."""


class CaseItem(pytest.Item):
    """One registered op case as a test: its row of the gradient-check table."""

    def __init__(self, *, case, **kwargs):
        super().__init__(**kwargs)
        self.case = case

    def runtest(self):
        """The case's row (torch columns when torch is installed); CaseFailed when it fails."""
        from npformer import gradcheck, interop

        try:
            torch = interop._torch()
        except ImportError:
            torch = None
        config = self.config
        require = [r.strip() for r in config.getoption("gradcheck_require").split(",") if r.strip()]
        seconds = config.getoption("gradcheck_time_limit")
        stream, rows = io.StringIO(), []
        with _quiet_third_party():
            passed = gradcheck.run([self.case], torch, stream, require=require, rows=rows,
                                   seconds=gradcheck.DEFAULT_TIME_LIMIT if seconds is None else seconds)
        if not passed:
            raise CaseFailed(f"{gradcheck.summary(rows[0], name=False)}\n{stream.getvalue()}")

    def repr_failure(self, excinfo):
        """A failed row as the command prints it, not a traceback into the plugin; its first line
        is pytest's one-line summary."""
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        """The test's heading in pytest's report."""
        return self.path, None, f"gradcheck: {self.case.name}"
