"""The op-case registry: one description per op case (its inputs and edge cases, the PyTorch
reference, the twin, the tolerances), which drives

- the per-op test files (`tests/functional/test_op_<family>.py`, through `tests/helpers.py::op_tests`),
- `python -m npformer.gradcheck` (one row per case; `--module mypkg.ops` for a user's cases),
- the pytest plugin (`pytest --gradcheck-module mypkg.ops`: each case a test),
- the op table of docs/backprop.md (`markdown_table()`, checked by tests/docs/test_backprop_doc.py).

    from npformer import opcases
    for case in opcases.cases("softmax"):
        opcases.gradcheck_case(case, np.random.default_rng(0))      # autograd.gradcheck, float64
        print(opcases.compare_with_torch(case, torch, np.random.default_rng(0)))
        opcases.gradgradcheck_case(case, np.random.default_rng(0))  # second derivatives (higher.py)
        print(opcases.compare_jvp_with_torch(case, torch, np.random.default_rng(0)))  # forward mode

Every case gets in through `register` (registry.py), the library's own (each op folder's
cases.py, which ops.py imports; modules.py) as a user's. A new op of the library registers its
`Family` and cases in its folder's cases.py (an nn module in modules.py); a family without a
test file of its own is tested by tests/opcases/test_registered_cases.py.
"""
import re

from .case import (COMPOSITE, REQUIREMENTS, TOLERANCE, Comparison, Instance, OpCase, compare, compare_with_torch, compare_with_twin,
                   gradcheck_case, instantiate, torch_args)
from .higher import (FORWARD_MODE_CHECKS, case_jvp, compare_hvp, compare_hvp_with_torch, compare_jvp_with_torch,
                     create_graph_case, forward_mode_case, gradgradcheck_case, hvp, undefined_rules)
from .registry import CASES, FAMILIES, Family, cases, from_module, module_name, register, select
from . import ops, modules  # noqa: E402,F401  (the library's cases register themselves: the ops' first)


def anchor(heading: str) -> str:
    """The link target of a markdown heading (GitHub's rule): lower case, punctuation dropped,
    spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def markdown_table() -> str:
    """The op table of docs/backprop.md: one row per op family with a derivation."""
    rows = ["| ops | derivation | code | autograd.Function | tests |", "|---|---|---|---|---|"]
    for f in FAMILIES.values():
        if f.section is not None:
            rows.append(f"| {', '.join(f'`{op}`' for op in f.ops)} | [{f.section}](#{anchor(f.section)}) | `{f.source}` | "
                        f"{', '.join(f'`{name}`' for name in f.functions)} | `{f.tests or 'tests/opcases'}` |")
    return "\n".join(rows)


__all__ = ["CASES", "COMPOSITE", "FAMILIES", "FORWARD_MODE_CHECKS", "REQUIREMENTS", "TOLERANCE", "Comparison", "Family", "Instance", "OpCase", "anchor",
           "case_jvp", "cases", "compare", "compare_hvp", "compare_hvp_with_torch", "compare_jvp_with_torch",
           "compare_with_torch", "compare_with_twin", "create_graph_case", "forward_mode_case", "from_module", "gradcheck_case",
           "gradgradcheck_case", "hvp", "instantiate", "markdown_table", "module_name", "register", "select", "torch_args",
           "undefined_rules"]
