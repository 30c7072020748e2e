"""Memory lifetime, against torch's: what a graph, a training step or a decoding call keeps alive
after it is done. Checked with weak references to the arrays ops save (not with process memory),
by reference counting alone where torch frees by reference counting (gc disabled)."""
import gc
import weakref

import numpy as np
import pytest

from autograd import Function, Tensor, no_grad


def _saving_function(base):
    """x -> 3x, saving a fresh array for backward, as a subclass of `base` (npformer's Function or
    torch.autograd.Function); its `saved` holds weak references to those arrays."""
    class Saves(base):
        saved = []

        @staticmethod
        def forward(ctx, x):
            kept = x * 2.0
            ctx.save_for_backward(kept)
            Saves.saved.append(weakref.ref(kept))
            return x * 3.0

        @staticmethod
        def backward(ctx, grad):
            return grad * 3.0
    return Saves


_Saves = _saving_function(Function)


def test_a_graph_lives_as_torchs_does(no_gc):
    """backward() frees what the ops saved (a second backward raises), retain_graph=True keeps it
    until the next, no_grad() keeps nothing, and dropping the loss frees an unused graph."""
    x = Tensor(np.ones(4), requires_grad=True)
    loss = _Saves.apply(x).sum()
    loss.backward()
    assert _Saves.saved[-1]() is None
    with pytest.raises(RuntimeError, match="already freed.*retain_graph=True"):
        loss.backward()
    loss = _Saves.apply(x).sum()
    loss.backward(retain_graph=True)
    assert _Saves.saved[-1]() is not None
    loss.backward()
    assert _Saves.saved[-1]() is None
    with no_grad():
        y = _Saves.apply(x)
    assert _Saves.saved[-1]() is None and y.creator is None
    loss = (_Saves.apply(x) * 2.0).sum()
    del loss
    assert _Saves.saved[-1]() is None


def test_a_retained_gradient_does_not_keep_the_graph_alive(torch, no_gc):
    """retain_grad() on an intermediate: dropping the loss and the intermediate frees the graph by
    reference counting alone, as in torch (whose node holds the tensor weakly), with or without a
    backward with retain_graph=True; the gradient still reaches the intermediate while it lives."""
    for op, x in ((_Saves, Tensor(np.ones(4), requires_grad=True)),
                  (_saving_function(torch.autograd.Function),
                   torch.ones(4, dtype=torch.float64, requires_grad=True))):
        for backward in (False, True):
            y = op.apply(x)
            y.retain_grad()
            loss = (y * 2.0).sum()
            if backward:
                loss.backward(retain_graph=True)
                np.testing.assert_array_equal(np.asarray(y.grad), np.full(4, 2.0))
            del y, loss
            assert op.saved[-1]() is None, (op, backward)


class _FailsOnce(Function):
    """Identity whose first backward raises (a bug in an op, Ctrl-C, anomaly mode's error)."""
    failed = False

    @staticmethod
    def forward(ctx, x):
        return x.copy()

    @staticmethod
    def backward(ctx, grad):
        if not _FailsOnce.failed:
            _FailsOnce.failed = True
            raise KeyboardInterrupt
        return grad


def test_a_backward_that_raises_leaves_no_partial_gradient_in_the_graph(no_gc):
    """A backward(retain_graph=True) stopped by an exception keeps none of its partial sums in the
    graph (torch's engine keeps them in the pass, not on the nodes): they held arrays as long as
    the graph lived, and the next backward through the graph added them to its gradients."""
    x = Tensor(np.ones(3), requires_grad=True)
    a = _Saves.apply(x)                                   # a = 3x
    loss = (_FailsOnce.apply(a) + a).sum()               # d loss / da = 2: 1 through each branch
    _FailsOnce.failed = False
    with pytest.raises(KeyboardInterrupt):
        loss.backward(retain_graph=True)                  # a's node had 1 of its 2 when the pass stopped
    assert a.creator.output_grads[0] is None
    x.grad = None
    loss.backward()
    np.testing.assert_array_equal(x.grad, np.full(3, 6.0))


def test_generate_frees_its_kv_cache_and_a_training_step_leaves_nothing_behind(no_gc, monkeypatch):
    """generate's KV cache goes when it returns (reference counting alone); a training step of a
    CausalLM with AdamW and dropout (masks drawn ahead on two threads) leaves no object behind:
    after the first steps, more steps add none."""
    import npformer
    from npformer import functional as F
    from npformer import optim
    from npformer.decoding import generate
    from npformer.models import CausalLM

    npformer.manual_seed(0)
    model = CausalLM(11, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, dropout=0.2, max_len=12)
    caches = []
    init_cache = CausalLM.init_cache
    monkeypatch.setattr(CausalLM, "init_cache", lambda self: caches.append(init_cache(self)) or caches[-1])
    generate(model, np.array([[1, 2, 3]]), 4)
    cache = weakref.ref(caches.pop())
    assert cache() is None

    saved = npformer.get_num_threads()
    npformer.set_num_threads(2)
    try:
        opt = optim.AdamW(model.parameters(), lr=1e-3)
        ids = np.random.default_rng(0).integers(0, 11, (4, 9))

        def step():
            loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        for _ in range(3):
            step()
        objects = len(gc.get_objects())
        for _ in range(5):
            step()
        assert len(gc.get_objects()) <= objects
    finally:
        npformer.set_num_threads(saved)
