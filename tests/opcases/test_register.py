"""opcases.register: a user's case gets into the same registry as the library's, with a
family or without, named inputs, a twin of its own; bad registrations are refused by name."""
import io

import numpy as np
import pytest

import autograd
from npformer import gradcheck, opcases
from npformer.opcases import registry

from helpers import WrongSoftmax


@pytest.fixture
def scratch_registry(monkeypatch):
    """The registry as it is, restored after the test."""
    monkeypatch.setattr(registry, "CASES", list(registry.CASES))
    monkeypatch.setattr(registry, "_ORIGINS", dict(registry._ORIGINS))
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    return registry


def _square(x):
    return x * x


def test_a_case_without_a_family_is_registered_and_checked_with_its_twin(scratch_registry):
    case = opcases.OpCase("square", lambda rng: {"x": rng.standard_normal((2, 3))}, _square,
                          lambda t, x: x * x, twin=lambda x: x ** 2.0)
    assert scratch_registry.register(case) is case
    assert case in scratch_registry.CASES and case.family is None
    assert scratch_registry.from_module(__name__) == [case]
    assert opcases.instantiate(case, np.random.default_rng(0)).labels == ["x"]
    assert opcases.compare_with_twin(case, np.random.default_rng(0)).passed
    row = gradcheck.run_case(case)
    assert row["passed"] and row["twin"][2] and row["fd"][2] and row["torch"] is None


def test_a_wrong_twin_fails_its_column(scratch_registry):
    case = opcases.OpCase("square, wrong twin", lambda rng: [rng.standard_normal((2, 3))], _square,
                          twin=lambda x: x * 2.0)
    row = gradcheck.run_case(case)
    assert not row["passed"] and row["fd"][2] and not row["twin"][2]
    assert any(m.startswith("twin: output 0: max abs difference") for m in row["messages"])


def test_register_refuses_a_repeated_name_an_unknown_family_and_what_is_not_a_case(scratch_registry):
    case = opcases.OpCase("F.relu", lambda rng: [rng.standard_normal(3)], _square)
    with pytest.raises(ValueError, match=r"a case named 'F.relu' is already registered \(by npformer.functional.activation.cases\)"):
        scratch_registry.register(case)
    with pytest.raises(ValueError, match="names family 'swish', which is not registered; register its Family first"):
        scratch_registry.register(opcases.OpCase("mine", lambda rng: [], _square, family="swish"))
    with pytest.raises(TypeError, match="fn must be callable, got str"):
        scratch_registry.register(opcases.OpCase("mine", lambda rng: [], "square"))
    with pytest.raises(TypeError, match="expected OpCase or Family objects, got function"):
        scratch_registry.register(_square)
    family = opcases.Family("square", ("square",), __file__)
    scratch_registry.register(family, opcases.OpCase("square (family)", lambda rng: [np.ones(2)], _square,
                                                     family="square"))
    assert [c.name for c in opcases.cases("square")] == ["square (family)"]
    with pytest.raises(ValueError, match="input_names: one name per input expected \\(1\\)"):
        opcases.instantiate(opcases.OpCase("n", lambda rng: [np.ones(2)], _square, input_names=("a", "b")),
                            np.random.default_rng(0))


class WrongShape(autograd.Function):
    """Returns a gradient of the wrong shape: the tape refuses it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, dy):
        return dy[:1]


def test_a_case_that_raises_is_an_error_row_and_the_table_goes_on(torch):
    bad = opcases.OpCase("wrong shape", lambda rng: [rng.standard_normal((3, 4))], WrongShape.apply,
                         lambda t, x: x * 2.0)
    good = opcases.select("F.relu")[0]
    stream = io.StringIO()
    assert gradcheck.run([bad, good], torch, stream) is False   # was: a RuntimeError out of the table
    lines = stream.getvalue().splitlines()
    row = next(line for line in lines if line.startswith("wrong shape"))
    assert row.count("ERROR") == 1 and row.rstrip().endswith("FAIL")   # the first column that runs the backward
    assert row.count("not judged") == 3       # torch x2, create_graph: the same error, not repeated (no twin)
    assert row.count("not defined") == 2     # WrongShape has no differentiable_backward and no jvp: not asked for
    assert "finite differences: RuntimeError: Function" in stream.getvalue() and "invalid gradient" in stream.getvalue()
    assert next(line for line in lines if line.startswith("F.relu")).rstrip().endswith("PASS")


def test_a_failing_row_shows_the_message_that_names_the_input_and_index(torch):
    broken = opcases.OpCase("broken softmax", lambda rng: {"logits": rng.standard_normal((3, 4))}, WrongSoftmax.apply,
                            lambda t, x: t.softmax(x, dim=-1))
    stream = io.StringIO()
    assert gradcheck.run([broken], torch, stream) is False
    text = stream.getvalue()
    assert "    finite differences: gradcheck: your backward (yours) against central finite differences" in text
    assert "      logits: wrong, max diff" in text and "worst at index (" in text
    assert "    torch float32: gradient of logits: max abs difference" in text
