"""nn.Module machinery: registration, traversal, state_dict / load_state_dict, modes,
gradients, devices and dtypes, containers, repr."""
import numpy as np
import pytest

from autograd import Tensor, backend
from npformer import nn


class Block(nn.Module):
    """Two layers, a persistent and a non-persistent buffer, a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(np.ones(3, dtype="float32"))
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 3)
        self.register_buffer("steps", np.zeros((), dtype="int64"))
        self.register_buffer("table", np.arange(3, dtype="float32"), persistent=False)

    def forward(self, x):
        return self.second(self.first(x * self.scale)) + Tensor(self.table.data)


def test_registration_order_and_names():
    m = Block()
    assert [n for n, _ in m.named_parameters()] == ["scale", "first.weight", "first.bias", "second.weight",
                                                    "second.bias"]
    assert [n for n, _ in m.named_buffers()] == ["steps", "table"]
    assert [n for n, _ in m.named_modules()] == ["", "first", "second"]
    assert list(m.children()) == [m.first, m.second]
    assert all(p.requires_grad and isinstance(p, Tensor) for p in m.parameters())
    # parameters and persistent buffers only, as host numpy copies, in torch's order (own first)
    state = m.state_dict()
    assert list(state) == ["scale", "steps", "first.weight", "first.bias", "second.weight", "second.bias"]
    state["scale"][:] = 7
    assert np.all(m.scale.numpy() == 1)


def test_assignments_are_checked_and_replace_in_place():
    m = Block()
    with pytest.raises(TypeError, match="parameter 'scale'"):
        m.scale = Tensor(np.zeros(3))
    with pytest.raises(TypeError, match="submodule 'first'"):
        m.first = 3
    m.first = nn.Linear(3, 4)  # replacing keeps the registration order
    assert [n for n, _ in m.named_children()] == ["first", "second"]
    del m.second
    assert [n for n, _ in m.named_children()] == ["first"]
    with pytest.raises(AttributeError, match="no attribute 'second'"):
        m.second


def test_shared_parameter_listed_once():
    a = nn.Linear(2, 2)
    seq = nn.Sequential(a, nn.ReLU(), a)
    assert len(list(seq.parameters())) == 2
    x = Tensor(np.ones((1, 2), dtype="float32"))
    seq(x).sum().backward()
    assert a.weight.grad.shape == (2, 2)


def test_load_state_dict_round_trip_and_cast():
    source, target = Block(), Block()
    state = {k: v.astype("float64") if v.dtype.kind == "f" else v for k, v in source.state_dict().items()}
    result = target.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert a.dtype == b.dtype  # cast to the module's dtype


def test_load_state_dict_lists_every_problem():
    m = Block()
    state = m.state_dict()
    del state["first.bias"], state["steps"]
    state["extra.weight"] = np.zeros(2)
    state["second.weight"] = np.zeros((3, 5))
    with pytest.raises(RuntimeError) as info:
        m.load_state_dict(state)
    message = str(info.value)
    for part in ("missing keys (2): steps, first.bias", "unexpected keys (1): extra.weight",
                 "mis-shaped keys (1): second.weight: checkpoint (3, 5), model (3, 4)"):
        assert part in message
    # strict=False loads what fits but still refuses wrong shapes
    with pytest.raises(RuntimeError, match="mis-shaped"):
        m.load_state_dict(state, strict=False)
    del state["second.weight"]
    state["scale"] = np.full(3, 2.0)
    result = m.load_state_dict(state, strict=False)
    assert result.missing_keys == ["steps", "first.bias", "second.weight"]
    assert result.unexpected_keys == ["extra.weight"]
    assert np.all(m.scale.numpy() == 2)


def test_load_state_dict_accepts_torch_tensors(torch):
    m = nn.Linear(2, 3)
    m.load_state_dict({"weight": torch.ones(3, 2), "bias": torch.zeros(3)})
    assert np.all(m.weight.numpy() == 1) and np.all(m.bias.numpy() == 0)


def test_train_eval_and_zero_grad():
    m = Block()
    assert all(x.training for x in m.modules())
    assert m.eval() is m and not any(x.training for x in m.modules())
    m.train()
    assert all(x.training for x in m.modules())
    m(Tensor(np.ones((2, 3), dtype="float32"))).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad(set_to_none=False)
    assert all(np.all(p.grad == 0) for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_to_device_moves_everything_and_keeps_parameters(device):
    m = Block()
    params = list(m.parameters())
    assert m.to(device) is m
    assert list(m.parameters()) == params  # the same Parameter objects (optimizers keep working)
    assert all(t.device == device for t in list(m.parameters()) + list(m.buffers()))
    out = m(Tensor(np.ones((2, 3), dtype="float32"), device=device))
    out.backward(Tensor(np.ones(out.shape, dtype="float32"), device=device))
    assert out.device == device and all(backend.device_of(p.grad) == device for p in m.parameters())
    state = m.state_dict()
    assert all(type(v) is np.ndarray for v in state.values())
    m.double()
    assert all(p.dtype == np.float64 and p.grad.dtype == np.float64 for p in m.parameters())
    assert m.steps.dtype == np.int64 and m.table.dtype == np.float64  # only floating buffers are cast
    assert m.to("cpu").float().scale.dtype == np.float32 and m.scale.device == "cpu"


def test_to_rejects_bad_arguments():
    m = Block()
    with pytest.raises(ValueError, match="device"):
        m.to("tpu")
    with pytest.raises(TypeError, match="floating dtype"):
        m.to(dtype="int32")


def test_containers():
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    assert len(layers) == 3 and layers[-1] is list(layers)[2]
    assert [n for n, _ in layers.named_parameters()][:2] == ["0.weight", "0.bias"]
    assert isinstance(layers[1:], nn.ModuleList) and len(layers[1:]) == 2
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    x = Tensor(np.ones((4, 2), dtype="float32"))
    np.testing.assert_allclose(seq(x).numpy(), seq[2](seq[1](seq[0](x))).numpy())
    assert isinstance(seq[:2], nn.Sequential) and seq[:2](x).shape == (4, 3)


def test_parameter_and_repr():
    p = nn.Parameter(np.zeros(2, dtype="float32"))
    assert p.requires_grad and p.is_leaf and "Parameter containing" in repr(p)
    text = repr(nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.1)))
    assert "(0): Linear(in_features=2, out_features=3, bias=True)" in text and "(1): Dropout(p=0.1)" in text
    with pytest.raises(NotImplementedError, match="forward"):
        nn.Module()(1)
