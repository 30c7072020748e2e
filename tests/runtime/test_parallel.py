"""npformer.runtime.threads: ops split into row blocks across threads give the results of
one thread (forced here on small shapes by lowering the size threshold), dropout masks do not
depend on the number of threads, and the pool's bookkeeping (order, errors, nesting)."""
import numpy as np
import pytest

import autograd
from autograd import Tensor, backend
from npformer import functional as F
from npformer.functional.activation import dropout_mask
from npformer.runtime import threads as _parallel
from npformer.runtime import random

from helpers import assert_same_with_threads


def test_linear_split_by_rows_and_features(threads, rng):
    x, w, b = rng.standard_normal((2, 7, 5)), rng.standard_normal((6, 5)), rng.standard_normal(6)
    assert_same_with_threads(threads, F.linear, [x, w, b])
    assert_same_with_threads(threads, lambda x, w: F.linear(x, w), [x, w])


@pytest.mark.parametrize("batch", [5, 1])  # 5: blocks of the batch; 1: blocks of the heads
@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "broadcast_kv", "dropout_weights",
                                  "head_masks"])
def test_attention_split_by_batch_or_heads(threads, rng, case, batch):
    B, H, T, S, hd = batch, 4, 4, 6, 3
    q = rng.standard_normal((B, H, T, hd))
    k = rng.standard_normal((1 if case == "broadcast_kv" else B, H, S, hd))
    v = rng.standard_normal(k.shape)
    mask = None
    if case == "bool_mask":
        mask = rng.random((B, 1, 1, S)) > 0.3
        mask[:, ..., 0] = True
    elif case == "float_mask":
        mask = rng.standard_normal((T, S))
    elif case == "head_masks":  # a mask per head (aligned to the right), and one per batch entry and head
        head_mask, both = rng.standard_normal((H, T, S)), rng.random((B, H, T, S)) > 0.3
        both[..., 0] = True
        assert_same_with_threads(threads, lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                                 [q, k, v, head_mask])   # the mask's gradient too
        mask = both

    def attention(q, k, v, **path):
        generator = random.Philox(7)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=case == "causal", dropout_p=0.3 if case == "dropout_weights" else 0.0,
            return_weights=case == "dropout_weights", generator=generator, **path)
    assert_same_with_threads(threads, attention, [q, k, v])
    if case != "dropout_weights":  # the memory-efficient path (its CPU kernels split alike), in blocks of 4
        assert_same_with_threads(threads, lambda q, k, v: attention(q, k, v, memory_efficient=True, block_size=4),
                                 [q, k, v])


def test_row_ops_split_by_rows(threads, rng):
    x = rng.standard_normal((9, 4, 6))
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    assert_same_with_threads(threads, lambda x, w, b: F.layer_norm(x, 6, w, b), [x, w, b])
    assert_same_with_threads(threads, lambda x: F.layer_norm(x, (4, 6)), [x])
    assert_same_with_threads(threads, F.relu, [x])
    assert_same_with_threads(threads, lambda x: F.dropout(x, 0.4, generator=random.Philox(3)), [x])
    assert_same_with_threads(threads, lambda x: F.split_heads(x, 2, chunks=3), [rng.standard_normal((5, 4, 12))])


@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_split_by_rows(threads, rng, weighted):
    logits, target = rng.standard_normal((11, 7)), rng.integers(0, 7, 11)
    target[[2, 5]] = -100
    weight = rng.random(7) + 0.5 if weighted else None
    assert_same_with_threads(threads, lambda x: F.cross_entropy(x, target, weight=weight, label_smoothing=0.2),
                             [logits])


@pytest.mark.parametrize("shape", [(37, 5), (300, 301)])
def test_dropout_mask_does_not_depend_on_threads(threads, shape, device):
    masks, offsets = [], []
    for n in (1, 2, 3):
        threads(n)
        generator = random.Philox(11, offset=24)
        masks.append(backend.as_numpy(dropout_mask(shape, 0.25, device, generator)))
        offsets.append(generator.offset)  # the stream continues at the same place
    assert all(np.array_equal(m, masks[0]) for m in masks[1:])
    assert offsets == [24 + -(-np.prod(shape) // 8) * 8] * 3
    assert 0.6 < masks[0].mean() < 0.9


def test_dropout_mask_is_on_the_device(threads, device):
    threads(2)
    mask = dropout_mask((64, 33), 0.1, device)
    assert backend.device_of(mask) == device and mask.shape == (64, 33) and mask.dtype == bool


def test_side_by_side_shares_the_threads_or_runs_each_piece_by_itself(threads, monkeypatch):
    """Two pieces in one hand-off, the threads shared between them; without enough work, each
    piece by for_rows on its own entries."""
    ran = []

    def piece(name):
        return lambda a, b: ran.append((name, a, b))

    threads(4)
    _parallel.side_by_side([(piece("x"), 10, 10), (piece("w"), 6, 6)], 16)
    assert sorted(ran) == [("w", 0, 3), ("w", 3, 6), ("x", 0, 5), ("x", 5, 10)]
    ran.clear()
    monkeypatch.setattr(_parallel, "MIN_PARALLEL_ENTRIES", 12)
    _parallel.side_by_side([(piece("x"), 10, 4), (piece("w"), 6, 20)], 8)   # the whole work: too small
    assert ran[0] == ("x", 0, 10) and sorted(ran[1:]) == [("w", a, b) for a, b in _parallel.row_blocks(6, 20)]
    assert len(ran) == 1 + 4


def test_run_blocks_order_errors_and_nesting(threads):
    threads(3)
    blocks = _parallel.row_blocks(10, 10)
    assert blocks == [(0, 3), (3, 6), (6, 10)]
    assert _parallel.run_blocks(lambda a, b: list(range(a, b)), blocks) == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]

    def inner(a, b):  # a nested split inside a block runs in that block's thread
        return _parallel.for_rows(lambda c, d: (c, d), 4, 4)
    assert _parallel.run_blocks(inner, blocks) == [[(0, 4)]] * 3

    # tasks of different kernels: linear's backward runs dx and dW side by side
    assert _parallel.split_blocks(4, (10, 6)) == [[(0, 5), (5, 10)], [(0, 3), (3, 6)]]
    assert _parallel.split_blocks(3, (10, 6)) == [[(0, 10)], [(0, 6)]]
    assert _parallel.run_tasks([(lambda a, b: ("x", a, b), 0, 5), (lambda a, b: ("w", a, b), 0, 6)]) == [
        ("x", 0, 5), ("w", 0, 6)]

    def failing(a, b):
        if a == 3:
            raise ValueError("block 3 failed")
    with pytest.raises(ValueError, match="block 3 failed"):
        _parallel.run_blocks(failing, blocks)


def test_blas_runs_one_thread_while_npformer_splits(threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    threads(1)
    before = blas_threads()
    threads(2)
    assert all(n == 1 for n in blas_threads())
    assert _parallel.row_blocks(10, 10) == [(0, 5), (5, 10)]
    assert _parallel.row_blocks(10, 10, like=np.zeros(1)) == [(0, 5), (5, 10)]
    threads(1)
    assert blas_threads() == before and _parallel.row_blocks(10, 10) == [(0, 10)]


@pytest.mark.parametrize("n, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_set_num_threads_rejects_bad_values(n, error):
    with pytest.raises(error, match="set_num_threads: n must be an integer >= 1"):
        _parallel.set_num_threads(n)


def test_float32_stays_float32_in_blocks(threads, rng):
    threads(2)
    x = Tensor(rng.standard_normal((6, 8)).astype("float32"), requires_grad=True)
    out = F.cross_entropy(F.relu(F.layer_norm(x, 8)), np.arange(6))
    out.backward()
    assert out.dtype == np.float32 and x.grad.dtype == np.float32
    assert autograd.Tensor(x.grad).dtype == np.float32


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_split_across_threads_matches_one_thread(threads, rng, name):
    from npformer import optim
    shapes, grads = [(7, 5), (11,)], [[rng.standard_normal(s) for s in [(7, 5), (11,)]] for _ in range(3)]
    results = []
    for n in (1, 2, 3):
        threads(n)
        params = [Tensor(np.ones(s), requires_grad=True) for s in shapes]
        optimizer = getattr(optim, name)(params, lr=0.1, weight_decay=0.1)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = Tensor(g.copy())
            optimizer.step()
        results.append([p.data.copy() for p in params])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
