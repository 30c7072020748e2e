"""How code outside the core plugs in: the hooks the core calls (autograd.hooks) and devices
registered with the backend switch (autograd.backend.register_device)."""
import types

import numpy as np
import pytest

from autograd import Tensor, backend, hooks
from npformer.runtime import deferred, lookahead


@pytest.fixture
def calls(monkeypatch):
    """What the hooks saw: ("backward_started" | "host_read", ...) in call order; the runtime's
    own hooks stay registered (first), so the rest of the step behaves as usual."""
    seen = []
    monkeypatch.setattr(hooks, "backward_started", hooks.backward_started + [lambda: seen.append("backward_started")])
    monkeypatch.setattr(hooks, "host_read", hooks.host_read + [lambda: seen.append("host_read")])
    return seen


def test_the_runtime_registers_its_hooks_once():
    assert hooks.backward_started.count(lookahead.end_pass) == 1
    assert hooks.host_read.count(deferred.raise_pending) == 1


def test_backward_started_runs_once_per_pass_before_any_gradient(calls):
    x = Tensor(np.ones(3), requires_grad=True)
    hooks.backward_started.append(lambda: calls.append(x.grad is None))  # (the fixture's copy of the list)
    (x * 2).sum().backward()
    assert calls == ["backward_started", True]       # before the pass: no gradient yet
    x.backward(np.ones(3))                           # a leaf's pass starts too
    assert calls == ["backward_started", True, "backward_started", False]


def test_backward_started_is_not_run_for_a_refused_backward(calls):
    with pytest.raises(ValueError, match=r"backward\(grad\): expected shape \(3,\)"):
        (Tensor(np.ones(3), requires_grad=True) * 2).backward(np.ones(4))
    assert calls == []


def test_every_host_read_runs_host_read_and_array_access_does_not(calls):
    t = Tensor(np.arange(3.0))
    t.data.sum(), t.shape, repr(t)                   # no value read through the Tensor API
    assert calls == []
    t.numpy()
    t[1].item()
    t.tolist()
    float(t[0]), int(t[2])
    assert calls == ["host_read"] * 5


class FakeArray(np.ndarray):
    """The arrays of a device registered in the tests below."""


FAKE_XP = types.SimpleNamespace(name="the fake device's array module")


@pytest.fixture
def fake_device(monkeypatch):
    """A device "fake" registered for one test (the registry restored afterwards)."""
    monkeypatch.setattr(backend, "_registered", dict(backend._registered))  # register_device adds to a copy
    monkeypatch.setattr(backend, "DEVICES", backend.DEVICES)                # and rebinds these: restored after
    monkeypatch.setattr(backend, "_registered_types", backend._registered_types)
    copies = []

    def from_host(dst, host):
        copies.append("to fake")
        if dst is None:
            return np.array(host).view(FakeArray)
        np.copyto(dst.view(np.ndarray), host)
        return dst

    def to_host(array):
        copies.append("from fake")
        return array.view(np.ndarray).copy()

    backend.register_device("fake", FakeArray, FAKE_XP, to_host, from_host)
    return copies


def test_a_registered_device_is_one_of_the_backend_switchs(fake_device):
    assert backend.DEVICES == ("cpu", "cuda", "test", "fake")
    a = backend.to_device(np.arange(3.0), "fake")
    assert type(a) is FakeArray and backend.device_of(a) == "fake" and backend.is_array(a)
    assert backend.get_array_module(np.ones(2), a) is FAKE_XP and backend.module_for("fake") is FAKE_XP
    assert backend.get_array_module(np.ones(2)) is np
    backend.copy_from_host(a, np.full(3, 7.0))
    host = backend.as_numpy(a)
    assert type(host) is np.ndarray and host.tolist() == [7.0, 7.0, 7.0]
    assert fake_device == ["to fake", "to fake", "from fake"]
    t = Tensor(np.ones(2), device="fake")
    assert t.device == "fake" and (t * 2).device == "fake"


def test_the_built_in_devices_cannot_be_registered_again(fake_device):
    for name in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=f"register_device: name must not be 'cpu' or 'cuda'.*got '{name}'"):
            backend.register_device(name, FakeArray, np, None, None)
