"""nn.Module machinery: registration, traversal, state_dict / load_state_dict, modes,
gradients, devices and dtypes, containers, repr."""
import threading

import numpy as np
import pytest

from autograd import Tensor, backend, is_grad_enabled
from npformer import nn, optim


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


def test_parameter_refuses_a_read_only_array_and_shares_a_writable_one_like_torch():
    """A read-only array (np.broadcast_to's view) was accepted, and SGD.step() then failed with
    numpy's "output array is read-only": it is refused when the parameter is made."""
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    for data in (np.broadcast_to(np.ones(3), (2, 3)), read_only, Tensor(read_only)):
        with pytest.raises(ValueError, match=r"Parameter: data must be a writable array \(optimizers update it in "
                                             r"place\), got a read-only ndarray of shape \((2, )?3,?\)"):
            nn.Parameter(data)
    data = np.ones((2, 3))
    p = nn.Parameter(data)  # as torch.nn.Parameter: no copy, the optimizer's updates show in `data`
    p.grad = np.ones((2, 3))
    optim.SGD([p], lr=0.5).step()
    np.testing.assert_array_equal(data, np.full((2, 3), 0.5))


# -- side by side with torch.nn.Module ------------------------------------------------------------
def test_a_submodule_registered_twice_is_saved_once_under_its_first_name(torch):
    """On purpose unlike torch (which saves it under every name): Seq2SeqTransformer's
    share_embeddings=True format (src_embed is tgt_embed, one key) rests on it; documented in
    Module.state_dict and docs/torch_conventions.md."""
    shared, t_shared = nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ours, theirs = nn.Sequential(shared, nn.ReLU(), shared), torch.nn.Sequential(t_shared, torch.nn.ReLU(), t_shared)
    assert list(ours.state_dict()) == ["0.weight", "0.bias"]
    assert list(theirs.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert len(list(ours.parameters())) == len(list(theirs.parameters())) == 2   # each parameter once in both
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()] == ["", "0", "1"]
    # torch's state_dict of such a model loads with strict=False, reporting the second names
    result = ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()}, strict=False)
    assert result == ([], ["2.weight", "2.bias"])
    np.testing.assert_array_equal(shared.weight.numpy(), t_shared.weight.detach().numpy())


def test_a_module_that_contains_itself_does_not_recurse_forever():
    m = nn.Sequential(nn.Linear(2, 2))
    m.add_module("again", m)
    assert list(m.state_dict()) == ["0.weight", "0.bias"] and [n for n, _ in m.named_modules()] == ["", "0"]


def test_sequential_slices_keep_their_names_like_torch_and_module_list_slices_renumber(torch):
    ours = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2), nn.ReLU())
    theirs = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2), torch.nn.ReLU())
    for index in (slice(1, None), slice(None, None, 2), slice(None, None, -1), slice(2, 3)):
        part, t_part = ours[index], theirs[index]
        assert isinstance(part, nn.Sequential)
        assert [n for n, _ in part.named_children()] == [n for n, _ in t_part.named_children()]
        assert list(part.state_dict()) == list(t_part.state_dict())
        assert list(part) == list(ours)[index]   # the same module objects, in order
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    t_layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    assert list(layers[1:].state_dict()) == list(t_layers[1:].state_dict()) == ["0.weight", "0.bias", "1.weight",
                                                                                "1.bias"]
    assert layers[-1] is list(layers)[-1] and layers[1:][0] is layers[1]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            layers[bad]
        with pytest.raises(IndexError):
            t_layers[bad]


@pytest.mark.parametrize("name,error,match", [
    ("a.b", KeyError, "must not contain a dot"), ("", KeyError, "empty"), (1, TypeError, "string")])
@pytest.mark.parametrize("method", ["register_parameter", "register_buffer", "add_module"])
def test_bad_names_are_refused_like_torch(torch, method, name, error, match):
    value = {"register_parameter": None, "register_buffer": None, "add_module": None}[method]
    with pytest.raises(error):
        getattr(torch.nn.Module(), method)(name, value)
    m = nn.Module()
    with pytest.raises(error, match=match):
        getattr(m, method)(name, value)
    assert m.state_dict() == {} and not m._parameters and not m._buffers and not m._modules


@pytest.mark.parametrize("method", ["register_parameter", "register_buffer", "add_module"])
def test_registering_over_a_plain_attribute_is_refused_like_torch(torch, method):
    for m in (nn.Module(), torch.nn.Module()):
        m.plain = 3
        with pytest.raises(KeyError, match="already exists"):
            getattr(m, method)("plain", None)
        with pytest.raises(KeyError, match="already exists"):
            getattr(m, method)("training", None)
        assert m.plain == 3 and m.training is True


def test_registering_again_under_a_registered_name_replaces_it_like_torch(torch):
    m = nn.Linear(2, 2)
    m.register_parameter("bias", None)          # LayerNorm/Linear do this; a parameter may be re-registered
    m.register_buffer("steps", np.zeros(()))
    m.register_buffer("steps", np.ones(()))     # a buffer too
    assert m.bias is None and float(m.steps.item()) == 1.0
    assert list(m.state_dict()) == ["weight", "steps"]


def test_train_calls_each_childs_train_so_overrides_apply_like_torch(torch):
    def frozen(base):
        class Frozen(base.Module):
            def __init__(self):
                super().__init__()
                self.drop = base.Dropout(0.5)

            def train(self, mode=True):          # a frozen backbone: always in eval mode
                super().train(False)
                return self
        return Frozen

    for base in (nn, torch.nn):
        outer = base.Sequential(frozen(base)(), base.Dropout(0.1))
        assert outer.train() is outer and outer.training and outer[1].training
        assert not outer[0].training and not outer[0].drop.training
        assert outer.eval() is outer and not any(m.training for m in outer.modules())


def test_requires_grad_and_train_refuse_non_bools_like_torch(torch):
    for bad in (0, 1, "yes", None):
        with pytest.raises(TypeError):
            torch.nn.Linear(2, 2).requires_grad_(bad)
        with pytest.raises(TypeError, match="requires_grad"):
            nn.Linear(2, 2).requires_grad_(bad)
    m = nn.Linear(2, 2)
    assert m.requires_grad_(np.bool_(False)) is m and not any(p.requires_grad for p in m.parameters())
    assert m.requires_grad_() is m and all(p.requires_grad for p in m.parameters())


def test_zero_grad_without_none_zeroes_the_gradient_arrays_in_place_like_torch(torch):
    m, t = nn.Linear(2, 2), torch.nn.Linear(2, 2)
    m(Tensor(np.ones((1, 2), dtype="float32"))).sum().backward()
    t(torch.ones(1, 2)).sum().backward()
    held, t_held = m.weight.grad, t.weight.grad
    m.zero_grad(set_to_none=False)
    t.zero_grad(set_to_none=False)
    assert m.weight.grad is held and not held.any() and t.weight.grad is t_held and not t_held.any()
    m.zero_grad()
    t.zero_grad()
    assert m.weight.grad is None and t.weight.grad is None


def test_traversal_matches_torch_with_tied_parameters_late_registration_and_deletion(torch):
    def build(base, param):
        m = base.Module()
        m.embed = base.Embedding(5, 3)
        m.body = base.Sequential(base.Linear(3, 3), base.Linear(3, 3, bias=False))
        m.head = base.Linear(3, 5, bias=False)
        m.head.weight = m.embed.weight          # tied (GPT-2's lm_head)
        m.scale = param(np.ones(3, dtype="float32") if base is nn else torch.ones(3))
        m.register_buffer("mask", np.ones(2, dtype="float32") if base is nn else torch.ones(2))
        m.register_buffer("cache", None)
        return m

    ours, theirs = build(nn, nn.Parameter), build(torch.nn, torch.nn.Parameter)
    for m in (ours, theirs):
        m.late = type(m.head)(3, 1)              # registered after construction: listed last
        del m.mask                               # deleting a buffer unregisters it
    for call in (lambda m: [n for n, _ in m.named_parameters()],
                 lambda m: [n for n, _ in m.named_parameters(remove_duplicate=False)],
                 lambda m: [n for n, _ in m.named_parameters(prefix="model", recurse=False)],
                 lambda m: [n for n, _ in m.named_buffers()],
                 lambda m: [n for n, _ in m.named_modules()],
                 lambda m: [n for n, _ in m.named_children()],
                 lambda m: list(m.state_dict())):
        assert call(ours) == call(theirs)
    assert len(list(ours.parameters())) == len(list(theirs.parameters())) == 7
    order, t_order = [], []
    ours.apply(lambda m: order.append(type(m).__name__))
    theirs.apply(lambda m: t_order.append(type(m).__name__))
    assert order == t_order
    assert "(head): Linear(in_features=3, out_features=5, bias=False)" in repr(ours)


def test_a_failed_load_changes_nothing_and_strict_false_reports_like_torch(torch):
    ours, theirs = Block(), torch.nn.Module()
    theirs.scale = torch.nn.Parameter(torch.ones(3))
    theirs.first, theirs.second = torch.nn.Linear(3, 4), torch.nn.Linear(4, 3)
    theirs.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    theirs.register_buffer("table", torch.arange(3.0), persistent=False)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    before = ours.state_dict()
    state = {k: v + 1 for k, v in before.items()}
    state["second.bias"] = np.zeros(5)                        # one wrong shape: nothing is loaded
    with pytest.raises(RuntimeError, match="second.bias"):
        ours.load_state_dict(state, strict=False)
    for (name, a), b in zip(before.items(), ours.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    partial = {"first.weight": np.zeros((4, 3)), "table": np.zeros(3), "extra": np.zeros(1)}
    result = ours.load_state_dict(partial, strict=False)
    t_result = theirs.load_state_dict({k: torch.from_numpy(v) for k, v in partial.items()}, strict=False)
    assert result == (t_result.missing_keys, t_result.unexpected_keys)   # a non-persistent buffer is unexpected
    assert not ours.first.weight.numpy().any()


@pytest.mark.parametrize("dtype", ["x", "int32", {}])
def test_to_refuses_a_dtype_that_is_not_floating(dtype):  # a name numpy does not know was its "not understood"
    with pytest.raises(TypeError, match=r"Module.to: dtype must be a floating dtype or its name"):
        nn.Linear(2, 3).to(dtype=dtype)


def test_inference_mode_turns_dropout_off_in_its_thread_only():
    """nn.inference_mode(): no graph and every dropout off (module, attention, the fused residual)
    in the calling thread, `training` unchanged; another thread keeps dropout on (issue 29 item 4)."""
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.5, dtype="float64")
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 8)), requires_grad=True)
    expected = layer.eval()(x).numpy()
    layer.train()
    inside = nn.inference_mode()  # one object, reentrant and shared by the threads
    with inside:
        with inside:
            assert nn.is_inference_mode_enabled() and not is_grad_enabled() and layer.training
            out = layer(x)
        assert nn.is_inference_mode_enabled() and not layer.training_active
        np.testing.assert_array_equal(out.numpy(), expected)
        assert not out.requires_grad
        other = []
        thread = threading.Thread(target=lambda: other.append((nn.is_inference_mode_enabled(), layer(x))))
        thread.start()
        thread.join()
        assert other[0][0] is False and other[0][1].requires_grad
        assert not np.array_equal(other[0][1].numpy(), expected)  # dropout on in the other thread
    assert not nn.is_inference_mode_enabled() and is_grad_enabled() and layer.training_active
    assert nn.inference_mode()(lambda: layer(x))().numpy().tolist() == expected.tolist()  # as a decorator
