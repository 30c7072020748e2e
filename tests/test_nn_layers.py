"""npformer.nn basic layers and positional encodings: gradcheck (float64, random upstream
gradient, every input and parameter), torch parity forward and backward, errors.

Also holds the helpers the other test_nn_*/test_models_*/test_interop files import:
`assert_torch_parity` and `gradcheck_module`."""
import math

import numpy as np
import pytest

import autograd
from autograd import Tensor, backend
from npformer import interop, nn

from tolerances import scaled

F64 = dict(atol=1e-10, rtol=0.0)
F32 = dict(atol=1e-5, rtol=1e-4)


def as_numpy(a):
    return backend.as_numpy(a)


def assert_torch_parity(torch, ours, ours_fn, torch_fn, arrays, *, atol, rtol=0.0, device="cpu", seed=0):
    """Compare `ours` with `interop.to_torch(ours)` forward and backward.

    arrays: float input arrays (dtype of the model), given as leaf Tensors (on `device`) to
    ours_fn(module, *tensors) and as torch leaves to torch_fn(torch_module, *tensors); the
    functions return one output or a tuple (None entries are skipped). Backward uses random
    upstream gradients; compared: every output, every input gradient and the gradient of
    every parameter (matched by name). atol is set at unit scale: it grows with the magnitudes
    of the inputs and parameters (and, for gradients, of the upstream gradients).
    """
    theirs = interop.to_torch(ours)
    ours.zero_grad()
    ours.to(device)
    rng = np.random.default_rng(seed)
    ours_in = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    theirs_in = [torch.tensor(a, requires_grad=True) for a in arrays]
    outs, refs = ours_fn(ours, *ours_in), torch_fn(theirs, *theirs_in)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    assert len(outs) == len(refs)
    atol = scaled(atol, *arrays, *ours.parameters())
    upstream = []
    ours_loss, theirs_loss = 0, 0
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert (o is None) == (r is None), f"output {i}: one side returned None"
        if o is None:
            continue
        assert o.device == device and o.dtype == arrays[0].dtype
        got, want = o.numpy(), r.detach().numpy()
        assert got.shape == want.shape, f"output {i}: shape {got.shape} vs torch {want.shape}"
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"output {i}")
        g = rng.standard_normal(got.shape).astype(got.dtype)
        upstream.append(g)
        ours_loss = ours_loss + (o * Tensor(g, device=device)).sum()
        theirs_loss = theirs_loss + (r * torch.tensor(g)).sum()
    ours_loss.backward()
    theirs_loss.backward()
    atol = scaled(atol, *upstream)
    for i, (a, b) in enumerate(zip(ours_in, theirs_in)):  # an unused input has no gradient on either side
        assert (a.grad is None) == (b.grad is None), f"gradient of input {i}: present on one side only"
        if a.grad is not None:
            np.testing.assert_allclose(as_numpy(a.grad), b.grad.numpy(), atol=atol, rtol=rtol,
                                       err_msg=f"gradient of input {i}")
    named = dict(theirs.named_parameters())
    ours_named = dict(ours.named_parameters())
    assert set(ours_named) == set(named)
    for name, p in ours_named.items():
        want = named[name].grad
        want = np.zeros(p.shape) if want is None else want.numpy()
        got = np.zeros(p.shape) if p.grad is None else as_numpy(p.grad)
        assert p.grad is None or backend.device_of(p.grad) == device
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"gradient of parameter {name}")
    return outs


def gradcheck_module(module, fn, arrays, device="cpu", **options):
    """autograd.gradcheck of fn(module, *inputs) over every input array and every parameter (float64)."""
    module.double().to(device)
    inputs = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    params = list(module.parameters())
    count = len(inputs)
    return autograd.gradcheck(lambda *xs: fn(module, *xs[:count]), inputs + params, **options)


# -- Linear ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradcheck(bias, device, rng):
    gradcheck_module(nn.Linear(3, 2, bias=bias), lambda m, x: m(x), [rng.standard_normal((2, 2, 3))], device)


@pytest.mark.parametrize("dtype, tol", [("float64", F64), ("float32", F32)])
def test_linear_matches_torch(dtype, tol, torch, rng, device):
    m = nn.Linear(5, 4).to(dtype=dtype)
    assert_torch_parity(torch, m, lambda m, x: m(x), lambda t, x: t(x),
                        [rng.standard_normal((2, 3, 5)).astype(dtype)], device=device, **tol)


def test_linear_init_like_torch():
    autograd.manual_seed(0)
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


# -- Embedding --------------------------------------------------------------------------------
@pytest.mark.parametrize("padding_idx", [None, 1, -1])
def test_embedding_matches_torch(padding_idx, torch, device):
    m = nn.Embedding(6, 3, padding_idx=padding_idx).double()
    if padding_idx is not None:
        assert np.all(m.weight.numpy()[padding_idx] == 0)
    ids = np.array([[1, 5, 1], [0, 1, 2]])  # repeated ids accumulate; row 1 / 5 is the padding row
    assert_torch_parity(torch, m, lambda m, x: m(ids) * x, lambda t, x: t(torch.tensor(ids)) * x,
                        [np.random.default_rng(1).standard_normal((2, 3, 3))], device=device, **F64)
    if padding_idx is not None:
        assert np.all(as_numpy(m.weight.grad)[padding_idx] == 0)


def test_embedding_gradcheck(device):
    # without padding_idx: the padding row is deliberately frozen, which finite differences would see
    ids = np.array([[1, 4, 1], [0, 1, 2]])
    gradcheck_module(nn.Embedding(5, 2), lambda m: m(ids), [], device)


def test_embedding_init_and_errors():
    autograd.manual_seed(0)
    m = nn.Embedding(1000, 50)
    assert abs(m.weight.numpy().std() - 1.0) < 0.02
    with pytest.raises(IndexError, match=r"\[0, 999\]"):
        m(np.array([[0, 1000]]))
    with pytest.raises(TypeError, match="integer"):
        m(np.array([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="padding_idx"):
        nn.Embedding(5, 2, padding_idx=5)


# -- LayerNorm, activations, Dropout --------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}])
def test_layer_norm_gradcheck_and_torch(options, torch, rng, device):
    x = rng.standard_normal((2, 3, 4)) * 3 + 2
    m = nn.LayerNorm(4, **options)
    if m.weight is not None:  # non-trivial affine parameters so their gradients matter
        m.weight.data = rng.standard_normal(4).astype("float32")
    if m.bias is not None:
        m.bias.data = rng.standard_normal(4).astype("float32")
    gradcheck_module(m, lambda m, x: m(x), [x], device)
    assert_torch_parity(torch, m.to("cpu"), lambda m, x: m(x), lambda t, x: t(x), [x], device=device, **F64)


def test_layer_norm_errors():
    with pytest.raises(ValueError, match=r"trailing dimensions must be \(4,\)"):
        nn.LayerNorm(4)(Tensor(np.zeros((2, 5))))
    with pytest.raises(ValueError, match="eps"):
        nn.LayerNorm(4, eps=0)


@pytest.mark.parametrize("make, name", [(nn.ReLU, "relu"), (nn.GELU, "gelu"), (lambda: nn.GELU("tanh"), "gelu_tanh")])
def test_activations_match_torch(make, name, torch, rng, device):
    ref = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}[name]
    x = Tensor(rng.standard_normal((3, 4)) * 2, requires_grad=True, device=device)
    tx = torch.tensor(x.numpy(), requires_grad=True)
    out, tout = make()(x), ref(tx)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), **F64)
    g = rng.standard_normal((3, 4))
    out.backward(Tensor(g, device=device))
    tout.backward(torch.tensor(g))
    np.testing.assert_allclose(as_numpy(x.grad), tx.grad.numpy(), **F64)


@pytest.mark.parametrize("module", [nn.ReLU(), nn.GELU(), nn.GELU("tanh")], ids=repr)
def test_activations_gradcheck(module, rng, device):
    x = rng.standard_normal((3, 4)) * 2
    x[np.abs(x) < 0.01] = 0.5  # keep finite differences away from relu's kink
    gradcheck_module(module, lambda m, x: m(x), [x], device)


def test_dropout_gradcheck_in_training(rng, device):
    def dropped(m, x):
        autograd.manual_seed(5)  # the same mask on every evaluation
        return m(x)
    gradcheck_module(nn.Dropout(0.4), dropped, [rng.standard_normal((4, 5))], device)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        nn.GELU("erf")


def test_dropout_train_and_eval(device):
    autograd.manual_seed(3)
    m = nn.Dropout(0.25)
    x = Tensor(np.ones((200, 100), dtype="float32"), device=device)
    y = m(x).numpy()
    kept = y != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert m.eval()(x) is x
    with pytest.raises(ValueError, match=r"p must be a real number in \[0, 1\]"):
        nn.Dropout(1.5)


# -- positional encodings --------------------------------------------------------------------------
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


def torch_rope(torch, x, base=10000.0):
    """Half-split RoPE written with torch ops: x (..., T, hd)."""
    T, hd = x.shape[-2:]
    inv_freq = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_rotary_matches_torch_and_gradchecks(torch, rng, device):
    rope = nn.RotaryEmbedding(6)
    x = rng.standard_normal((2, 2, 5, 6))
    tx = torch.tensor(x, requires_grad=True)
    ours = Tensor(x, requires_grad=True, device=device)
    np.testing.assert_allclose(rope(ours).numpy(), torch_rope(torch, tx).detach().numpy(), **F64)
    # an offset rotates like the tail of a longer sequence
    np.testing.assert_allclose(rope(ours[:, :, 3:], offset=3).numpy(), rope(ours).numpy()[:, :, 3:], **F64)
    autograd.gradcheck(lambda a: rope(a, offset=2), [ours])


def test_rotary_scores_depend_only_on_relative_position(rng):
    rope = nn.RotaryEmbedding(8)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    seq = Tensor(np.stack([q, k] * 6)[None].reshape(1, 12, 8))  # q at even positions, k at odd ones
    rotated = rope(seq).numpy()[0]
    scores = [rotated[i] @ rotated[i + 3] for i in (0, 2, 4, 6, 8)]  # q at i, k at i+3
    np.testing.assert_allclose(scores, scores[0], rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        nn.RotaryEmbedding(5)
