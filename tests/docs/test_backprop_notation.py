"""docs/backprop.md keeps dy for the upstream gradient only (issue 44 item 6): a partial
derivative is written with ∂, never as dy/dx or dy_j/dx_i, which reads as the upstream gradient
divided by something."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_partial_derivatives_are_written_with_the_partial_sign():
    page = (ROOT / "docs" / "backprop.md").read_text()
    assert "dx_i = sum_j dy_j * ∂y_j/∂x_i" in page
    assert not re.findall(r"\bdy(_\w)?\s*/\s*dx", page), re.findall(r".*\bdy(?:_\w)?\s*/\s*dx.*", page)
