"""F.linear and nn.Linear: the registry's cases (gradcheck, torch, composite twin on every
device), torch's initialisation, and clear errors."""
import math

import numpy as np
import pytest

import npformer
from autograd import Tensor
import npformer.functional as F
from npformer import nn

from helpers import assert_clear_error, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("linear")


def test_linear_init_like_torch():
    npformer.manual_seed(0)
    m = nn.Linear(400, 300)
    bound = 1 / math.sqrt(400)  # kaiming_uniform_(a=sqrt(5)) and the bias rule both give 1/sqrt(fan_in)
    for p in (m.weight, m.bias):
        values = p.numpy()
        assert p.dtype == np.float32 and np.abs(values).max() <= bound
        assert abs(values.std() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)


def test_linear_errors():
    m = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="last dimension must be 3"):
        m(Tensor(np.zeros((2, 4))))
    with pytest.raises(TypeError, match="autograd.Tensor"):
        m(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="in_features must be an integer >= 1, got 0"):
        nn.Linear(0, 2)


W = np.zeros((5, 4))


@pytest.mark.parametrize("call, error, words", [
    (lambda: F.linear(Tensor(np.zeros((2, 3))), Tensor(W)), ValueError, ["weight.shape[1]=4", "(2, 3)"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4))), Tensor(W), Tensor(np.zeros(4))), ValueError, ["bias", "(5,)", "(4,)"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4))), Tensor(np.zeros(4))), ValueError, ["2-D", "(4,)"]),
    (lambda: F.linear([1.0, 2.0], Tensor(W)), TypeError, ["input", "list"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4)), device="test"), Tensor(W)), RuntimeError, ["device"]),
    (lambda: F.linear(Tensor(np.zeros((2, 4), dtype=np.float32)), Tensor(W)), TypeError, ["dtype"]),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    assert_clear_error(call, error, words)
