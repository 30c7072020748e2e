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
            p.grad = backend.to_device(g, device)
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
    step after step (the CUDA kernel's arithmetic: tests/test_kernels_emulated.py)."""
    results = {}
    for device in ("cpu", "test"):
        params = _params(np.random.default_rng(0), device, dtype)
        params[0] = Tensor(params[0].numpy().T, requires_grad=True, device=device)  # not contiguous
        opt = getattr(optim, name)(params, **kwargs)
        for grads in _grad_stream(np.random.default_rng(1), 12, dtype):
            for p, g in zip(params, grads):
                p.grad = backend.to_device(g.reshape(p.shape), device)
            opt.step()
        results[device] = [p.numpy() for p in params] + [backend.as_numpy(a) for st in opt.state.values()
                                                         for a in (st["exp_avg"], st["exp_avg_sq"])]
    for ours, host in zip(results["test"], results["cpu"]):
        assert ours.dtype == dtype
        np.testing.assert_array_equal(ours, host)


def test_float64_parameters_stay_float64(torch, rng):
    params = _params(rng, "cpu", "float64")
    ref = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    ours, theirs = optim.AdamW(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    for grads in _grad_stream(rng, 5, "float64"):
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g, torch.from_numpy(g.copy())
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
    a.grad = np.ones_like(a.data)
    opt.step()
    np.testing.assert_array_equal(b.data, before)
    # the first Adam step moves every entry by lr * sign(grad) (up to eps)
    np.testing.assert_allclose(a.data, _params(np.random.default_rng(0), "cpu")[0].data - 0.5, atol=1e-6)


def test_zero_grad(rng):
    params = _params(rng, "cpu")
    for p in params:
        p.grad = np.ones_like(p.data)
    opt = optim.SGD(params, lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
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
                p.grad = backend.to_device(g, device)
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
        p.grad = np.ones_like(p.data)
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
        p.grad, r.grad = backend.to_device(g, device), torch.from_numpy(g.copy())
    total = optim.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert isinstance(total, Tensor) and total.shape == () and total.device == device  # like torch: on the device
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, r in zip(params, ref):
        assert p.grad.dtype == np.float32
        np.testing.assert_allclose(backend.as_numpy(p.grad), r.grad.numpy(), rtol=1e-6, atol=scaled(1e-7, r.grad))


def test_clip_grad_norm_nonfinite(rng):
    p = _params(rng, "cpu")[0]
    p.grad = np.full(p.shape, np.inf, dtype="float32")
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
