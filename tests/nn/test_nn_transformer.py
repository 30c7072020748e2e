"""Transformer layers, stacks and nn.Transformer: the registry's cases (gradcheck, torch, composite
twin on every device), exact torch.nn.Transformer state_dict keys
and shapes, forward/backward parity with masks (post-LN and pre-LN, relu and gelu, float64
and float32), gradcheck, init, devices and argument errors."""
import math

import numpy as np
import pytest

import npformer
from autograd import Tensor
from npformer import nn

from npformer.opcases.modules import randomize_vectors

from helpers import F32, F64, assert_torch_parity, op_tests

test_gradcheck, test_matches_torch, test_matches_composite_twin = op_tests("transformer")

B, S, T, D, H, FF = 2, 5, 4, 8, 2, 12
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched")  # torch warns on bool + float masks


def transformer_masks(rng, src_len=S, tgt_len=T):
    """name -> forward kwargs in torch.nn's convention."""
    causal = nn.Transformer.generate_square_subsequent_mask(tgt_len, dtype="float64")
    src_pad = np.zeros((B, src_len), dtype=bool)
    src_pad[1, src_len - 2:] = True
    tgt_pad = np.zeros((B, tgt_len), dtype=bool)
    tgt_pad[0, tgt_len - 1] = True
    per_head = np.triu(np.ones((B * H, tgt_len, tgt_len), dtype=bool), 1)
    per_head[1, 2, 0] = True
    memory_row = np.zeros((tgt_len, src_len), dtype=bool)
    memory_row[1] = True  # target position 1 sees no memory
    padding = dict(src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    return {
        "none": {},
        "causal": {"tgt_mask": causal},
        "padding": padding,
        "causal_and_padding": dict(padding, tgt_mask=causal),
        "float_additive": dict(src_mask=rng.standard_normal((src_len, src_len)),
                               tgt_mask=causal + rng.standard_normal((tgt_len, tgt_len)),
                               memory_mask=rng.standard_normal((tgt_len, src_len))),
        "per_head_bool": dict(padding, tgt_mask=per_head),
        "fully_masked_rows": dict(memory_mask=memory_row, tgt_mask=causal),
    }


def torch_kwargs(torch, kwargs):
    return {k: torch.tensor(v) for k, v in kwargs.items()}


def small_transformer(norm_first=False, activation="relu", **options):
    return nn.Transformer(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF,
                          dropout=0.0, norm_first=norm_first, activation=activation, **options)


@pytest.mark.parametrize("options", [{}, {"norm_first": True}, {"bias": False}, {"layer_norm_eps": 1e-3}])
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_state_dict_keys_and_shapes_equal_torch(options, torch):
    ours = nn.Transformer(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=FF,
                          **options)
    theirs = torch.nn.Transformer(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=3,
                                  dim_feedforward=FF, batch_first=True, **options)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == \
           [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()]
    assert "encoder.norm.weight" in ours.state_dict() and "decoder.norm.weight" in ours.state_dict()


@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (False, "gelu"), (True, "relu"), (True, "gelu")])
@pytest.mark.parametrize("mask", list(transformer_masks(np.random.default_rng(0))))
def test_transformer_matches_torch_float64(mask, norm_first, activation, torch):
    rng = np.random.default_rng(3)
    kwargs = transformer_masks(rng)[mask]
    m = randomize_vectors(small_transformer(norm_first, activation).double(), rng)
    t_kwargs = torch_kwargs(torch, kwargs)
    outs = assert_torch_parity(torch, m, lambda m, s, t: m(s, t, **kwargs), lambda tm, s, t: tm(s, t, **t_kwargs),
                               [rng.standard_normal((B, S, D)), rng.standard_normal((B, T, D))], **F64)
    assert np.isfinite(outs[0].numpy()).all()


def test_transformer_matches_torch_float32(torch, rng, device):
    kwargs = transformer_masks(rng)["causal_and_padding"]
    kwargs["tgt_mask"] = kwargs["tgt_mask"].astype("float32")
    m = randomize_vectors(small_transformer(True, "gelu"), rng)
    t_kwargs = torch_kwargs(torch, kwargs)
    assert_torch_parity(torch, m, lambda m, s, t: m(s, t, **kwargs), lambda tm, s, t: tm(s, t, **t_kwargs),
                        [rng.standard_normal((B, S, D)).astype("float32"),
                         rng.standard_normal((B, T, D)).astype("float32")], device=device, **F32)


def layer(kind, norm_first, activation="relu"):
    cls = nn.TransformerEncoderLayer if kind == "encoder" else nn.TransformerDecoderLayer
    return cls(D, H, FF, dropout=0.0, activation=activation, norm_first=norm_first)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("stack", [False, True])
def test_encoder_layer_and_stack_match_torch(stack, norm_first, torch, rng):
    m = randomize_vectors(layer("encoder", norm_first, "gelu"), rng)
    if stack:
        m = nn.TransformerEncoder(m, 2, nn.LayerNorm(D))
    kwargs = transformer_masks(rng)["padding"]
    mask, pad = np.triu(np.ones((S, S), dtype=bool), 1), kwargs["src_key_padding_mask"]
    mask_name = "mask" if stack else "src_mask"
    assert_torch_parity(torch, m.double(), lambda m, x: m(x, **{mask_name: mask}, src_key_padding_mask=pad),
                        lambda t, x: t(x, **{mask_name: torch.tensor(mask)}, src_key_padding_mask=torch.tensor(pad)),
                        [rng.standard_normal((B, S, D))], **F64)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("stack", [False, True])
def test_decoder_layer_and_stack_match_torch(stack, norm_first, torch, rng):
    m = randomize_vectors(layer("decoder", norm_first), rng)
    if stack:
        m = nn.TransformerDecoder(m, 2, nn.LayerNorm(D))
    kwargs = transformer_masks(rng)["causal_and_padding"]
    del kwargs["src_key_padding_mask"]
    t_kwargs = torch_kwargs(torch, kwargs)
    assert_torch_parity(torch, m.double(), lambda m, t, s: m(t, s, **kwargs), lambda tm, t, s: tm(t, s, **t_kwargs),
                        [rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D))], **F64)


def test_tgt_is_causal_equals_the_causal_mask(rng):
    m = small_transformer().double()
    src, tgt = Tensor(rng.standard_normal((B, S, D))), Tensor(rng.standard_normal((B, T, D)))
    np.testing.assert_allclose(m(src, tgt, tgt_is_causal=True).numpy(),
                               m(src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T)).numpy(), **F64)


def test_generate_square_subsequent_mask_equals_torch(torch):
    ours = nn.Transformer.generate_square_subsequent_mask(5)
    theirs = torch.nn.Transformer.generate_square_subsequent_mask(5).numpy()
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)
    assert nn.Transformer.generate_square_subsequent_mask(3, dtype="float64").dtype == np.float64


def test_init_like_torch():
    npformer.manual_seed(0)
    m = nn.Transformer(d_model=64, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=128)
    for name, p in m.named_parameters():
        values = p.numpy()
        if p.ndim == 2:  # xavier_uniform_ on every matrix
            bound = math.sqrt(6 / sum(p.shape))
            assert np.abs(values).max() <= bound and abs(values.std() - bound / math.sqrt(3)) < 0.1 * bound, name
        elif "norm" in name:
            assert np.all(values == (1 if name.endswith("weight") else 0)), name
        elif "attn" in name:
            assert np.all(values == 0), name
    layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 3).layers
    assert layers[0] is not layers[1]  # deep copies that start equal, like torch's _get_clones
    np.testing.assert_array_equal(layers[0].linear1.weight.numpy(), layers[2].linear1.weight.numpy())


def test_runs_on_device_and_double(device, rng):
    m = small_transformer().to(device)
    assert all(p.device == device for p in m.parameters())
    src = Tensor(rng.standard_normal((B, S, D)).astype("float32"), device=device)
    tgt = Tensor(rng.standard_normal((B, T, D)).astype("float32"), requires_grad=True, device=device)
    out = m(src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T),
            src_key_padding_mask=transformer_masks(rng)["padding"]["src_key_padding_mask"])
    assert out.device == device and out.dtype == np.float32
    out.sum().backward()
    assert tgt.grad is not None and all(p.grad is not None for p in m.parameters())
    m.double()
    assert m(src.double(), tgt.double()).dtype == np.float64


def test_d_model_not_divisible_by_nhead():
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by nhead=3.*\[1, 2, 5, 10\]"):
        nn.Transformer(d_model=10, nhead=3)
    with pytest.raises(ValueError, match="d_model=6 is not divisible by nhead=4"):
        nn.TransformerEncoderLayer(6, 4)


def test_argument_errors(rng):
    m = small_transformer()
    src = Tensor(np.zeros((B, S, D), dtype="float32"))
    tgt = Tensor(np.zeros((B, T, D), dtype="float32"))
    with pytest.raises(ValueError, match=r"batch sizes of src \(2\) and tgt \(3\)"):
        m(src, Tensor(np.zeros((3, T, D), dtype="float32")))
    with pytest.raises(ValueError, match=r"src must be \(batch, seq, d_model=8\), got shape \(2, 5, 6\)"):
        m(Tensor(np.zeros((B, S, 6), dtype="float32")), tgt)
    with pytest.raises(ValueError, match=r"tgt must be \(batch, seq, d_model=8\), got shape \(4, 8\)"):
        m(src, Tensor(np.zeros((T, D), dtype="float32")))
    with pytest.raises(ValueError, match=r"tgt_mask must have shape \(4, 4\)"):
        m(src, tgt, tgt_mask=np.zeros((S, S), dtype=bool))
    with pytest.raises(ValueError, match=r"memory_key_padding_mask must have shape \(batch, S\) = \(2, 5\)"):
        m(src, tgt, memory_key_padding_mask=np.zeros((B, T), dtype=bool))
    with pytest.raises(TypeError, match="src_key_padding_mask must be a bool or floating mask"):
        m(src, tgt, src_key_padding_mask=np.zeros((B, S), dtype=np.int32))
    with pytest.raises(ValueError, match="activation"):
        nn.TransformerEncoderLayer(8, 2, activation="tanh")
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        nn.TransformerEncoder(nn.Linear(2, 2), 2)


def test_encoder_position_ids_need_rope(rng):
    """position_ids are RoPE's positions: a stack without RoPE refuses them instead of ignoring them."""
    x = Tensor(rng.standard_normal((1, 3, 8)).astype(np.float32))
    plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0), 1)
    with pytest.raises(ValueError, match="TransformerEncoder: position_ids are RoPE's positions"):
        plain(x, position_ids=[[0, 1, 0]])
    rope = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, rotary=True), 1)
    assert not np.allclose(rope(x, position_ids=[[0, 1, 0]]).numpy(), rope(x).numpy())
    np.testing.assert_allclose(rope(x, position_ids=[[5, 6, 7]]).numpy(), rope(x).numpy(), atol=1e-5)
