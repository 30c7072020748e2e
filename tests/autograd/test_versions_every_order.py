"""No stale value after an in-place change, at any order (issue 46, item 1): every array a
backward, a double backward or a jvp reads from the forward is under the version check, through
`linearize` and forward over reverse too. A changed input raises torch's error naming the op and
the input; where the op did not keep the input (an Add), the result is the one without the change
(torch's rule), never a mix of the old values and the new."""
import re

import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor, grad
from autograd import forward_ad as fwAD
from autograd.functional import hvp, linearize
from npformer import nn, opcases, optim

IN_PLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"
W0 = np.array([0.7, -0.4, 2.9])


def _outputs(result):
    """The output Tensors of a case's result (a Tensor or a tuple; None entries dropped)."""
    return [o for o in (result if isinstance(result, (tuple, list)) else [result]) if o is not None]


def sgd_step(t, lr=0.5, seed=7):
    """An optimizer step on t, in place (its version counts it)."""
    t.grad = Tensor(np.random.default_rng(seed).standard_normal(t.shape).astype(t.dtype))
    optim.SGD([t], lr=lr).step()
    t.grad = None


def raises_naming(op, input_index, call):
    with pytest.raises(RuntimeError, match=IN_PLACE) as caught:
        call()
    assert f"(input {input_index} of {op})" in str(caught.value), str(caught.value)
    return caught.value


# -- the cases -----------------------------------------------------------------------------
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_second_backward_after_a_step_raises_as_torchs(approximate, torch):
    tw = torch.tensor(W0, requires_grad=True)
    (tg,) = torch.autograd.grad(torch.nn.functional.gelu(tw, approximate=approximate).sum(), [tw], create_graph=True)
    with torch.no_grad():
        tw.sub_(1.0)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        torch.autograd.grad(tg.sum(), [tw])

    w = nn.Parameter(W0.copy())
    (g,) = grad(F.gelu(w, approximate=approximate).sum(), [w], create_graph=True)
    sgd_step(w)
    # gelu's gradient graph: GELUBackward(dy, h), which kept h (= w's array) beside tanh(u) or Phi(h)
    raises_naming("npformer.functional.activation.GELUBackward", 1, lambda: grad(g.sum(), [w]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_first_backward_after_a_step_raises(approximate, torch):
    # the issue: gelu's backward read h (w's array, now stepped) beside Phi(h) of the old point
    w = nn.Parameter(W0.copy())
    y = F.gelu(w, approximate=approximate).sum()
    sgd_step(w)
    raises_naming("npformer.functional.activation.GELUFunction", 0, y.backward)
    tw = torch.tensor(W0, requires_grad=True)
    ty = torch.nn.functional.gelu(tw, approximate=approximate).sum()
    with torch.no_grad():
        tw.sub_(1.0)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        ty.backward()


def test_a_create_graph_gradient_after_a_step_raises():
    w = nn.Parameter(W0.copy())
    y = F.gelu(w, approximate="tanh").sum()
    sgd_step(w)
    raises_naming("npformer.functional.activation.GELUFunction", 0, lambda: grad(y, [w], create_graph=True))


def test_linearize_then_a_step_on_the_primal_raises():
    # the issue: jvp_fn gave neither the old point's J u nor the new one's
    x = nn.Parameter(W0.copy())
    _, jvp_fn = linearize(lambda x: (x * x * x).sum() * F.gelu(x), x)
    sgd_step(x)
    raises_naming("autograd.ops.Mul", 0, lambda: jvp_fn(Tensor(np.ones(3))))
    x = Tensor(W0.copy())  # a primal that does not require grad shares its counter all the same
    _, jvp_fn = linearize(lambda x: F.gelu(x) * 2.0, x)
    sgd_step(x)
    raises_naming("npformer.functional.activation.GELUFunction", 0, lambda: jvp_fn(Tensor(np.ones(3))))


def test_linearize_without_a_change_still_gives_jvp():
    x = Tensor(W0.copy())
    _, jvp_fn = linearize(lambda x: F.gelu(x) * x, x)
    u = Tensor(np.array([1.0, 2.0, -1.0]))
    with fwAD.dual_level():
        dual = fwAD.make_dual(Tensor(W0.copy()), u.data)
        expected = fwAD.unpack_dual(F.gelu(dual) * dual).tangent
    np.testing.assert_array_equal(jvp_fn(u).numpy(), expected)


def test_forward_over_reverse_after_a_step_raises():
    # an HVP split by a step: the forward carried tangents, the backward then reads what it kept
    w = nn.Parameter(W0.copy())
    with fwAD.dual_level():
        dual = fwAD.make_dual(w, np.ones(3))
        y = F.gelu(dual, approximate="tanh").sum()
        sgd_step(w)
        raises_naming("npformer.functional.activation.GELUFunction", 0, lambda: grad(y, [dual]))
    assert hvp(lambda x: F.gelu(x).sum(), w, Tensor(np.ones(3)))[1].shape == (3,)  # unsplit: fine


def test_an_input_that_the_differentiable_backward_reads_raises_when_changed():
    # cross_entropy keeps the softmax, not the logits: its first derivative reads no logit and
    # gives the old point's gradient (torch's rule for what an op did not save), but its
    # differentiable backward forms the softmax again from the logits Tensor: it raises rather
    # than build the gradient at the new point
    logits = Tensor(np.random.default_rng(0).standard_normal((4, 5)), requires_grad=True)
    loss = F.cross_entropy(logits, np.array([0, 3, 1, 4]))
    (before,) = grad(loss, [logits], retain_graph=True)
    sgd_step(logits)
    (after,) = grad(loss, [logits], retain_graph=True)
    np.testing.assert_array_equal(after.numpy(), before.numpy())
    error = raises_naming("npformer.functional.cross_entropy.CrossEntropyFunction", 0,
                          lambda: grad(loss, [logits], create_graph=True))
    assert "[Tensor of shape (4, 5), float64]" in str(error)


def test_a_linear_bias_changed_in_place_raises_only_where_it_is_read():
    # F.linear keeps x and W, not the bias: the first derivative reads no bias (torch's rule);
    # with a GELU, the differentiable backward forms h = x W^T + b again from the bias Tensor
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((5, 3)), requires_grad=True)
    w, b = nn.Parameter(rng.standard_normal((4, 3))), nn.Parameter(rng.standard_normal(4))
    loss = F.linear(x, w, b, activation="gelu").sum()
    (before,) = grad(loss, [x], retain_graph=True)
    sgd_step(b)
    (after,) = grad(loss, [x], retain_graph=True)
    np.testing.assert_array_equal(after.numpy(), before.numpy())
    raises_naming("npformer.functional.linear.LinearFunction", 2, lambda: grad(loss, [x], create_graph=True))


# -- the sweep over the registry -------------------------------------------------------------------
def _outcome(run):
    """("value", arrays) or ("error", type and message): what a run gives."""
    try:
        return "value", [np.array(a) for a in run()]
    except Exception as e:  # noqa: BLE001  (compared below: a version error, or the same as unchanged)
        return "error", f"{type(e).__name__}: {e}"


def _arrays(ts):
    return [np.zeros(0) if t is None else t.detach().numpy() for t in ts]


def _tangents(ts):
    tangents = [None if t is None else fwAD.unpack_dual(t).tangent for t in ts]
    return [np.zeros(0) if t is None else t for t in tangents]


def _modes(instance, change):
    """{mode: run}: each run takes a forward, then `change()` (an in-place step on one tensor, or
    nothing), then what reads the forward: the backward (first order), the gradient with
    create_graph, the second backward through a create_graph gradient taken before the change,
    forward over reverse (the gradient's tangent), and linearize's jvp_fn."""
    tensors, n = instance.tensors, len(instance.arrays)
    gen = np.random.default_rng(11)
    with npformer.no_grad():
        npformer.manual_seed(0)
        shapes = [o.shape for o in _outputs(instance(*tensors))]
    upstream = [Tensor(gen.standard_normal(s)) for s in shapes]
    directions = [Tensor(gen.standard_normal(t.shape)) for t in tensors]

    def forward(*inputs):
        npformer.manual_seed(0)  # the same dropout masks on every run
        outs = _outputs(instance(*inputs))
        return [(o, g) for o, g in zip(outs, upstream) if o.requires_grad]

    def first_order():
        pairs = forward(*tensors[:n])
        change()
        return _arrays(grad([o for o, _ in pairs], tensors, [g for _, g in pairs], allow_unused=True))

    def create_graph():
        pairs = forward(*tensors[:n])
        change()
        return _arrays(grad([o for o, _ in pairs], tensors, [g for _, g in pairs], allow_unused=True,
                            create_graph=True))

    def second_order():
        pairs = forward(*tensors[:n])
        first = grad([o for o, _ in pairs], tensors, [g for _, g in pairs], allow_unused=True, create_graph=True)
        change()
        pairs = [(f, u) for f, u in zip(first, directions) if f is not None and f.requires_grad]
        if not pairs:
            return []
        return _arrays(grad([f for f, _ in pairs], tensors, [u for _, u in pairs], allow_unused=True))

    def forward_over_reverse():
        with fwAD.dual_level():
            duals = [fwAD.make_dual(t, u.data) for t, u in zip(tensors[:n], directions)]
            pairs = forward(*duals)
            change()
            gs = grad([o for o, _ in pairs], duals + tensors[n:], [g for _, g in pairs], allow_unused=True)
            return _arrays(gs) + _tangents(gs)

    def linearized():
        values, jvp_fn = linearize(lambda *xs: tuple(_outputs(instance(*xs))), *tensors[:n])
        change()
        return _arrays(_outputs(jvp_fn(*directions[:n])))

    return {"backward": first_order, "create_graph": create_graph, "second order": second_order,
            "forward over reverse": forward_over_reverse, "linearize": linearized}


def _op_and_input(message):
    return re.search(r"\(input \d+ of [\w.]+\) is at version \d+; expected version \d+ instead", message)


@pytest.mark.parametrize("case", opcases.CASES, ids=[c.name for c in opcases.CASES])
def test_every_op_raises_or_is_unchanged_after_an_in_place_step_at_every_order(case):
    """Every registered case, every input and parameter changed in place between the forward and
    what reads it, at every order: torch's error naming the op and the input, or exactly the
    result without the change (the op kept nothing of that input), never another number."""
    reference = {mode: _outcome(run) for mode, run in
                 _modes(opcases.instantiate(case, np.random.default_rng(0)), lambda: None).items()}
    count = len(opcases.instantiate(case, np.random.default_rng(0)).tensors)
    for i in range(count):
        for mode in reference:
            instance = opcases.instantiate(case, np.random.default_rng(0))
            kind, got = _outcome(_modes(instance, lambda: sgd_step(instance.tensors[i]))[mode])
            where = f"{case.name}, {mode}, {instance.labels[i]} changed"
            if kind == "error" and IN_PLACE in got:
                assert _op_and_input(got), f"{where}: {got}"
                continue
            ref_kind, expected = reference[mode]
            assert kind == ref_kind, f"{where}: {got if kind == 'error' else 'a value'}, unchanged: {expected}"
            if kind == "error":
                assert got == expected, where
                continue
            assert len(got) == len(expected), where
            for k, (a, b) in enumerate(zip(got, expected)):
                np.testing.assert_array_equal(a, b, err_msg=f"{where}: array {k} is neither the error nor the "
                                                            "unchanged result")
