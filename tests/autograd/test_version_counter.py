"""Tensor version counters (torch's `_version`): every in-place change through the public API
(optimizer steps, load_state_dict, checkpoint loading, Module.to, nn.init, gradient clipping,
ZeRO's parameter sharing) counts, and a backward through an op that saved a tensor changed
since raises torch's "modified by an inplace operation" error naming the op, never a gradient
that mixes old and new values. Issue #29, item 1."""
import re

import numpy as np
import pytest

import npformer
import npformer.distributed as dist
import npformer.functional as F
from autograd import Tensor, grad
from npformer import nn, optim
from npformer.checkpoint import load_checkpoint, save_checkpoint
from npformer.models import CausalLM

IN_PLACE = r"one of the variables needed for gradient computation has been modified by an inplace operation"


def small_model():
    npformer.manual_seed(0)
    return CausalLM(11, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, dropout=0.0).double()


def loss_of(model, seed=0):
    ids = np.random.default_rng(seed).integers(0, 11, (2, 6))
    return F.cross_entropy(model(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1))


def with_gradients(model):
    """The model with a gradient in every parameter (an optimizer step then changes every one)."""
    loss_of(model, seed=1).backward()
    return model


def gradients(model):
    return [p.grad.numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("make", [lambda ps: optim.SGD(ps, lr=0.5), lambda ps: optim.Adam(ps, lr=0.1),
                                  lambda ps: optim.AdamW(ps, lr=0.1)], ids=["SGD", "Adam", "AdamW"])
def test_a_step_between_forward_and_backward_raises_naming_the_op(make):
    # the repro: L = loss(m); step; L.backward() gave a gradient of neither the old nor the new weights
    model = with_gradients(small_model())
    loss = loss_of(model)
    make(model.parameters()).step()
    with pytest.raises(RuntimeError, match=IN_PLACE) as caught:
        loss.backward()
    assert re.search(r"\(input \d of npformer\.\w+(\.\w+)*\) is at version (\d+); expected version (\d+) instead",
                     str(caught.value))


def test_the_message_has_torchs_shape_and_names_the_tensor_and_the_op(torch):
    rng = np.random.default_rng(0)
    w0, x0 = rng.normal(size=(4, 3)), rng.normal(size=(5, 3))
    tw = torch.tensor(w0, requires_grad=True)
    tloss = (torch.tensor(x0, requires_grad=True) @ tw.T).tanh().sum()  # mm saves w for x's gradient
    with torch.no_grad():
        tw.mul_(2)
    with pytest.raises(RuntimeError) as torch_error:
        tloss.backward()

    w = nn.Parameter(w0.copy())
    loss = F.linear(Tensor(x0, requires_grad=True), w).tanh().sum()
    w.grad = Tensor(np.ones_like(w0))
    optim.SGD([w], lr=0.1).step()
    with pytest.raises(RuntimeError) as ours:
        loss.backward()
    shape = r"is at version (\d+); expected version (\d+) instead"
    assert IN_PLACE in str(torch_error.value) and IN_PLACE in str(ours.value)
    assert re.search(shape, str(torch_error.value)).groups() == ("1", "0")
    assert re.search(shape, str(ours.value)).groups() == ("1", "0")
    assert ("[Parameter of shape (4, 3), float64] (input 1 of npformer.functional.linear.LinearFunction)"
            in str(ours.value))


def test_a_view_that_an_op_saved_counts_its_bases_changes():
    # x @ w.T saves a transposed view of w's array (as slicing in_proj_weight does): the step changes it
    rng = np.random.default_rng(0)
    w = nn.Parameter(rng.normal(size=(4, 3)))
    x = Tensor(rng.normal(size=(5, 3)), requires_grad=True)
    loss = (x @ w.T).sum() + (x * w[0]).sum()
    w.grad = Tensor(np.ones((4, 3)))
    optim.SGD([w], lr=0.5).step()
    with pytest.raises(RuntimeError, match=re.escape("a view of a Parameter of shape (4, 3)")):
        loss.backward()


def test_a_copy_made_by_a_view_op_is_not_affected_by_its_bases_changes():
    rng = np.random.default_rng(0)
    w = nn.Parameter(rng.normal(size=(4, 3)))
    x = Tensor(rng.normal(size=(4, 5)), requires_grad=True)
    flat = w.T.reshape(12)  # numpy copies here: the step cannot change what Mul saves
    loss = (x.reshape(20)[:12] * flat).sum()
    expected = np.zeros((4, 5))
    expected.reshape(20)[:12] = w.data.T.reshape(12)
    w.grad = Tensor(np.ones((4, 3)))
    optim.SGD([w], lr=0.5).step()
    loss.backward(inputs=[x])
    np.testing.assert_array_equal(x.grad.numpy(), expected)


def test_a_changed_tensor_that_the_op_did_not_save_does_not_raise(torch):
    # Add saves nothing and LinearFunction does not save the bias: their gradients do not read them (torch's rule)
    rng = np.random.default_rng(0)
    w, b = nn.Parameter(rng.normal(size=(4, 3))), nn.Parameter(rng.normal(size=4))
    x = Tensor(rng.normal(size=(5, 3)), requires_grad=True)
    loss = (F.linear(x, Tensor(w.data.copy()), b) + w.sum()).sum()
    b.grad, w.grad = Tensor(np.ones(4)), Tensor(np.ones((4, 3)))
    optim.SGD([b, w], lr=0.5).step()
    w.grad = b.grad = None
    loss.backward()
    np.testing.assert_array_equal(b.grad.numpy(), np.full(4, 5.0))
    np.testing.assert_array_equal(w.grad.numpy(), np.full((4, 3), 20.0))
    tb = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    tloss = torch.nn.functional.linear(torch.tensor(x.data), torch.tensor(w.data), tb).sum()
    with torch.no_grad():
        tb.add_(1)
    tloss.backward()  # torch agrees: the bias is not saved


def test_the_training_loop_and_gradient_accumulation_do_not_raise():
    model = small_model()
    opt = optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, step).backward()
        loss_of(model, step + 10).backward()  # two backwards before a step: the gradients add up
        opt.step()
    reference = small_model()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p._version == q._version + 3 and not np.array_equal(p.data, q.data)


def test_a_retained_graph_raises_after_a_step():
    model = small_model()
    loss = loss_of(model)
    loss.backward(retain_graph=True)
    first = gradients(model)
    loss.backward(retain_graph=True)  # still fine: nothing changed
    for g, g1 in zip(gradients(model), first):
        np.testing.assert_allclose(g, 2 * g1, rtol=1e-12)
    optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()


def test_create_graph_gradients_raise_after_a_step():
    rng = np.random.default_rng(0)
    w = nn.Parameter(rng.normal(size=(3, 3)))
    x = Tensor(rng.normal(size=(2, 3)))
    loss = ((x @ w).tanh() ** 2).sum()
    (g,) = grad(loss, [w], create_graph=True)
    w.grad = Tensor(np.ones((3, 3)))
    optim.SGD([w], lr=0.5).step()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward(create_graph=True)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        (g * g).sum().backward()  # the gradient's own graph saved w too


def test_load_state_dict_and_load_checkpoint_between_forward_and_backward_raise(tmp_path):
    model = small_model()
    other = with_gradients(small_model())
    optim.SGD(other.parameters(), lr=0.5).step()
    loss = loss_of(model)
    model.load_state_dict(other.state_dict())
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()
    save_checkpoint(tmp_path / "other.npz", small_model())
    loss = loss_of(model)
    load_checkpoint(tmp_path / "other.npz", model)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()


def test_module_to_raises_when_it_changes_the_data_and_counts_nothing_otherwise():
    model = small_model()
    loss = loss_of(model)
    versions = [p._version for p in model.parameters()]
    model.to(dtype="float64")  # already float64: nothing moves
    assert [p._version for p in model.parameters()] == versions
    model.float()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()  # not a float64 gradient handed to a float32 parameter


def test_nn_init_between_forward_and_backward_raises():
    w = nn.Parameter(np.ones((3, 3)))
    loss = (Tensor(np.ones((2, 3)), requires_grad=True) @ w).sum()
    nn.init.xavier_uniform_(w)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()


def test_a_gradient_that_an_op_saved_counts_accumulation_and_clipping():
    rng = np.random.default_rng(0)
    w = Tensor(rng.normal(size=3), requires_grad=True)
    (w * w).sum().backward()
    x = Tensor(rng.normal(size=3), requires_grad=True)
    penalty = (x * w.grad).sum()  # Mul saves w.grad's array
    (w * w).sum().backward()      # adds into it in place
    with pytest.raises(RuntimeError, match=IN_PLACE):
        penalty.backward(retain_graph=True)
    penalty = (x * w.grad).sum()
    optim.clip_grad_norm_([w], 1e-3)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        penalty.backward()


def test_data_assignment_is_the_escape_hatch_and_bump_version_opts_in():
    # as in torch, `.data` is not counted: backward computes with the arrays the forward saved
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 3))
    w = nn.Parameter(w0.copy())
    x = Tensor(rng.normal(size=(2, 3)), requires_grad=True)
    loss = (x @ w).sum()
    w.data = 2 * w.data
    loss.backward(retain_graph=True)
    np.testing.assert_allclose(x.grad.numpy(), np.tile(w0.sum(axis=1), (2, 1)), rtol=1e-12)
    w.data[...] = 0  # written into the saved array itself: code that does this calls bump_version()
    w.bump_version()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()


def test_detach_shares_the_version_counter():
    w = nn.Parameter(np.ones((3, 3)))
    alias = w.detach().requires_grad_()
    loss = (Tensor(np.ones((2, 3)), requires_grad=True) @ w).sum()
    alias.grad = Tensor(np.ones((3, 3)))
    optim.SGD([alias], lr=0.1).step()  # changes w's array
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()


def test_zero_steps_count_and_its_training_loop_does_not_raise():
    model = with_gradients(small_model())
    zero = dist.ZeroRedundancyOptimizer(optim.Adam(model.parameters(), lr=1e-2))
    loss = loss_of(model)
    zero.step()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()
    for step in range(2):
        zero.zero_grad()
        loss_of(model, step).backward()
        zero.step()


def test_ddp_training_does_not_raise():
    model = small_model()
    ddp = dist.DistributedDataParallel(model)
    opt = optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        loss_of(ddp, step).backward()
        opt.step()


def test_the_check_runs_on_every_device(device):
    rng = np.random.default_rng(0)
    w = nn.Parameter(Tensor(rng.normal(size=(4, 3)), device=device))
    x = Tensor(rng.normal(size=(5, 3)), requires_grad=True, device=device)
    loss = (x @ w.T).sum()
    w.grad = Tensor(np.ones((4, 3)), device=device)
    optim.Adam([w], lr=0.1).step()
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()
    (x @ w.T).sum().backward()  # a forward after the step is fine
    np.testing.assert_allclose(x.grad.numpy(), np.tile(w.numpy().sum(axis=0), (5, 1)), rtol=1e-12)
