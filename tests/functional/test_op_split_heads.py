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
