"""F.split_heads: the registry's cases (one and three chunks: gradcheck, torch, composite twin on
every device; forward mode: gradcheck(check_forward_ad=True) and torch.func.jvp) and clear errors
for bad shapes."""
import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor

from helpers import double_backward_tests, forward_mode_tests, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("split_heads")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("split_heads")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("split_heads")


@pytest.mark.parametrize("shape, num_heads, chunks, match", [
    ((2, 4, 12), 5, 1, "chunks=1, num_heads=5"), ((2, 12), 2, 3, "batch, seq"), ((2, 4, 12), 0, 3, "num_heads")])
def test_split_heads_rejects_bad_shapes(shape, num_heads, chunks, match):
    with pytest.raises(ValueError, match=match):
        F.split_heads(Tensor(np.zeros(shape)), num_heads, chunks=chunks)


def test_the_gradient_of_split_heads_is_one_op_that_merges_the_heads_in_every_order():
    """split_heads' create_graph gradient is MergeHeadsFunction, linear like the split: checked as an
    op of its own (gradcheck, gradgradcheck through its differentiable backward, the split), and its
    tangent merges the heads' tangents, a zero one for a head without."""
    import autograd
    from autograd import forward_ad as fwAD, gradcheck
    from npformer.functional.attention import MergeHeadsFunction

    rng = np.random.default_rng(2)
    g = [Tensor(rng.standard_normal((2, 2, 3, 2)), requires_grad=True) for _ in range(3)]

    def merged_cubed(*g):
        return MergeHeadsFunction.apply(*g, shape=(2, 3, 12), layout=(3, 2)) ** 3

    assert gradcheck(merged_cubed, g)
    assert autograd.gradgradcheck(merged_cubed, g)
    tangent = rng.standard_normal((2, 2, 3, 2))
    with fwAD.dual_level():
        merged = MergeHeadsFunction.apply(fwAD.make_dual(g[0], tangent), g[1], g[2], shape=(2, 3, 12), layout=(3, 2))
        t = fwAD.unpack_dual(merged).tangent
    expected = np.concatenate([tangent.swapaxes(1, 2).reshape(2, 3, 4), np.zeros((2, 3, 8))], axis=-1)
    np.testing.assert_array_equal(t, expected)
