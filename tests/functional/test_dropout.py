"""One random stream for every dropout mask (the dropout contract of npformer.runtime.random and
npformer.functional.activation): a dropout over n entries takes offset = generator.take(n) from a
random.Philox, and entry i (C order over the full shape) is kept iff bits16(seed, offset + i) >=
threshold. The mask's statistics, its sameness across devices, paths and twins, the CUDA kernel
(on the emulator), gradchecks with a fixed generator, and checkpoints resuming the stream."""
import json
import zipfile

import numpy as np
import pytest

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor, backend
from npformer import checkpoint, nn
from npformer.functional import activation, composite
from npformer.functional.attention import attention_keep_block
from npformer.functional.activation import cuda as dropout_launchers
from npformer.runtime import random

from cuda_emulator import build_or_skip
from helpers import compare_runs, leaf


def contract_mask(seed, offset, shape, p):
    """The dropout contract, written out."""
    threshold = min(round(p * 2**16), 2**16 - 1)
    return (random.bits16(seed, offset, int(np.prod(shape))) >= threshold).reshape(shape)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.97])
def test_f_dropout_draws_the_contract_mask_and_advances_the_stream(p, device):
    x = Tensor(np.ones((37, 11), dtype=np.float32), requires_grad=True, device=device)
    stream = random.Philox(seed=2**40 + 3, offset=64)
    y = F.dropout(x, p, generator=stream)
    keep = contract_mask(2**40 + 3, 64, x.shape, p)
    np.testing.assert_array_equal(y.numpy() != 0, keep)
    np.testing.assert_allclose(y.numpy()[keep], np.float32(1 / (1 - p)), rtol=1e-6)
    assert stream.offset == 64 + 408                            # 407 values rounded up to whole counters of 8
    y.backward(backend.to_device(np.full(x.shape, 3.0, dtype=np.float32), device))
    np.testing.assert_allclose(x.grad.numpy(), 3 * y.numpy(), rtol=1e-6)


def test_p_1_drops_everything_and_still_takes_its_values(device):
    x = Tensor(np.ones((3, 5)), device=device)
    stream = random.Philox(1)
    assert not F.dropout(x, 1.0, generator=stream).numpy().any() and stream.offset == 16
    assert not composite.dropout(x, 1.0, generator=stream).numpy().any() and stream.offset == 32


def test_the_keep_rate_and_the_independence_of_entries():
    """2^21 entries at p = 0.1, 0.5, 0.9: the drop rate is p within 5 sigma, and entries at lags 1
    (same counter), 8 (next counter), 7 and 9 (across a counter boundary) and 1000 (another row of
    a (., 1000) mask) are independent: chi-square of the 2x2 table of (keep_i, keep_i+lag) under
    30 (1 dof: p < 5e-8). Masks of two seeds, or of two offsets, are independent the same way."""
    n = 2**21

    def chi2(a, b):
        table = np.array([[np.sum(~a & ~b), np.sum(~a & b)], [np.sum(a & ~b), np.sum(a & b)]], dtype=float)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        return ((table - expected) ** 2 / expected).sum()

    for p in (0.1, 0.5, 0.9):
        keep = contract_mask(11, 0, (n,), p)
        assert abs((1 - keep.mean()) - p) < 5 * np.sqrt(p * (1 - p) / n)
        for lag in (1, 7, 8, 9, 1000):
            assert chi2(keep[:-lag], keep[lag:]) < 30, (p, lag)
        assert chi2(keep, contract_mask(12, 0, (n,), p)) < 30
        assert chi2(keep, contract_mask(11, 8 * 12345, (n,), p)) < 30


def test_the_mask_is_the_same_on_every_device_and_for_the_composite_twin(device):
    shape, p = (4, 3, 33), 0.3
    masks = []
    for dev in ("cpu", device):
        masks.append(backend.as_numpy(activation.dropout_mask(shape, p, dev, random.Philox(5, offset=8))))
    np.testing.assert_array_equal(masks[0], masks[1])
    np.testing.assert_array_equal(masks[0], contract_mask(5, 8, shape, p))
    x = np.random.default_rng(0).standard_normal(shape)
    compare_runs(lambda a: F.dropout(a, p, generator=random.Philox(5, offset=8)),
                 lambda a: composite.dropout(a, p, generator=random.Philox(5, offset=8)),
                 [x], np.random.default_rng(1), device)


def test_dropout_gradcheck_with_a_fixed_generator(device):
    x = leaf(np.random.default_rng(2).standard_normal((5, 7)), device)
    assert autograd.gradcheck(lambda a: F.dropout(a, 0.35, generator=random.Philox(7)), [x])


def test_a_generator_that_is_not_a_philox_stream_is_a_type_error():
    x = Tensor(np.ones(4))
    for call in (lambda g: F.dropout(x, 0.5, generator=g),
                 lambda g: F.scaled_dot_product_attention(Tensor(np.ones((2, 2))), Tensor(np.ones((2, 2))),
                                                          Tensor(np.ones((2, 2))), dropout_p=0.5, generator=g)):
        with pytest.raises(TypeError, match=r"generator must be an npformer\.runtime\.random\.Philox.*got Generator"):
            call(np.random.default_rng(0))


def test_nn_dropout_and_the_default_draw_from_the_global_stream(device):
    x = Tensor(np.ones((6, 10)), device=device)
    npformer.manual_seed(3)
    state = random.dropout_stream().state_dict()
    first, second = nn.Dropout(0.4)(x).numpy(), F.dropout(x, 0.4).numpy()
    replay = random.Philox(**state)
    np.testing.assert_array_equal(first, F.dropout(x, 0.4, generator=replay).numpy())
    np.testing.assert_array_equal(second, F.dropout(x, 0.4, generator=replay).numpy())
    assert random.dropout_stream().state_dict() == replay.state_dict()


def test_attention_dropout_drops_the_contract_mask_of_the_probabilities(device):
    rng = np.random.default_rng(4)
    q, k, v = (Tensor(rng.standard_normal((2, 3, t, 4)), device=device) for t in (5, 6, 6))
    _, weights = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, return_weights=True,
                                                generator=random.Philox(6, offset=40))
    np.testing.assert_array_equal(weights.numpy() != 0, contract_mask(6, 40, (2, 3, 5, 6), 0.3))


@pytest.mark.parametrize("tk", [6, 8, 13])
def test_a_block_of_the_attention_mask_is_drawn_alone(tk, device):
    """attention_keep_block (the memory-efficient path's per-block draw) is the block of the whole mask."""
    lead, tq, offset, p = (2, 3), 7, 24, 0.4
    whole = contract_mask(9, offset, lead + (tq, tk), p)
    like = backend.to_device(np.zeros(1), device)
    for qs, qe, ks, ke in ((0, 7, 0, tk), (2, 5, 1, 4), (6, 7, tk - 1, tk), (0, 3, 3, tk)):
        block = attention_keep_block((p, 9, offset, None), lead, tq, tk, qs, qe, ks, ke, like)
        assert backend.device_of(block) == device
        np.testing.assert_array_equal(backend.as_numpy(block), whole[..., qs:qe, ks:ke])


def test_bits16_runs_are_slices_of_the_stream(device):
    whole = random.bits16(3, 0, 5000)
    starts = np.array([0, 1, 7, 8, 9, 15, 1000, 4970], dtype=np.uint64)
    for width in (1, 8, 17, 30):
        runs = backend.as_numpy(random.bits16_runs(3, backend.to_device(starts, device), width))
        np.testing.assert_array_equal(runs, np.stack([whole[s:s + width] for s in starts.astype(int)]))


# -- checkpoints --------------------------------------------------------------------------------------
def test_a_checkpoint_resumes_the_dropout_stream_on_any_device(tmp_path):
    npformer.manual_seed(0)
    model = nn.Linear(3, 3)
    x = Tensor(np.ones((50, 3)))
    F.dropout(x, 0.5)
    path = npformer.save_checkpoint(tmp_path / "ck.npz", model)
    expected = F.dropout(x, 0.5).numpy()
    npformer.manual_seed(99)
    F.dropout(x, 0.5)
    npformer.load_checkpoint(path, model)
    np.testing.assert_array_equal(F.dropout(x.to("test"), 0.5).numpy(), expected)


@pytest.mark.parametrize("bad", [{"seed": -1, "offset": 0}, {"seed": 2**64, "offset": 0}, {"seed": 1, "offset": -8},
                                 {"seed": 1.5, "offset": 0}, {"seed": True, "offset": 0}, {"seed": 1}, [1, 2]])
def test_a_damaged_dropout_state_is_refused(tmp_path, bad):
    npformer.manual_seed(0)
    path = npformer.save_checkpoint(tmp_path / "ck.npz", nn.Linear(2, 2))
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(str(arrays["meta"]))
    meta["rng"]["dropout"] = bad
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "bad.npz", **arrays)
    before = random.dropout_stream().state_dict()
    with pytest.raises(checkpoint.CheckpointError, match="rng/dropout"):
        npformer.load_checkpoint(tmp_path / "bad.npz")
    assert random.dropout_stream().state_dict() == before
    assert zipfile.is_zipfile(path)


# -- the CUDA dropout kernel, on the emulator ---------------------------------------------------------------
@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_or_skip(tmp_path_factory.mktemp("cuda_emulator"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("size, offset, p", [(1, 0, 0.5), (1000, 3, 0.2), (4097, 8 * 2**32 - 16, 0.9), (20, 5, 1.0)])
def test_the_cuda_kernel_draws_the_contract_mask(emulator, monkeypatch, dtype, size, offset, p):
    """One thread per Philox counter, any offset (also not a multiple of 8, and past 2^32 counters)."""
    monkeypatch.setattr(dropout_launchers, "function", emulator.function)
    x = np.random.default_rng(5).standard_normal(size).astype(dtype)
    y = dropout_launchers.dropout_apply(np, x, 77, offset, p)
    keep = activation.keep_mask(x.shape, p, 77, offset, "cpu")
    np.testing.assert_array_equal(y, x * keep * x.dtype.type(activation.dropout_scale(p)))


def test_f_dropout_through_the_cuda_kernels_regenerates_its_mask(emulator, monkeypatch):
    """With the kernels standing in for the "cpu" implementation: nothing is saved for backward,
    and the output and gradient are those of the reference; gradcheck passes."""
    monkeypatch.setattr(dropout_launchers, "function", emulator.function)
    monkeypatch.setitem(activation.dropout_forward.implementations, "cpu", (dropout_launchers.dropout_forward_cuda, None))
    monkeypatch.setitem(activation.dropout_backward.implementations, "cpu",
                        (dropout_launchers.dropout_backward_cuda, lambda xp, dy, keep, *rest: keep is None))
    x = np.random.default_rng(6).standard_normal((9, 13))
    y = F.dropout(Tensor(x, requires_grad=True), 0.3, generator=random.Philox(1))
    assert y.creator.saved_tensors == (None,)
    with npformer.runtime.kernels.reference_only():
        compare_runs(lambda a: F.dropout(a, 0.3, generator=random.Philox(1)),
                     lambda a: composite.dropout(a, 0.3, generator=random.Philox(1)), [x], np.random.default_rng(7))
    compare_runs(lambda a: F.dropout(a, 0.3, generator=random.Philox(1)),
                 lambda a: composite.dropout(a, 0.3, generator=random.Philox(1)), [x], np.random.default_rng(7))
    assert autograd.gradcheck(lambda a: F.dropout(a, 0.3, generator=random.Philox(1)), [leaf(x)])
