"""Edge inputs of the functional ops judged against torch (float64, random upstream gradients):
+inf and NaN entries, empty dimensions, non-contiguous views. Each op matches torch, NaN where
torch has NaN, or refuses clearly."""
import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor, backend
from npformer.functional import composite

from tolerances import assert_close, rounding_tolerance


def run(op, arrays, upstream, device):
    """op(*leaves) and the gradient of <op(...), upstream> for each leaf, as host arrays."""
    leaves = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    with np.errstate(all="ignore"):
        out = op(*leaves)
        out.backward(backend.to_device(upstream, device))
    return out.numpy(), [backend.as_numpy(t.grad) for t in leaves]


def run_torch(torch, op, arrays, upstream):
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = op(*leaves)
    out.backward(torch.tensor(upstream))
    return out.detach().numpy(), [t.grad.numpy() for t in leaves]


def assert_matches_torch(ours, theirs, scale):
    """Values and gradients equal to torch's up to float64 rounding of `scale`, NaN exactly where torch has NaN."""
    (y, grads), (ty, tgrads) = ours, theirs
    assert y.shape == ty.shape
    assert_close(y, ty, rounding_tolerance(np.float64, scale, terms=8), err_msg="output")
    for g, tg in zip(grads, tgrads):
        assert g.shape == tg.shape
        assert_close(g, tg, rounding_tolerance(np.float64, scale, terms=8), err_msg="gradient")


def rows_with_infinities(rows):
    """`rows` rows of 3 logits: ordinary rows and rows holding +inf, NaN or -inf entries."""
    x = np.random.default_rng(0).standard_normal((rows, 3))
    x[0, 1] = np.inf                       # one +inf: torch gives a NaN row (inf - inf)
    x[1] = [np.inf, np.inf, 1.0]
    x[2, 2] = np.nan
    x[3, 0] = -np.inf                      # one -inf: an ordinary row
    return x


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("rows", [6, 8192])   # 8192 x 3 entries: the CPU kernels' row blocks
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_rows_holding_plus_inf_or_nan_are_nan_like_torch(name, rows, twin, device, torch):
    """A row holding +inf is NaN in torch (its shift inf - inf is NaN), in values and gradients;
    the row's maximum must not be replaced by 0 as for a row that is entirely -inf."""
    x = rows_with_infinities(rows)
    upstream = np.random.default_rng(1).standard_normal(x.shape)
    with composite.installed() if twin else np.errstate():
        ours = run(lambda t: getattr(F, name)(t, dim=-1), [x], upstream, device)
    theirs = run_torch(torch, lambda t: getattr(torch, name)(t, dim=-1), [x], upstream)
    assert np.isnan(ours[0][:3]).all() and np.isnan(ours[1][0][:3]).all()
    assert_matches_torch(ours, theirs, 1.0 + np.abs(upstream).sum())


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("rows", [6, 8192])
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_cross_entropy_of_logits_holding_plus_inf_or_nan_is_nan_like_torch(reduction, rows, twin, device, torch):
    """A +inf logit makes torch's loss (and the whole row's gradient) NaN, not +inf."""
    x = rows_with_infinities(rows)
    target = np.random.default_rng(2).integers(0, 3, rows)
    target[0] = 0                          # not the +inf class: torch's loss is NaN, not -inf - ...
    shape = (rows,) if reduction == "none" else ()
    upstream = np.random.default_rng(1).standard_normal(shape)
    with composite.installed() if twin else np.errstate():
        ours = run(lambda t: F.cross_entropy(t, target, reduction=reduction, label_smoothing=0.1), [x], upstream, device)
    theirs = run_torch(torch, lambda t: torch.nn.functional.cross_entropy(
        t, torch.tensor(target), reduction=reduction, label_smoothing=0.1), [x], upstream)
    assert np.isnan(ours[1][0][:3]).all()
    assert_matches_torch(ours, theirs, 1.0 + np.abs(upstream).sum() + np.abs(np.nan_to_num(x, posinf=0)).sum())


TORCH_ACTIVATIONS = {None: lambda f: lambda h: h, "relu": lambda f: f.relu, "gelu": lambda f: f.gelu,
                     "gelu_tanh": lambda f: lambda h: f.gelu(h, approximate="tanh")}


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("batch, in_features, out_features", [(3, 0, 4), (3, 5, 0), (0, 5, 4), (0, 0, 0)])
def test_linear_with_an_empty_dimension_matches_torch(batch, in_features, out_features, activation, twin, device,
                                                     torch):
    """torch's linear takes 0 input features (the result is the bias), 0 output features and 0
    rows; so does ours, with every gradient (dx zeros, dW of the right shape, db = sum of dy)."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((2, batch, in_features)), rng.standard_normal((out_features, in_features)),
              rng.standard_normal(out_features)]
    upstream = rng.standard_normal((2, batch, out_features))
    with composite.installed() if twin else np.errstate():
        ours = run(lambda x, w, b: F.linear(x, w, b, activation=activation), arrays, upstream, device)
    act = TORCH_ACTIVATIONS[activation](torch.nn.functional)
    theirs = run_torch(torch, lambda x, w, b: act(torch.nn.functional.linear(x, w, b)), arrays, upstream)
    assert_matches_torch(ours, theirs, 1.0 + np.abs(upstream).sum() + np.abs(arrays[2]).sum())


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("op", ["dropout", "dropout_add"])
@pytest.mark.parametrize("training", ["no", None, 1, 0.0])
def test_dropout_training_must_be_a_bool(training, op, twin):
    """torch's F.dropout refuses a training flag that is not a bool (a string "no" would be truthy
    and drop entries); numpy's bools are accepted."""
    x = np.ones((2, 3))
    call = (lambda t: F.dropout(x, 0.5, training=t)) if op == "dropout" else (
        lambda t: F.dropout_add(x, x, 0.5, training=t))
    with composite.installed() if twin else np.errstate():
        with pytest.raises(TypeError, match=rf"{op}: training must be True or False, got {training!r}"):
            call(training)
        np.testing.assert_array_equal(np.asarray(data(call(np.bool_(False)))), x if op == "dropout" else 2 * x)


def data(result):
    return result.numpy() if isinstance(result, Tensor) else result


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("table", ["cos", "sin"])
def test_rotary_tables_that_require_grad_are_refused_not_silently_ungraded(table, twin):
    """apply_rotary_emb differentiates x only; a cos or sin Tensor that requires grad would get no
    gradient (torch's rotate_half formula gives it one), so it is refused in grad mode, and
    accepted detached or under no_grad."""
    from autograd import no_grad
    cos, sin = F.rotary_cos_sin(5, 4, dtype="float64")
    tables = {"cos": cos, "sin": sin}
    tables[table] = Tensor(tables[table], requires_grad=True)
    x = Tensor(np.random.default_rng(4).standard_normal((2, 5, 4)), requires_grad=True)
    with composite.installed() if twin else np.errstate():
        with pytest.raises(RuntimeError, match=rf"apply_rotary_emb: {table} requires grad.*detach"):
            F.apply_rotary_emb(x, **tables)
        with no_grad():
            expected = F.apply_rotary_emb(x, cos, sin).numpy()
            np.testing.assert_array_equal(F.apply_rotary_emb(x, **tables).numpy(), expected)
        tables[table] = tables[table].detach()
        np.testing.assert_array_equal(F.apply_rotary_emb(x, **tables).numpy(), expected)


MIXED_DTYPES = {  # name: op(a, b) on arrays or Tensors of shape (2, 3); b's dtype differs from a's
    "linear_weight": lambda a, b: F.linear(a, b),
    "linear_bias": lambda a, b: F.linear(a, a, b[0, :2]),
    "layer_norm_weight": lambda a, b: F.layer_norm(a, 3, b[0]),
    "layer_norm_bias": lambda a, b: F.layer_norm(a, 3, None, b[0]),
    "dropout_add": lambda a, b: F.dropout_add(a, b, 0.5),
    "dropout_add_eval": lambda a, b: F.dropout_add(a, b, 0.5, training=False),
}


@pytest.mark.parametrize("twin", [False, True])
@pytest.mark.parametrize("wrap", ["arrays", "tensor_and_array", "array_and_tensor"])
@pytest.mark.parametrize("name", MIXED_DTYPES)
def test_mixed_float_dtypes_are_refused_whether_arrays_or_tensors(name, wrap, twin):
    """torch refuses float32 and float64 inputs in one op; so does every op here, also when some
    inputs are raw arrays (not only when all are Tensors): no silent cast of one to the other."""
    a, b = np.ones((2, 3), np.float32), np.ones((2, 3), np.float64)
    if wrap != "arrays":
        a, b = (Tensor(a), b) if wrap == "tensor_and_array" else (a, Tensor(b))
    with composite.installed() if twin else np.errstate():
        with pytest.raises(TypeError, match=r"expected one floating dtype.*float32.*float64"):
            MIXED_DTYPES[name](a, b)
