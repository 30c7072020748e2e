"""The registry's checks (tests/helpers.py::op_tests) of every case whose family names no test
file of its own, or that has no family: a new op of the library is tested without one."""
from npformer import opcases

from helpers import op_tests

UNFILED = [c for c in opcases.CASES if c.family is None or opcases.FAMILIES[c.family].tests is None]

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests(UNFILED)
