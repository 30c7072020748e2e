"""The registry's checks (tests/helpers.py::op_tests) of every case whose family names no test
file of its own, or that has no family: a new op of the library is tested without one; and, for
every case, the gradient taken with create_graph against the plain backward's."""
import numpy as np
import pytest

from npformer import opcases

from helpers import op_tests

UNFILED = [c for c in opcases.CASES if c.family is None or opcases.FAMILIES[c.family].tests is None]

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests(UNFILED)


@pytest.mark.parametrize("case", opcases.CASES, ids=[c.name for c in opcases.CASES])
def test_the_gradient_taken_with_create_graph_equals_the_plain_backwards(case, device):
    """Every registered case, filed or not: the first derivative that second derivatives
    differentiate (each op's differentiable_backward) is the gradient the backward computes."""
    assert opcases.create_graph_case(case, np.random.default_rng(3), device)
