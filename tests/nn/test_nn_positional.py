"""npformer.nn positional encodings: the sinusoidal table against torch's (the seed article's
PositionalEncoding), recomputed rather than upcast, offsets, and learned positions (gradcheck,
state). RoPE is tested with its op in test_op_rotary.py."""
import math

import numpy as np
import pytest

from autograd import Tensor
from npformer import nn

from helpers import gradcheck_module


def torch_sinusoids(torch, max_len, d_model):
    """The seed article's PositionalEncoding table, in float64."""
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    position = torch.arange(0, max_len, dtype=torch.float64).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.numpy()


def test_sinusoidal_double_matches_torch_to_1e12(torch, device):
    m = nn.SinusoidalPositionalEncoding(16, max_len=600).double().to(device)
    x = Tensor(np.zeros((2, 600, 16)), device=device)
    np.testing.assert_allclose(m(x).numpy()[1], torch_sinusoids(torch, 600, 16), atol=1e-12, rtol=0)
    assert m.pe.device == device and m.state_dict() == {} and len(list(m.buffers())) == 1


def test_sinusoidal_table_is_recomputed_not_upcast():
    m = nn.SinusoidalPositionalEncoding(8, max_len=50)
    assert m.pe.dtype == np.float32
    exact = nn.positional.sinusoid_table(50, 8, np)
    np.testing.assert_array_equal(m.pe.numpy(), exact.astype(np.float32))
    np.testing.assert_array_equal(m.double().pe.numpy(), exact)  # not float32 values widened


def test_sinusoidal_offset_and_too_long():
    m = nn.SinusoidalPositionalEncoding(4, max_len=10).double()
    table = nn.positional.sinusoid_table(10, 4, np)
    np.testing.assert_array_equal(m(Tensor(np.zeros((1, 3, 4))), offset=7).numpy()[0], table[7:10])
    with pytest.raises(ValueError, match="max_len=10"):
        m(Tensor(np.zeros((1, 11, 4))))
    with pytest.raises(ValueError, match="max_len=10"):
        m(Tensor(np.zeros((1, 2, 4))), offset=9)


def test_learned_positions_gradcheck_and_state(device, rng):
    m = nn.LearnedPositionalEmbedding(5, 3)
    assert list(m.state_dict()) == ["weight"]
    gradcheck_module(m, lambda m, x: m(x, offset=1), [rng.standard_normal((2, 3, 3))], device)
    with pytest.raises(ValueError, match="max_len=5"):
        m(Tensor(np.zeros((1, 6, 3)), device=device))
