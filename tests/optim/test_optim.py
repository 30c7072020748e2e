"""Optimizers, clipping and schedulers against torch.optim, step for step."""
import math

import numpy as np
import pytest

from autograd import Tensor, backend
from npformer import optim

from tolerances import scaled

SHAPES = [(5, 7), (7,), (3, 4, 2)]


def _params(rng, device, dtype="float32"):
    return [Tensor(rng.standard_normal(s).astype(dtype), requires_grad=True, device=device) for s in SHAPES]


def _grad_stream(rng, steps, dtype="float32"):
    return [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(steps)]


OPTIMIZERS = [
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=3e-2, betas=(0.8, 0.98), eps=1e-9, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2)),
    ("AdamW", dict(lr=3e-2, betas=(0.9, 0.98), weight_decay=0.3)),
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.05, momentum=0.8, dampening=0.3)),
]


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS)
def test_matches_torch_for_20_steps(torch, device, rng, name, kwargs):
    params = _params(rng, device)
    ref = [torch.tensor(backend.as_numpy(p.data), requires_grad=True) for p in params]
    ours = getattr(optim, name)(params, **kwargs)
    theirs = getattr(torch.optim, name)(ref, **kwargs)
    for grads in _grad_stream(rng, 20):
        for p, r, g in zip(params, ref, grads):
            p.grad = Tensor(backend.to_device(g, device))
            r.grad = torch.from_numpy(g.copy())
        ours.step()
        theirs.step()
    for p, r in zip(params, ref):
        assert p.dtype == np.float32 and p.device == device
        np.testing.assert_allclose(p.numpy(), r.detach().numpy(), rtol=0, atol=scaled(1e-6, p))


@pytest.mark.parametrize("name,kwargs", [o for o in OPTIMIZERS if o[0] != "SGD"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_adam_kernel_equals_the_host_path_bit_for_bit(name, kwargs, dtype):
    """The kernel table adam_update: the test device runs its reference (whole arrays; on a GPU,
    adam.cu), the CPU its row-threaded implementation; both give the same numbers bit for bit,
    step after step (the CUDA kernel's arithmetic: tests/functional/cuda/test_kernels_emulated.py)."""
    results = {}
    for device in ("cpu", "test"):
        params = _params(np.random.default_rng(0), device, dtype)
        params[0] = Tensor(params[0].numpy().T, requires_grad=True, device=device)  # not contiguous
        opt = getattr(optim, name)(params, **kwargs)
        for grads in _grad_stream(np.random.default_rng(1), 12, dtype):
            for p, g in zip(params, grads):
                p.grad = Tensor(backend.to_device(g.reshape(p.shape), device))
            opt.step()
        results[device] = [p.numpy() for p in params] + [backend.as_numpy(a) for st in opt.state.values()
                                                         for a in (st["exp_avg"], st["exp_avg_sq"])]
    for ours, host in zip(results["test"], results["cpu"]):
        assert ours.dtype == dtype
        np.testing.assert_array_equal(ours, host)


@pytest.mark.parametrize("name,kwargs", [o for o in OPTIMIZERS if o[0] != "SGD"])
def test_small_parameters_stepped_together_equal_one_at_a_time_bit_for_bit(name, kwargs, monkeypatch):
    """Adam's grouped step of small CPU parameters (one adam_update over flat arrays) against each
    parameter alone (_Together.MAX_ENTRIES = 0), step after step: a parameter above the size limit,
    a transposed one, two parameter groups, a parameter that gets its first gradient at step 4 and
    one without a gradient at step 6 (each has its own step count from then on), and a state dict
    saved at step 7 and loaded into the optimizer (its arrays replace the views: the sets are made
    again). Same parameters, m and v to the bit, and m and v are views of the flat arrays."""
    shapes = [(5, 7), (7,), (3, 4, 2), (300, 300), (2, 3), (6, 5), (4,), (3, 3)]

    def run(max_entries):
        monkeypatch.setattr(optim.optimizer._Together, "MAX_ENTRIES", max_entries)
        rng = np.random.default_rng(0)
        params = [Tensor(rng.standard_normal(s).astype("float32"), requires_grad=True) for s in shapes]
        params[5] = Tensor(params[5].numpy().T, requires_grad=True)               # not contiguous
        opt = getattr(optim, name)([{"params": params[:5]}, {"params": params[5:], "lr": 0.02}], **kwargs)
        for step in range(10):
            for i, p in enumerate(params):
                late, missing = (i == 1 and step < 4), (i == 2 and step == 6)
                p.grad = None if late or missing else Tensor(rng.standard_normal(p.shape).astype("float32"))
            opt.step()
            if step == 7:
                opt.load_state_dict(opt.state_dict())
        return opt, params, [p.numpy() for p in params] + [opt.state[id(p)][k] for p in params
                                                           for k in ("exp_avg", "exp_avg_sq")]
    alone = run(0)[2]
    opt, params, together = run(1 << 16)
    for a, b in zip(together, alone):
        np.testing.assert_array_equal(a, b)
    # at the last step: params 0 and 4 share a step count (1 and 2 each have their own), 6 and 7 too
    assert [list(sets) for sets in opt._together.values()] == [[(id(params[0]), id(params[4]))],
                                                               [(id(params[6]), id(params[7]))]]
    flat = opt._together[1][(id(params[6]), id(params[7]))]
    assert opt.state[id(params[7])]["exp_avg"].base is flat.m and opt.state[id(params[7])]["exp_avg_sq"].base is flat.v


def test_float64_parameters_stay_float64(torch, rng):
    params = _params(rng, "cpu", "float64")
    ref = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    ours, theirs = optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    for grads in _grad_stream(rng, 5, "float64"):
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = Tensor(g), torch.from_numpy(g.copy())
        ours.step()
        theirs.step()
    for p, r in zip(params, ref):
        assert p.dtype == np.float64
        np.testing.assert_allclose(p.numpy(), r.detach().numpy(), rtol=0, atol=scaled(1e-13, p))


def test_parameters_without_grad_are_skipped_and_groups_override(rng):
    a, b = _params(rng, "cpu")[:2]
    before = b.data.copy()
    opt = optim.Adam([{"params": [a], "lr": 0.5}, {"params": [b]}], lr=1e-3)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 1e-3]
    a.grad = Tensor(np.ones_like(a.data))
    opt.step()
    np.testing.assert_array_equal(b.data, before)
    # the first Adam step moves every entry by lr * sign(grad) (up to eps)
    np.testing.assert_allclose(a.data, _params(np.random.default_rng(0), "cpu")[0].data - 0.5, atol=1e-6)


def test_zero_grad(rng):
    params = _params(rng, "cpu")
    for p in params:
        p.grad = Tensor(np.ones_like(p.data))
    opt = optim.SGD(params, lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.numpy().any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_state_dict_round_trip_continues_identically(device, rng, name):
    kwargs = {"SGD": dict(lr=0.1, momentum=0.9)}.get(name, dict(lr=1e-2, weight_decay=0.1))
    params = _params(rng, device)
    stream = _grad_stream(rng, 10)
    opt = getattr(optim, name)(params, **kwargs)

    def run(optimizer, ps, grads):
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = Tensor(backend.to_device(g, device))
            optimizer.step()

    run(opt, params, stream[:5])
    saved = opt.state_dict()
    assert all(isinstance(v, np.ndarray) and type(v) is np.ndarray
               for s in saved["state"].values() for v in s.values() if hasattr(v, "shape"))
    clones = [Tensor(p.numpy().copy(), requires_grad=True, device=device) for p in params]
    other = getattr(optim, name)(clones, lr=123.0)
    other.load_state_dict(saved)
    assert other.param_groups[0]["lr"] == kwargs["lr"]
    run(opt, params, stream[5:])
    run(other, clones, stream[5:])
    for p, c in zip(params, clones):
        assert c.device == device
        np.testing.assert_array_equal(p.numpy(), c.numpy())


def test_load_state_dict_rejects_mismatched_shapes(rng):
    params = _params(rng, "cpu")
    opt = optim.Adam(params)
    for p in params:
        p.grad = Tensor(np.ones_like(p.data))
    opt.step()
    other = optim.Adam(list(reversed(_params(rng, "cpu"))))
    with pytest.raises(ValueError, match="shape"):
        other.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"), (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay")])
def test_bad_hyperparameters_raise(rng, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optim.Adam(_params(rng, "cpu"), **kwargs)


def test_bad_params_raise(rng):
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([], lr=0.1)
    p = _params(rng, "cpu")[0]
    with pytest.raises(ValueError, match="more than once"):
        optim.SGD([p, p], lr=0.1)
    with pytest.raises(ValueError, match="nesterov"):
        optim.SGD([p], lr=0.1, nesterov=True)


@pytest.mark.parametrize("max_norm,norm_type", [(0.5, 2.0), (100.0, 2.0), (0.1, math.inf), (1.0, 1.0)])
def test_clip_grad_norm_matches_torch(torch, device, rng, max_norm, norm_type):
    params = _params(rng, device)
    ref = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    for p, r in zip(params, ref):
        g = rng.standard_normal(p.shape).astype("float32")
        p.grad, r.grad = Tensor(backend.to_device(g, device)), torch.from_numpy(g.copy())
    total = optim.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert isinstance(total, Tensor) and total.shape == () and total.device == device  # like torch: on the device
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, r in zip(params, ref):
        assert p.grad.dtype == np.float32
        np.testing.assert_allclose(p.grad.numpy(), r.grad.numpy(), rtol=1e-6, atol=scaled(1e-7, r.grad))


def test_clip_grad_norm_nonfinite(rng):
    p = _params(rng, "cpu")[0]
    p.grad = Tensor(np.full(p.shape, np.inf, dtype="float32"))
    assert float(optim.clip_grad_norm_([p], 1.0)) == math.inf
    with pytest.raises(RuntimeError, match="norm"):
        optim.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="max_norm"):
        optim.clip_grad_norm_([p], -1.0)


def _lr_trace(scheduler, optimizer, steps):
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_noam_matches_paper_formula_and_torch_lambda(torch, rng):
    d_model, warmup = 512, 40
    opt = optim.Adam(_params(rng, "cpu"), lr=2.0, betas=(0.9, 0.98), eps=1e-9)
    sched = optim.NoamLR(opt, d_model=d_model, warmup_steps=warmup)
    ref_opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=2.0)
    ref = torch.optim.lr_scheduler.LambdaLR(
        ref_opt, lambda e: d_model ** -0.5 * min((e + 1) ** -0.5, (e + 1) * warmup ** -1.5))
    ours = _lr_trace(sched, opt, 120)
    theirs = _lr_trace(ref, ref_opt, 120)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
    # the paper's shape: linear rise, peak at step = warmup, then step^-0.5 decay
    assert ours[0] == pytest.approx(2.0 * d_model ** -0.5 * warmup ** -1.5)
    assert int(np.argmax(ours)) == warmup - 1
    assert ours[-1] == pytest.approx(2.0 * d_model ** -0.5 * 120 ** -0.5)
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_warmup_cosine_shape_and_torch_lambda(torch, rng):
    warmup, total, min_ratio = 10, 50, 0.1
    opt = optim.SGD(_params(rng, "cpu"), lr=0.3)
    sched = optim.WarmupCosineLR(opt, warmup_steps=warmup, total_steps=total, min_ratio=min_ratio)
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)

    def factor(e):
        s = e + 1
        if s <= warmup:
            return s / warmup
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup))))

    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, factor)
    ours, theirs = _lr_trace(sched, opt, 60), _lr_trace(ref, ref_opt, 60)
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)
    assert ours[0] == pytest.approx(0.03) and ours[warmup - 1] == pytest.approx(0.3)
    assert ours[total - 1] == pytest.approx(0.03) and ours[-1] == pytest.approx(0.03)
    assert all(a >= b for a, b in zip(ours[warmup - 1:], ours[warmup:]))


def test_scheduler_state_dict_round_trip(rng):
    opt = optim.Adam(_params(rng, "cpu"), lr=1.0)
    sched = optim.NoamLR(opt, d_model=64, warmup_steps=10)
    _lr_trace(sched, opt, 7)
    opt2 = optim.Adam(_params(rng, "cpu"), lr=1.0)
    sched2 = optim.NoamLR(opt2, d_model=64, warmup_steps=10)
    sched2.load_state_dict(sched.state_dict())
    assert _lr_trace(sched2, opt2, 5) == _lr_trace(sched, opt, 5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(warmup_steps=-1, total_steps=10), "warmup_steps"), (dict(warmup_steps=20, total_steps=10), "total_steps"),
    (dict(warmup_steps=2, total_steps=10, min_ratio=2.0), "min_ratio")])
def test_warmup_cosine_bad_arguments(rng, kwargs, match):
    with pytest.raises(ValueError, match=match):
        optim.WarmupCosineLR(optim.SGD(_params(rng, "cpu"), lr=0.1), **kwargs)


# -- side by side with torch.optim: parameter lists, state dicts mid-run, lr changes -------------------
def test_params_are_checked_like_torch(torch, rng):
    p = Tensor(rng.standard_normal((3, 2)).astype("float32"), requires_grad=True)
    t = torch.nn.Parameter(torch.ones(3, 2))
    with pytest.raises(TypeError):
        torch.optim.SGD(t, lr=0.1)
    with pytest.raises(TypeError, match="an iterable of Tensors or dicts, got a Tensor"):
        optim.SGD(p, lr=0.1)                         # was iterated row by row: rows no one optimizes
    with pytest.raises(TypeError):
        torch.optim.SGD([{"params": {t}}], lr=0.1)
    for unordered in ({p}, [{"params": {p}}]):       # state_dict indices would change between runs
        with pytest.raises(TypeError, match="set"):  # (torch catches the second only)
            optim.SGD(unordered, lr=0.1)
    with pytest.raises(ValueError, match="non-leaf"):
        torch.optim.SGD([t * 2], lr=0.1)
    with pytest.raises(ValueError, match="non-leaf"):
        optim.SGD([p * 2], lr=0.1)                   # never gets a .grad: it would silently never move
    with pytest.raises(KeyError, match="params"):
        optim.SGD([{"lr": 0.1}], lr=0.1)
    with pytest.raises(TypeError, match="dict"):
        optim.SGD([{"params": [p]}, p], lr=0.1)
    # a group's params may be one Tensor, as in torch
    assert optim.SGD([{"params": p}], lr=0.1).param_groups[0]["params"] == [p]
    assert torch.optim.SGD([{"params": t}], lr=0.1).param_groups[0]["params"] == [t]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_sgd_nesterov_must_be_a_bool(rng, value):
    with pytest.raises(TypeError, match="nesterov"):
        optim.SGD(_params(rng, "cpu"), lr=0.1, momentum=0.9, nesterov=value)
    assert optim.SGD(_params(rng, "cpu"), momentum=0.9, nesterov=np.bool_(True)).param_groups[0]["nesterov"] is True


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS)
def test_resumed_mid_run_with_lr_changes_and_a_skipped_parameter_matches_torch(torch, rng, name, kwargs):
    """Ours: 4 steps, state_dict -> a fresh optimizer (other hyperparameters) -> 4 more steps; torch
    runs the 8 steps without a break. Both change the lr through param_groups at step 3 and 6, and
    the second parameter has no gradient at steps 2 and 5 (skipped: its state does not advance)."""
    params = _params(rng, "cpu")
    ref = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    ours = getattr(optim, name)([{"params": params[:1]}, {"params": params[1:], "lr": kwargs["lr"] / 2}], **kwargs)
    theirs = getattr(torch.optim, name)([{"params": ref[:1]}, {"params": ref[1:], "lr": kwargs["lr"] / 2}], **kwargs)
    for step, grads in enumerate(_grad_stream(rng, 8)):
        if step == 4:
            saved = ours.state_dict()
            other = getattr(optim, name)([{"params": params[:1]}, {"params": params[1:]}], lr=5.0)
            other.load_state_dict(saved)
            ours = other
        if step in (3, 6):
            for mine, their in zip(ours.param_groups, theirs.param_groups):
                mine["lr"] = their["lr"] = mine["lr"] * 0.5
        for i, (p, r, g) in enumerate(zip(params, ref, grads)):
            skipped = i == 1 and step in (2, 5)
            p.grad = None if skipped else Tensor(g)
            r.grad = None if skipped else torch.from_numpy(g.copy())
        ours.step()
        theirs.step()
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.numpy(), r.detach().numpy(), rtol=0, atol=scaled(1e-6, p))
    if name != "SGD":
        assert [ours.state[id(p)]["step"] for p in params] == [int(theirs.state[r]["step"]) for r in ref]


def test_a_saved_state_with_numpy_numbers_loads_and_bools_are_refused(rng):
    params = _params(rng, "cpu")
    opt = optim.Adam(params, lr=1e-2)
    for p in params:
        p.grad = Tensor(np.ones_like(p.data))
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0].update(lr=np.float32(0.5), eps=np.float64(1e-7), betas=(np.float32(0.8), 0.9))
    saved["state"][0]["step"] = np.int64(3)
    other = optim.Adam(_params(rng, "cpu"))
    other.load_state_dict(saved)
    group = other.param_groups[0]
    assert group["lr"] == 0.5 and type(group["lr"]) is float and type(group["betas"][0]) is float
    assert other.state_dict()["state"][0]["step"] == 3 and type(other.state_dict()["state"][0]["step"]) is int
    for key, bad in (("lr", True), ("eps", np.bool_(False))):
        broken = opt.state_dict()
        broken["param_groups"][0][key] = bad
        with pytest.raises(TypeError, match=key):
            optim.Adam(_params(rng, "cpu")).load_state_dict(broken)
    broken = opt.state_dict()
    broken["state"][0]["step"] = True
    with pytest.raises(TypeError, match="step"):
        optim.Adam(_params(rng, "cpu")).load_state_dict(broken)


def test_lambda_lr_with_numpy_factors_round_trips_and_matches_torch(torch, rng):
    """A lr_lambda that returns numpy numbers (np.float32 from a numpy expression): the lrs stay
    torch's values, and the optimizer's and scheduler's state_dicts load (they were refused)."""
    def factor(epoch):
        return np.float32(0.9) ** epoch

    opt = optim.SGD(_params(rng, "cpu"), lr=0.1)
    sched = optim.LambdaLR(opt, factor)
    t_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    t_sched = torch.optim.lr_scheduler.LambdaLR(t_opt, factor)
    for _ in range(3):
        opt.step()
        sched.step()
        t_opt.step()
        t_sched.step()
    np.testing.assert_allclose(sched.get_last_lr(), t_sched.get_last_lr(), rtol=1e-7)
    opt2 = optim.SGD(_params(rng, "cpu"), lr=1.0)
    sched2 = optim.LambdaLR(opt2, factor)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert sched2.get_last_lr() == sched.get_last_lr() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_scheduler_made_on_a_resumed_optimizer_keeps_its_initial_lr_like_torch(torch, rng):
    """torch's schedulers set 'initial_lr' only where a group has none (setdefault): a second
    scheduler, or one made after optimizer.load_state_dict, counts from the first base lr, not
    from the lr the first one left."""
    for make in (lambda o: optim.WarmupCosineLR(o, warmup_steps=2, total_steps=6),
                 lambda o: optim.LambdaLR(o, lambda e: 0.5 ** e)):
        opt = optim.SGD(_params(rng, "cpu"), lr=0.4)
        sched = make(opt)
        t_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
        t_sched = torch.optim.lr_scheduler.LambdaLR(t_opt, sched.lr_lambda)
        for _ in range(3):
            opt.step()                              # no gradients: nothing moves, but torch wants the order
            t_opt.step()
            sched.step()
            t_sched.step()
        resumed = optim.SGD(_params(rng, "cpu"), lr=0.4)
        resumed.load_state_dict(opt.state_dict())
        t_resumed = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.4)
        t_resumed.load_state_dict(t_opt.state_dict())
        again = optim.LambdaLR(resumed, sched.lr_lambda)
        t_again = torch.optim.lr_scheduler.LambdaLR(t_resumed, sched.lr_lambda)
        assert again.base_lrs == t_again.base_lrs == [0.4]
        assert again.get_last_lr() == pytest.approx(t_again.get_last_lr(), rel=1e-12)
        second = optim.LambdaLR(opt, lambda e: 1.0)
        assert second.base_lrs == torch.optim.lr_scheduler.LambdaLR(t_opt, lambda e: 1.0).base_lrs == [0.4]


@pytest.mark.parametrize("norm_type", [2.0, 3.0, 0.5, 1.0, math.inf])
def test_clip_grad_norm_skips_empty_gradients_and_counts_tied_parameters_once(torch, rng, norm_type):
    from npformer import nn
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight                                    # tied: one Parameter, one gradient
    model.empty = nn.Parameter(np.zeros((0, 3), dtype="float32"))
    t_model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    t_model[1].weight = t_model[0].weight
    g = rng.standard_normal((5, 3)).astype("float32")
    model[0].weight.grad, t_model[0].weight.grad = Tensor(g.copy()), torch.from_numpy(g.copy())
    model.empty.grad = Tensor(np.zeros((0, 3), dtype="float32"))
    total = optim.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(t_model.parameters(), 0.5, norm_type=norm_type)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    np.testing.assert_allclose(model[0].weight.grad, t_model[0].weight.grad.numpy(), rtol=1e-6)
    assert optim.grad_norm([model.empty], norm_type) == 0.0
    assert float(optim.clip_grad_norm_([model.empty], 1.0, norm_type=norm_type)) == 0.0
