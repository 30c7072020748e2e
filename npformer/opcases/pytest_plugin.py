"""The pytest plugin (installed with npformer, entry point `pytest11`): each case that your
module registers becomes a test.

    pytest --gradcheck-module mypkg.ops

imports mypkg.ops (your Functions and the `npformer.opcases.register(OpCase(...))` calls
next to them) and adds one test per case, named `<module>::<case name>`, which runs the
row of `python -m npformer.gradcheck --module mypkg.ops` (finite differences, torch in float64
and float32 when torch is installed and the case has a reference, the twin when it has one);
a failing test shows that row and the messages under it. Without the option the plugin does
nothing.
"""
import io

import pytest


def pytest_addoption(parser):
    """--gradcheck-module MODULE (repeatable)."""
    parser.getgroup("npformer").addoption(
        "--gradcheck-module", action="append", default=[], metavar="MODULE",
        help="run every op case that this module registers with npformer.opcases.register (repeatable)")


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect items, so that they select these too
def pytest_collection_modifyitems(session, config, items):
    """Each --gradcheck-module's cases, added to the collected tests (and counted)."""
    names = config.getoption("gradcheck_module")
    if not names:
        return
    from npformer import opcases   # only when asked: every pytest run in the environment loads the plugin

    for name in names:
        try:
            cases = opcases.from_module(name)
        except Exception as e:  # noqa: BLE001  (the user's module: what importing it raised)
            raise pytest.UsageError(f"--gradcheck-module {name}: importing it raised {type(e).__name__}: {e}") from e
        if not cases:
            raise pytest.UsageError(f"--gradcheck-module {name}: it registers no case "
                                    "(call npformer.opcases.register(OpCase(...)) in it)")
        module = CaseModule.from_parent(session, name=name, nodeid=name, cases=cases)
        found = list(module.collect())
        config.hook.pytest_collectreport(report=pytest.CollectReport(module.nodeid, "passed", None, found))
        items.extend(found)   # the report counts them in "collected N items"


class CaseModule(pytest.Collector):
    """The cases one module registered: its tests, `<module>::<case name>`."""

    def __init__(self, *, cases, **kwargs):
        super().__init__(**kwargs)
        self.cases = cases

    def collect(self):
        """One CaseItem per case."""
        return [CaseItem.from_parent(self, name=case.name, case=case) for case in self.cases]


class CaseFailed(Exception):
    """A case's row failed; the message is the row and what failed, as the command prints it."""


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
        stream = io.StringIO()
        if not gradcheck.run([self.case], torch, stream):
            raise CaseFailed(stream.getvalue())

    def repr_failure(self, excinfo):
        """A failed row as the command prints it, not a traceback into the plugin."""
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        """The test's heading in pytest's report."""
        return self.path, None, f"gradcheck: {self.case.name}"
