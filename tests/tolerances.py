"""Tolerances from magnitudes, for comparing two correct computations that round differently.

Another CPU runs other BLAS kernels (AVX-512 vs AVX2 blocking, fused multiply-adds, other
summation orders), and torch orders its sums differently from numpy: results agree only up to
rounding, and rounding scales with the magnitudes of what is summed, not with the result. A
sum of `terms` products whose factors are about m1, m2, ... rounds by about
eps * terms * m1 * m2 * ...; an exactly 0 entry (a saturated softmax) may come back as
1e-10 from a chain whose terms are 1e6. So every tolerance here is built from:

    rounding_tolerance(dtype, *magnitudes, terms)   one step of a chain: ULPS * eps * terms * prod(magnitudes)
    magnitude(array)                                the typical |entry|: the RMS (norm / sqrt(size))
    scaled(atol, *arrays)                           a tolerance set at unit scale, times max(1, magnitude)
                                                    of each array the compared values are made from

and a chain of ops adds one rounding_tolerance per step, each error carried forward by the
magnitudes it is multiplied with (tests/models/test_numerics.py writes attention's out). Never a bare
absolute tolerance fitted to one machine.
"""
import math

import numpy as np

from autograd import backend

ULPS = 8  # rounding steps of slack per term: two correct kernels differ by a few each way


def eps(dtype):
    return float(np.finfo(dtype).eps)


def host(array):
    """A Tensor, torch tensor or (numpy, cupy, test-device) array as a float64 numpy array."""
    if hasattr(array, "detach"):                    # autograd.Tensor or torch.Tensor
        array = array.detach().numpy()
    return np.asarray(backend.as_numpy(array) if backend.is_array(array) else array, dtype=np.float64)


def magnitude(array):
    """The typical |entry| of an array: the RMS of its finite entries (0 when there are none).
    By Cauchy-Schwarz a sum of n products of entries of a and b is at most n * magnitude(a) *
    magnitude(b) when the magnitudes are taken over those n entries."""
    values = host(array)
    values = values[np.isfinite(values)]
    return math.sqrt(float(np.mean(values * values))) if values.size else 0.0


def rounding_tolerance(dtype, *magnitudes, terms=1):
    """The rounding error of one entry that sums `terms` products of factors of sizes
    `magnitudes` (floats or arrays, elementwise): ULPS * eps(dtype) * terms * product."""
    bound = ULPS * eps(dtype) * terms
    for m in magnitudes:
        bound = bound * m
    return bound


def scaled(atol, *arrays):
    """A tolerance chosen at unit scale, multiplied by max(1, magnitude) of each array the
    compared values are made from (inputs, weights, upstream gradients)."""
    for a in arrays:
        atol *= max(1.0, magnitude(a))
    return atol


def assert_close(actual, desired, atol, rtol=0.0, err_msg=""):
    """NaN and infinities where `desired` has them, and |actual - desired| <= atol + rtol |desired|
    elsewhere; atol may be an array (one tolerance per entry)."""
    actual, desired = host(actual), host(desired)
    assert actual.shape == desired.shape, f"{err_msg}: shapes {actual.shape} vs {desired.shape}"
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(desired), err_msg=f"{err_msg}: NaN positions")
    infinite = np.isinf(desired)
    np.testing.assert_array_equal(actual[infinite], desired[infinite], err_msg=f"{err_msg}: infinities")
    finite = np.isfinite(desired)
    with np.errstate(invalid="ignore", over="ignore"):     # inf - inf where desired is not finite
        limit = np.broadcast_to(np.asarray(atol, dtype=np.float64), desired.shape) + rtol * np.abs(desired)
        error = np.abs(actual - desired)
    bad = finite & ~(error <= limit)
    if bad.any():
        with np.errstate(invalid="ignore", over="ignore"):
            worst = np.unravel_index(np.argmax(np.where(bad, error / np.maximum(limit, 1e-300), 0)), desired.shape)
        raise AssertionError(f"{err_msg}: {int(bad.sum())} of {desired.size} entries differ by more than the "
                             f"tolerance; worst at {worst}: {actual[worst]!r} vs {desired[worst]!r}, difference "
                             f"{error[worst]:.3g} > tolerance {limit[worst]:.3g}")


class Rounded:
    """One quantity of a chain of ops, for deriving its tolerance: `size`, the typical |entry|
    (a magnitude), and `error`, a bound on how far two correct computations of it may differ.
    Inputs start exact (error 0); each step adds its own rounding and carries the errors of
    its operands, multiplied by the sizes they meet."""

    def __init__(self, size, error=0.0):
        self.size, self.error = float(size), float(error)

    @classmethod
    def of(cls, array):
        return cls(magnitude(array))

    def dot(self, other, terms, dtype, scale=1.0):
        """scale * (sums of `terms` products of entries of self and other): a matmul step."""
        size = scale * terms * self.size * other.size
        carried = scale * terms * (self.error * other.size + self.size * other.error)
        return Rounded(size, carried + rounding_tolerance(dtype, scale, self.size, other.size, terms=terms))

    def __repr__(self):
        return f"Rounded(size={self.size:.3g}, error={self.error:.3g})"


def spread(probs):
    """The largest 1 - max_j P_ij over the softmax rows P_i that see a key: how far from one-hot
    the softmax is. A score error e moves row i's probabilities by at most 2 (1 - max_j P_ij) e
    each (4 (1 - max_j P_ij) e together), so a saturated softmax passes none of it on."""
    probs = host(probs)
    seen = probs.sum(axis=-1) > 0
    return float((1.0 - probs.max(axis=-1))[seen].max(initial=0.0))


def attention_chain(dtype, q, k, v, dout, scale, hd, tq, tk, spread=1.0):
    """Rounded out, dq, dk, dv of out = softmax(scale q k^T) v (per head: tq queries, tk keys,
    head size hd) from the Rounded q, k, v and upstream gradient dout, for a softmax `spread`
    away from one-hot (1: any). Each step is a sum of products (Rounded.dot) except the softmax,
    which moves each probability by at most 2 spread times the error of its scores and rounds
    by a few ulps of 1 per key. With |q|, |k| ~ 1e3 the scores are ~1e6 and carry ~1e-9 of
    rounding: a softmax that mixes keys passes that on to every gradient, a saturated one does not."""
    scores = q.dot(k, hd, dtype, scale)                                    # (tq, tk)
    probs = Rounded(1.0, 2 * spread * scores.error + rounding_tolerance(dtype, terms=tk))
    out = probs.dot(v, tk, dtype)
    out.size = v.size                                                      # a convex combination of v's rows
    # dP = dout v^T;  dS = P * (dP - sum_j P_j dP_j);  dq = scale dS k;  dk = scale dS^T q;  dv = P^T dout
    d_probs = dout.dot(v, hd, dtype)
    d_scores = Rounded(2 * d_probs.size, 2 * d_probs.error + (2 + tk) * probs.error * d_probs.size
                       + rounding_tolerance(dtype, d_probs.size, terms=tk))
    return out, d_scores.dot(k, tk, dtype, scale), d_scores.dot(q, tq, dtype, scale), probs.dot(dout, tq, dtype)
