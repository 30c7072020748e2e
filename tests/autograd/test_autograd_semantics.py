"""The autograd core against torch.autograd's semantics where a PyTorch user meets them: a second
backward through a freed graph, requires_grad flags, retained gradients, the root gradient's
type, grad-mode context managers, promotion of numpy scalars and arrays, and the gradients of
pow and division at zero, each side by side with torch. (The ops' values and gradients on
ordinary inputs are in tests/autograd/test_autograd.py.)"""
import threading

import numpy as np
import pytest

import autograd
from autograd import Tensor


def leaf(values, dtype=np.float64):
    return Tensor(np.array(values, dtype=dtype), requires_grad=True)


# -- a second backward through a graph that an earlier backward freed ---------------------------
@pytest.mark.parametrize("second_root", ["other_loss", "intermediate"])
def test_a_second_backward_through_a_partly_freed_graph_says_so_like_torch(second_root, torch):
    """Two losses share h; the first backward frees h's node: torch raises 'Trying to backward
    through the graph a second time', not a TypeError from inside the tape."""
    def run(lib, x):
        h = x * 2.0
        other = (h * 3.0).sum()
        h.sum().backward()
        return other if second_root == "other_loss" else h * 1.0

    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        run(torch, torch.ones(3, requires_grad=True)).sum().backward()
    with pytest.raises(RuntimeError, match=r"already freed: call backward\(retain_graph=True\)"):
        run(autograd, leaf([1.0, 1.0, 1.0])).sum().backward()


# -- requires_grad ---------------------------------------------------------------------------------
def test_requires_grad_is_refused_on_integer_and_bool_tensors_like_torch(torch):
    with pytest.raises(RuntimeError, match="only Tensors of floating point dtype"):
        torch.tensor([1, 2]).requires_grad_()
    for data in (np.array([1, 2]), np.array([True])):
        with pytest.raises(TypeError, match=f"requires_grad needs a floating dtype, got {data.dtype}"):
            Tensor(data).requires_grad_()
        assert not Tensor(data).requires_grad_(False).requires_grad  # turning it off is fine


def test_requires_grad_must_be_a_bool_like_torch(torch):
    with pytest.raises(TypeError, match="must be bool"):
        torch.ones(2).requires_grad_("yes")
    with pytest.raises(TypeError, match=r"Tensor: requires_grad must be True or False, got 'yes' of type str"):
        Tensor(np.ones(2), requires_grad="yes")
    with pytest.raises(TypeError, match=r"requires_grad_: requires_grad must be True or False, got 1 of type int"):
        Tensor(np.ones(2)).requires_grad_(1)
    assert Tensor(np.ones(2), requires_grad=np.bool_(True)).requires_grad is True


def test_turning_off_requires_grad_of_a_non_leaf_is_refused_like_torch(torch):
    """Silently dropping the gradient through y would be a wrong x.grad; torch refuses."""
    y = torch.ones(3, requires_grad=True) * 2.0
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf variables"):
        y.requires_grad_(False)
    x = leaf([1.0, 2.0, 3.0])
    y = x * 2.0
    with pytest.raises(RuntimeError, match=r"requires_grad_\(False\) on a tensor made by an op.*\.detach\(\)"):
        y.requires_grad_(False)
    assert y.requires_grad_(True) is y  # a no-op, as torch's


# -- retained gradients of non-leaves ---------------------------------------------------------------
def test_a_retained_gradient_accumulates_across_backward_calls_like_torch(torch):
    def run(lib, x):
        y = x * 3.0
        y.retain_grad()
        loss = (y * y).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return y.grad

    expected = run(torch, torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)).numpy()
    np.testing.assert_array_equal(run(autograd, leaf([1.0, -2.0])), expected)


def test_retained_gradients_do_not_alias_each_other_or_the_upstream():
    a, b = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    u, v = (a * 1.0).retain_grad(), (b * 1.0).retain_grad()
    root = (u + v).retain_grad()
    upstream = np.array([0.5, -1.0])
    root.backward(upstream)           # Add hands the one incoming array to both inputs
    u.grad *= 10.0
    np.testing.assert_array_equal(v.grad, [0.5, -1.0])
    np.testing.assert_array_equal(upstream, [0.5, -1.0])
    np.testing.assert_array_equal(root.grad, [0.5, -1.0])


# -- the gradient argument of backward -------------------------------------------------------------
@pytest.mark.parametrize("grad", [[1.0, 1.0], 2.0, "ones"])
def test_a_gradient_that_is_not_an_array_is_a_clear_type_error_like_torch(grad, torch):
    with pytest.raises(TypeError):
        (torch.ones(2, requires_grad=True) * 2.0).backward(grad)
    with pytest.raises(TypeError, match=r"backward\(gradient\): expected an array or a Tensor of shape \(2,\), got "
                                         + type(grad).__name__):
        (leaf([1.0, 1.0]) * 2.0).backward(grad)


def test_a_gradient_of_another_dtype_is_cast_to_the_outputs_like_torch(torch):
    for dtype in (np.float64, np.int64, np.float16):
        x = leaf([1.0, 2.0], np.float32)
        (x * 2.0).backward(np.array([1, 3], dtype=dtype))
        t = torch.tensor([1.0, 2.0], requires_grad=True)
        (t * 2.0).backward(torch.tensor(np.array([1, 3], dtype=dtype)))
        assert x.grad.dtype == np.float32
        np.testing.assert_array_equal(x.grad, t.grad.numpy())


# -- grad mode: reusable, nestable, a decorator, set_grad_enabled, per thread --------------------------
def test_a_no_grad_object_can_be_reused_and_nested_like_torchs():
    mode = autograd.no_grad()
    x = leaf([1.0])
    for _ in range(2):                   # `ctx = no_grad()` made once, entered every step
        with mode:
            assert not (x * 2.0).requires_grad
            with autograd.enable_grad():
                assert (x * 2.0).requires_grad
                with mode:               # the same object, entered again inside itself
                    assert not autograd.is_grad_enabled()
                assert autograd.is_grad_enabled()
            assert not autograd.is_grad_enabled()
        assert autograd.is_grad_enabled()


def test_no_grad_decorates_with_or_without_parentheses_like_torch(torch):
    @torch.no_grad
    def torch_bare():
        return torch.is_grad_enabled()

    @autograd.no_grad
    def bare(x):
        return (x * 2.0).requires_grad

    @autograd.no_grad()
    def called(x):
        return (x * 2.0).requires_grad

    @autograd.enable_grad()
    def enabled(x):
        return (x * 2.0).requires_grad

    assert torch_bare() is False
    x = leaf([1.0])
    assert bare(x) is False and called(x) is False and autograd.is_grad_enabled()
    with autograd.no_grad():
        assert enabled(x) is True and not autograd.is_grad_enabled()


def test_set_grad_enabled_is_a_function_and_a_context_manager_like_torchs(torch):
    x = leaf([1.0])
    with autograd.set_grad_enabled(False):
        assert not (x * 2.0).requires_grad
        with autograd.set_grad_enabled(True):
            assert (x * 2.0).requires_grad
        assert not autograd.is_grad_enabled()
    assert autograd.is_grad_enabled()
    try:
        autograd.set_grad_enabled(False)          # as a call: the mode stays switched
        assert not autograd.is_grad_enabled()
    finally:
        autograd.set_grad_enabled(True)
    assert autograd.is_grad_enabled()
    with pytest.raises(TypeError, match=r"set_grad_enabled: mode must be True or False, got 0 of type int"):
        autograd.set_grad_enabled(0)
    with pytest.raises(TypeError):
        torch.set_grad_enabled(0)


def test_set_grad_enabled_as_a_decorator_leaves_the_mode_alone_until_called_like_torch(torch):
    """@set_grad_enabled(False): the call switches the mode, the decoration switches it back (torch's
    __call__), and every call of the function runs in mode False then restores the caller's."""
    @autograd.set_grad_enabled(False)
    def inside():
        return autograd.is_grad_enabled()

    @torch.set_grad_enabled(False)
    def torch_inside():
        return torch.is_grad_enabled()
    assert autograd.is_grad_enabled() is torch.is_grad_enabled() is True
    with autograd.no_grad(), torch.no_grad():
        assert inside() is torch_inside() is False
        assert autograd.is_grad_enabled() is torch.is_grad_enabled() is False    # not the mode before decoration
    assert inside() is torch_inside() is False
    assert autograd.is_grad_enabled() is torch.is_grad_enabled() is True


@pytest.mark.parametrize("name", ["no_grad", "enable_grad", "set_grad_enabled"])
def test_a_decorated_generator_runs_in_the_mode_at_each_resume_like_torch(name, torch):
    """A decorated generator function: its body runs in the mode each time it resumes, the caller's
    mode is back at each yield, and send / throw / close / the return value pass through (torch's)."""
    def decorator(lib):
        return getattr(lib, name)(False) if name == "set_grad_enabled" else getattr(lib, name)()

    def walk(lib):
        @decorator(lib)
        def steps():
            seen = [lib.is_grad_enabled()]
            try:
                seen.append((yield lib.is_grad_enabled()))
            except KeyError:
                seen.append(("thrown", lib.is_grad_enabled()))
            seen.append((yield lib.is_grad_enabled()))
            return seen

        @decorator(lib)
        def closed():
            try:
                yield
            finally:
                log.append(lib.is_grad_enabled())
        log, outside = [], not (name == "enable_grad")        # the caller's mode: the opposite one
        lib.set_grad_enabled(outside)
        try:
            gen = steps()
            log += [next(gen), lib.is_grad_enabled(), gen.throw(KeyError()), lib.is_grad_enabled()]
            with pytest.raises(StopIteration) as stop:
                gen.send("sent")
            gen = closed()
            next(gen)
            gen.close()
            return log + [stop.value.value, lib.is_grad_enabled()]
        finally:
            lib.set_grad_enabled(True)
    inside = name == "enable_grad"
    expected = [inside, not inside, inside, not inside, inside,
                [inside, ("thrown", inside), "sent"], not inside]
    assert walk(torch) == expected
    assert walk(autograd) == expected


def test_a_no_grad_object_shared_by_two_threads_keeps_each_threads_mode():
    mode, results, entered, released = autograd.no_grad(), {}, threading.Event(), threading.Event()

    def first():
        with mode:
            entered.set()
            released.wait(10)               # the other thread enters and leaves in between
        results["first"] = autograd.is_grad_enabled()

    def second():
        entered.wait(10)
        try:
            with mode:
                pass
            results["second"] = autograd.is_grad_enabled()
        finally:
            released.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {"first": True, "second": True}


# -- promotion: numbers of any type keep the tensor's dtype, as torch's ------------------------------
@pytest.mark.parametrize("scalar", [np.float64(2.0), np.array(2.0), np.int64(2), np.array([2, 2, 2])])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow"])
def test_numpy_scalars_0d_arrays_and_integer_arrays_keep_a_float32_tensor_float32_like_torch(op, scalar, torch):
    """x / np.sqrt(d) is float32 in torch (a numpy float64 is a number); numpy 2 alone would make
    it float64, and its backward would then fail. Both operand orders; gradients match torch's."""
    fns = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "div": lambda a, b: a / b, "pow": lambda a, b: a ** b}
    fn = fns[op]
    values = np.array([0.5, 1.5, 2.0], np.float32)
    upstream = np.array([1.0, -2.0, 0.5], np.float32)
    for ordered in (lambda x, s: fn(x, s), lambda x, s: fn(s, x)):
        x = Tensor(values, requires_grad=True)
        t = torch.tensor(values, requires_grad=True)
        theirs = scalar.item() if np.ndim(scalar) == 0 and isinstance(scalar, np.generic) else torch.tensor(scalar)
        out, ref = ordered(x, scalar), ordered(t, theirs)
        assert out.dtype == np.float32 and ref.dtype == torch.float32
        with np.errstate(all="ignore"):
            out.backward(upstream)
        ref.backward(torch.tensor(upstream))
        assert x.grad.dtype == np.float32
        np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-6)
        np.testing.assert_allclose(x.grad, t.grad.numpy(), rtol=1e-6)


def test_integer_and_bool_operands_keep_a_float32_tensor_float32_like_torch(torch):
    x = leaf([0.5, 1.5], np.float32)
    mask = Tensor(np.array([1, 0]))
    for out in (x * mask, mask * x, autograd.where(np.array([True, False]), x, mask), x * np.array([True, False]),
                np.array([True, False]) + x):
        assert out.dtype == np.float32
        out.sum().backward()
    assert (torch.ones(2) * torch.tensor([1, 0])).dtype == torch.float32


@pytest.mark.parametrize("op", ["add", "mul", "matmul", "rsub", "where"])
def test_a_float64_array_beside_a_float32_tensor_is_a_clear_error(op):
    """A float64 array of values (not a number) is refused as a float64 Tensor is (one floating
    dtype per op), naming the op and both dtypes, instead of a float64 result whose backward fails."""
    x, other = leaf([[1.0, 2.0], [3.0, 4.0]], np.float32), np.ones((2, 2))
    call = {"add": lambda: x + other, "mul": lambda: other * x, "matmul": lambda: x @ other,
            "rsub": lambda: other - x, "where": lambda: autograd.where(np.ones((2, 2), bool), other, x)}[op]
    with pytest.raises(TypeError, match=r"expected one floating dtype, got float32 \(a Tensor\) and float64 "
                                        r"\(an array of shape \(2, 2\)\); cast it with \.astype\(\'float32\'\)"):
        call()


def test_a_python_float_keeps_an_integer_tensor_as_numpy_does():
    assert (Tensor(np.array([1, 2])) * 0.5).dtype == np.float64  # numpy's rule, outside the graph


# -- pow and division at zero and at tiny values, as torch ---------------------------------------
@pytest.mark.parametrize("exponent", [0.0, 1.0, 2.0, 0.5, -1.0, 3])
def test_pow_with_a_number_exponent_at_zero_matches_torch(exponent, torch):
    """x ** 0 has gradient 0 everywhere (torch), not 0 * 0**-1 = NaN at x = 0."""
    values, upstream = np.array([0.0, 1.5, -2.0]), np.array([1.0, 0.5, 3.0])
    x = Tensor(values, requires_grad=True)
    with np.errstate(all="ignore"):
        (x ** exponent).backward(upstream)
    t = torch.tensor(values, requires_grad=True)
    (t ** exponent).backward(torch.tensor(upstream))
    np.testing.assert_allclose(x.grad, t.grad.numpy(), rtol=1e-15)  # torch's x ** 0.5 is its sqrt


@pytest.mark.parametrize("exponent", [0.0, 2.0, 0.5, -1.0])
def test_pow_with_a_tensor_exponent_at_zero_matches_torch(exponent, torch):
    """d(a ** b)/db = a**b log(a) is 0 at a = 0 for b >= 0 (torch), not 0 * -inf = NaN."""
    base, upstream = np.array([0.0, 1.5, 3.0]), np.array([1.0, -2.0, 0.5])
    a, b = Tensor(base, requires_grad=True), Tensor(np.full(3, exponent), requires_grad=True)
    with np.errstate(all="ignore"):
        (a ** b).backward(upstream)
    ta, tb = torch.tensor(base, requires_grad=True), torch.tensor(np.full(3, exponent), requires_grad=True)
    (ta ** tb).backward(torch.tensor(upstream))
    np.testing.assert_allclose(a.grad, ta.grad.numpy(), rtol=1e-15)
    np.testing.assert_allclose(b.grad, tb.grad.numpy(), rtol=1e-15)


def test_a_number_raised_to_a_float32_tensor_stays_float32_in_backward(torch):
    x = leaf([0.5, -1.0], np.float32)
    (2.0 ** x).backward(np.ones(2, np.float32))
    t = torch.tensor([0.5, -1.0], requires_grad=True)
    (2.0 ** t).backward(torch.ones(2))
    assert x.grad.dtype == np.float32
    np.testing.assert_allclose(x.grad, t.grad.numpy(), rtol=1e-6)


def test_the_divisors_gradient_at_tiny_float32_divisors_matches_torch(torch):
    """-g a / b**2 with b**2 underflowing to 0 is -inf; torch's -g (a / b) / b is finite."""
    a_np, b_np = np.array([1e-30, 1.0, 0.0, 1.0], np.float32), np.array([1e-25, 0.0, 0.0, 1e-20], np.float32)
    a, b = Tensor(a_np, requires_grad=True), Tensor(b_np, requires_grad=True)
    with np.errstate(all="ignore"):
        (a / b).backward(np.ones(4, np.float32))
    ta, tb = torch.tensor(a_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
    (ta / tb).backward(torch.ones(4))
    np.testing.assert_allclose(a.grad, ta.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(b.grad, tb.grad.numpy(), rtol=1e-6)
    assert np.isfinite(b.grad[0])


# -- indexing: the gradient goes where forward read, whatever happens to the index array afterwards --
def test_an_index_array_reused_after_forward_does_not_move_the_gradient(torch):
    """A batch's index buffer refilled before backward: torch's saved indices raise ("modified by
    an inplace operation"); ours keeps its own copy, so the gradient still goes where forward read."""
    idx = torch.tensor([0, 0, 2])
    t = torch.ones(4, requires_grad=True)
    out = t[idx]
    idx[0] = 3
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    for key in (np.array([0, 0, 2]), np.array([True, True, False, True])):
        expected = np.zeros(4)
        np.add.at(expected, key.copy(), [1.0, 2.0, 3.0])
        x = leaf([1.0, 2.0, 3.0, 4.0])
        out = x[(key,)]
        key[...] = key[::-1]
        out.backward(np.array([1.0, 2.0, 3.0]))
        np.testing.assert_array_equal(x.grad, expected)
