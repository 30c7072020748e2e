"""F.relu and nn.ReLU: the registry's cases (gradcheck, torch, composite twin on every device;
second derivatives: gradgradcheck, torch's double backward) and clear errors."""
import numpy as np

from autograd import Tensor
import npformer.functional as F

from helpers import assert_clear_error, double_backward_tests, forward_mode_tests, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("relu")
test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("relu")
test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 = forward_mode_tests("relu")


def test_integer_input_raises_a_clear_error():
    assert_clear_error(lambda: F.relu(Tensor(np.zeros(3, dtype=np.int64))), TypeError, ["floating", "int64"])
