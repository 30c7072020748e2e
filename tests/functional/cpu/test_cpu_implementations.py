"""Every "cpu" implementation of npformer.functional's kernel tables (each op folder's cpu.py)
equals its reference on arguments it is chosen for, on 1 and 3 threads with every op split
(the `threads` fixture): the same outputs, and the same writes into the arrays it is given."""
import copy
import importlib

import numpy as np
import pytest

from npformer.runtime import kernels

# the modules (npformer.functional's attributes of these names are the ops)
activation, attention, embedding, linear, normalization, softmax = (
    importlib.import_module(f"npformer.functional.{name}") for name in
    ("activation", "attention", "embedding", "linear", "layer_norm", "softmax"))


def _softmax_rows(rng, shape):
    x = np.exp(rng.standard_normal(shape))
    return x / x.sum(axis=-1, keepdims=True)


def cases(rng):
    """(table, args) pairs: each table's arguments, for every variant its cpu implementation has."""
    x, dy = rng.standard_normal((6, 5)) * 3, rng.standard_normal((6, 5))
    bias = rng.standard_normal(5)
    big = rng.standard_normal((4, 64, 64))                            # row_max and layer_norm: from 2^14 entries
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 4))
    k_shared = rng.standard_normal((1, 3, 6, 5))                      # broadcast along the batch
    additive = rng.standard_normal((4, 6))
    blocked = rng.random((2, 1, 4, 6)) < 0.3
    attn_keep = rng.random((2, 3, 4, 6)) > 0.3
    probs = _softmax_rows(rng, (2, 3, 4, 6))
    zeros = lambda *shape: np.zeros(shape)  # noqa: E731  (outputs the implementations write)
    out, lse = attention.attention_blockwise_forward.reference(np, q, k, v, None, additive, True, 0.4, 2, None, False)
    ln_x = big.reshape(-1, 256)
    ln_w, ln_b = rng.standard_normal(256), rng.standard_normal(256)
    _, ln_xhat, ln_rstd = normalization.layer_norm_forward.reference(np, ln_x, ln_w, ln_b, 1e-5)
    w = rng.standard_normal((3, 5))
    for kind in activation.ACTIVATIONS:
        yield activation.bias_activation_forward, (np, x, bias, kind)
        yield activation.bias_activation_forward, (np, x, None, kind)
        _, saved = activation.bias_activation_forward.reference(np, x, bias, kind)
        yield activation.bias_activation_backward, (np, dy, saved, kind)
    yield activation.elementwise_product, (np, x, dy, 1.5)
    yield softmax.row_max, (big, -1)
    yield softmax.row_sum, (big, -1)
    yield softmax.row_dot, (big, big[::-1].copy())
    yield softmax.softmax_forward, (np, big, -1)
    yield softmax.softmax_forward, (np, big.copy(), -1, zeros(*big.shape))
    yield softmax.softmax_backward, (np, probs, rng.standard_normal(probs.shape), -1)
    yield softmax.softmax_backward, (np, probs, rng.standard_normal(probs.shape), -1, zeros(*probs.shape))
    yield softmax.log_softmax_forward, (np, big, -1)
    yield attention.matmul_transposed, (np, q, k)
    yield attention.matmul_transposed, (np, q, k_shared, zeros(2, 3, 4, 6))
    for mask, hidden, causal, dropped in [(None, None, False, None), (additive, None, True, attn_keep),
                                          (None, blocked, False, attn_keep), (additive, blocked, True, None)]:
        weights = None if dropped is None else zeros(2, 3, 4, 6)
        yield attention.attention_forward, (np, q, k, v, mask, hidden, causal, 0.4, dropped, 1 / 0.7, zeros(2, 3, 4, 6),
                                            zeros(2, 3, 4, 4), weights)
        yield attention.attention_forward, (np, q, k_shared, v, mask, hidden, causal, 0.4, dropped, 1 / 0.7,
                                            zeros(2, 3, 4, 6), zeros(2, 3, 4, 4), weights)
        yield attention.attention_backward, (np, q, k, v, probs, dropped, rng.standard_normal((2, 3, 4, 4)), weights, 0.4,
                                             1 / 0.7, zeros(2, 3, 4, 5), zeros(2, 3, 6, 5), zeros(2, 3, 6, 4),
                                             zeros(2, 3, 4, 6))
    yield attention.attention_backward, (np, q, k, v, probs, None, rng.standard_normal((2, 3, 4, 4)), None, 0.4, 1.0,
                                         None, None, zeros(2, 3, 6, 4), None)
    like_qkv = lambda: [rng.standard_normal(a.shape) for a in (q, k_shared, v)]  # noqa: E731  (gradients, tangents)
    for dropped, dweights, mask_part in [(None, None, None), (attn_keep, rng.standard_normal((2, 3, 4, 6)), additive)]:
        dout = rng.standard_normal((2, 3, 4, 4))
        yield attention.attention_double_backward, (
            np, q, k_shared, v, probs, dropped, dout, dweights, 0.4, 1 / 0.7, *like_qkv(), mask_part, zeros(2, 3, 4, 5),
            zeros(2, 3, 6, 5), zeros(2, 3, 6, 4), zeros(2, 3, 4, 6), zeros(2, 3, 4, 4),
            None if dweights is None else zeros(2, 3, 4, 6))
        yield attention.attention_backward_jvp, (
            np, q, k_shared, v, probs, dropped, dout, dweights, 0.4, 1 / 0.7, *like_qkv(), mask_part,
            rng.standard_normal(dout.shape), dweights, zeros(2, 3, 4, 5), zeros(2, 3, 6, 5), zeros(2, 3, 6, 4),
            zeros(2, 3, 4, 6))
    for dropped, tmask in [(None, None), (attn_keep, rng.standard_normal((4, 6)))]:
        yield attention.attention_jvp, (np, q, k_shared, v, probs, dropped, 0.4, 1 / 0.7, *like_qkv(), tmask,
                                        zeros(2, 3, 4, 4), zeros(2, 3, 4, 6))
    yield attention.attention_jvp, (np, q, k_shared, v, probs, None, 0.4, 1.0, None, None, rng.standard_normal(v.shape),
                                    None, zeros(2, 3, 4, 4), None)
    yield attention.attention_blockwise_forward, (np, q, k, v, None, additive, True, 0.4, 2, None, False)
    yield attention.attention_blockwise_forward, (np, q, k_shared, v, blocked, None, False, 0.4, 3, None, False)
    yield attention.attention_blockwise_backward, (np, q, k, v, out, lse, rng.standard_normal(out.shape), None, additive,
                                                   True, 0.4, 2, None, False)
    yield embedding.scatter_add_rows, (np, rng.integers(0, 4, 10), rng.standard_normal((10, 3)), 4)
    yield linear.linear_forward, (np, x, w, rng.standard_normal(3))
    yield linear.linear_forward, (np, x, w, None)
    yield linear.linear_tangent, (np, x, w, rng.standard_normal(x.shape), rng.standard_normal(w.shape),
                                  rng.standard_normal(3))
    yield linear.linear_tangent, (np, x, w, rng.standard_normal(x.shape), rng.standard_normal(w.shape), None)
    short, deep = rng.standard_normal((3, 8)), rng.standard_normal((4, 8))   # fewer rows than depth: dW's tangent
    yield linear.linear_tangent, (np, short, deep, rng.standard_normal(short.shape), rng.standard_normal(deep.shape),
                                  None)
    for needs in [(True, True, True), (True, False, False), (False, True, True), (False, False, True)]:
        yield linear.linear_backward, (np, rng.standard_normal((6, 3)), x, w, *needs)
    yield normalization.layer_norm_forward, (np, ln_x, ln_w, ln_b, 1e-5)
    yield normalization.layer_norm_forward, (np, ln_x, None, None, 1e-5)
    ln_dy, ln_u, ln_t = (rng.standard_normal(ln_x.shape) for _ in range(3))
    _, ln_xhat, ln_rstd = normalization.layer_norm_forward.reference(np, ln_x, ln_w, ln_b, 1e-5)
    ln_dx = normalization.layer_norm_backward.reference(np, ln_dy, ln_xhat, ln_rstd, ln_w, True, False, False)[0]
    for weight in (ln_w, None):
        yield normalization.layer_norm_double_backward, (np, ln_dy, ln_xhat, ln_rstd, weight, ln_dx, ln_u, ln_w * 0.5,
                                                         ln_b * 2.0, True, True, weight is not None)
        yield normalization.layer_norm_backward_jvp, (np, ln_dy, ln_xhat, ln_rstd, weight, ln_dx, ln_u, ln_t, ln_w * 0.3,
                                                      True, weight is not None, True)
    for kind in ("gelu", "gelu_tanh"):
        gelu_h = 3 * rng.standard_normal((6, 7))
        gelu_aux = activation.bias_activation_forward.reference(np, gelu_h, None, kind)[1][1]
        gelu_dy, gelu_g, gelu_t = (rng.standard_normal(gelu_h.shape) for _ in range(3))
        yield activation.gelu_double_backward, (np, gelu_g, gelu_dy, gelu_h, gelu_aux, kind, True, True)
        yield activation.gelu_backward_jvp, (np, gelu_dy, gelu_h, gelu_aux, gelu_t, gelu_g, kind)
        yield activation.gelu_backward_jvp, (np, gelu_dy, gelu_h, gelu_aux, None, gelu_g, kind)
        if kind == "gelu":  # with the exact form's phi(h) formed already, and forming it
            gelu_density = activation.normal_density(gelu_h)
            yield activation.gelu_backward_jvp, (np, gelu_dy, gelu_h, gelu_aux, gelu_t, gelu_g, kind, gelu_density)
            yield activation.gelu_backward_density, (np, gelu_dy, gelu_h, gelu_aux)
            yield activation.gelu_backward_density, (np, gelu_dy, gelu_h, gelu_aux, gelu_density)
    yield normalization.layer_norm_backward, (np, rng.standard_normal(ln_x.shape), ln_xhat, ln_rstd, ln_w, True, True, True)
    yield normalization.layer_norm_backward, (np, rng.standard_normal(ln_x.shape), ln_xhat, ln_rstd, None, True, False,
                                              False)


def arrays_of(value):
    """The arrays in a result or argument list (nested tuples and lists; None and scalars skipped)."""
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for item in value for a in arrays_of(item)]
    return []


def assert_same(got, want, table):
    assert len(got) == len(want), table.__name__
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, table.__name__
        if a.dtype.kind in "biu":
            np.testing.assert_array_equal(a, b, err_msg=table.__name__)
        else:  # the GEMMs' and the sums' last bits (blocks, einsum); float32 erf: its rational function
            tol = 1e-6 if a.dtype == np.float32 else 1e-13
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max(initial=0)),
                                       err_msg=table.__name__)


@pytest.mark.parametrize("n", [1, 3])
def test_every_cpu_implementation_equals_its_reference(n, threads, rng):
    threads(n)
    covered = set()
    for table, args in cases(rng):
        implementation, reason = table.choose(*args)
        assert reason.startswith("cpu:"), (table.__name__, reason)
        ours, theirs = (copy.deepcopy(args, {id(np): np}) for _ in range(2))   # (xp, the module numpy, is not copied)
        got = implementation(*ours)
        with kernels.reference_only():   # the reference's own inner tables too
            want = table.reference(*theirs)
        assert_same(arrays_of(got) + arrays_of(ours), arrays_of(want) + arrays_of(theirs), table)
        covered.add(table)
    tables = {t for t in kernels.TABLES if t.reference.__module__.startswith("npformer.functional")
              and "cpu" in t.implementations}
    assert tables <= covered, sorted(t.__name__ for t in tables - covered)
