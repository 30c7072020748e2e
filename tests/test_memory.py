"""Memory lifetime, against torch's: what a graph, a training step or a decoding call keeps alive
after it is done. Checked with weak references to the arrays ops save (not with process memory),
by reference counting alone where torch frees by reference counting (gc disabled)."""
import weakref

import numpy as np
import pytest

from autograd import Function, Tensor


class _Saves(Function):
    """x -> 3x, saving a fresh array for backward; `saved` holds weak references to those arrays."""
    saved = []

    @staticmethod
    def forward(ctx, x):
        kept = x * 2.0
        ctx.save_for_backward(kept)
        _Saves.saved.append(weakref.ref(kept))
        return x * 3.0

    @staticmethod
    def backward(ctx, grad):
        (kept,) = ctx.saved_tensors
        return grad * 3.0


def _torch_saves(torch):
    """_Saves as a torch.autograd.Function, with its own list of weak references."""
    class Saves(torch.autograd.Function):
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


def test_a_retained_gradient_does_not_keep_the_graph_alive(torch, no_gc):
    """retain_grad() on an intermediate: dropping the loss and the intermediate frees the graph by
    reference counting alone, as in torch (whose node holds the tensor weakly), with or without a
    backward with retain_graph=True; the gradient still reaches the intermediate while it lives."""
    for op, x in ((_Saves, Tensor(np.ones(4), requires_grad=True)),
                  (_torch_saves(torch), torch.ones(4, dtype=torch.float64, requires_grad=True))):
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
