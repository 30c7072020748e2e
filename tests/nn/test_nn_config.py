"""nn.TransformerConfig: checked once (argument, expected, actual), to_dict / from_dict (strict),
passed whole from the top (nn.Transformer, the layers, the models) to every layer and attention
module, block_size reachable from the top, old config dicts still load; and the one internal mask
convention: every public mask convention gives the outputs of the equivalent internal mask."""
import dataclasses
import json

import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor
from npformer import load_checkpoint, models, nn, save_checkpoint
from npformer.models import load_safetensors, save_safetensors
from npformer.nn.attention import AttentionMask, attention_mask

from tolerances import assert_close

SMALL = dict(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16)


# -- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, error, match", [
    (dict(d_model=True), TypeError, r"TransformerConfig: d_model must be an integer >= 1, got True \(a bool"),
    (dict(d_model="8"), TypeError, r"TransformerConfig: d_model must be an integer >= 1, got '8' of type str"),
    (dict(d_model=10, nhead=4), ValueError, r"TransformerConfig: d_model=10 is not divisible by nhead=4"),
    (dict(num_decoder_layers=-1), ValueError, r"num_decoder_layers must be an integer >= 0, got -1"),
    (dict(dropout=1.5), ValueError, r"TransformerConfig: dropout must be a real number in \[0, 1\], got 1\.5"),
    (dict(attention_dropout=True), TypeError, r"attention_dropout must be a real number in \[0, 1\], got True"),
    (dict(layer_norm_eps=0.0), ValueError, r"layer_norm_eps must be a finite real number > 0, got 0\.0"),
    (dict(block_size=0), ValueError, r"TransformerConfig: block_size must be an integer >= 1, got 0"),
    (dict(block_size=2.0), TypeError, r"block_size must be an integer >= 1, got 2\.0 of type float"),
    (dict(norm_first=1), TypeError, r"TransformerConfig: norm_first must be True or False, got 1 of type int"),
    (dict(batch_first=False), ValueError, r"batch-first only"),
    (dict(activation="swish"), ValueError, r"activation must be one of \('relu', 'gelu', 'gelu_tanh', 'silu', "
                                           r"'swiglu'\) or a callable, got 'swish'"),
    (dict(attention_backend="fast"), ValueError, r"attention_backend must be None or one of .*got 'fast'"),
    (dict(device="tpu"), ValueError, r"device must be None or one of \('cpu', 'cuda', 'test'\), got 'tpu'"),
    (dict(dtype="int32"), TypeError, r"dtype must be a floating dtype or its name .*got 'int32'"),
])
def test_bad_settings_name_the_argument(settings, error, match):
    with pytest.raises(error, match=match):
        nn.TransformerConfig(**settings)


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers():
    config = nn.TransformerConfig(d_model=np.int64(8), nhead=np.int32(2), dropout=np.float32(0.25),
                                  norm_first=np.bool_(True), dtype=np.float64)
    assert (config.d_model, config.nhead, config.dropout, config.norm_first, config.dtype) == (8, 2, 0.25, True,
                                                                                                "float64")
    assert [type(v) for v in (config.d_model, config.dropout, config.norm_first)] == [int, float, bool]


def test_a_constructor_s_config_checked_once_equals_the_dataclass_s():
    """from_arguments checks the settings once (naming the arguments) and skips __post_init__'s check:
    it must store the same normalised values, of the same types, as TransformerConfig(...)."""
    settings = dict(d_model=np.int64(8), nhead=np.int32(2), dropout=np.float32(0.25), block_size=np.int16(4),
                    norm_first=np.bool_(True), dtype=np.float64)
    made = nn.TransformerConfig.from_arguments(None, "Owner", **settings)
    expected = nn.TransformerConfig(**settings)
    assert made == expected
    assert {k: type(v) for k, v in vars(made).items()} == {k: type(v) for k, v in vars(expected).items()}
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        nn.TransformerConfig.from_arguments(None, "Owner", d_model=8, heads=2)


def test_constructor_errors_name_the_constructor_and_its_arguments():
    with pytest.raises(ValueError, match=r"MultiheadAttention: block_size must be an integer >= 1, got 0"):
        nn.MultiheadAttention(8, 2, block_size=0)
    with pytest.raises(ValueError, match=r"MultiheadAttention: backend must be None or one of"):
        nn.MultiheadAttention(8, 2, backend="fast")
    with pytest.raises(ValueError, match=r"CausalLM: block_size must be an integer >= 1, got 0"):
        models.CausalLM(10, d_model=8, nhead=2, num_layers=1, block_size=0)
    with pytest.raises(TypeError, match=r"TransformerEncoderLayer: missing d_model, nhead"):
        nn.TransformerEncoderLayer()
    config = nn.TransformerConfig(**SMALL)
    with pytest.raises(TypeError, match=r"Transformer: pass the settings either in config= or as arguments.*"
                                        r"norm_first"):
        nn.Transformer(norm_first=True, config=config)
    with pytest.raises(TypeError, match=r"TransformerEncoderLayer: pass .*d_model"):
        nn.TransformerEncoderLayer(8, config=config)
    with pytest.raises(TypeError, match=r"MultiheadAttention: config must be a TransformerConfig, got dict"):
        nn.MultiheadAttention(config=dict(SMALL))


# -- to_dict / from_dict ------------------------------------------------------------------------
def test_to_dict_from_dict_round_trip_through_json():
    config = nn.TransformerConfig(**SMALL, dropout=0.2, attention_dropout=0.0, activation="gelu_tanh",
                                  norm_first=True, bias=False, rotary=True, memory_efficient=True, block_size=4,
                                  attention_backend="naive", dtype="float64")
    values = json.loads(json.dumps(config.to_dict()))
    assert nn.TransformerConfig.from_dict(values) == config
    assert nn.TransformerConfig.from_dict({}) == nn.TransformerConfig()
    assert config["block_size"] == 4 and dataclasses.replace(config, block_size=8).block_size == 8
    with pytest.raises(KeyError):
        config["n_embd"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8


@pytest.mark.parametrize("values, error, match", [
    ({"d_model": 8, "n_embd": 8}, ValueError, r"from_dict: unknown settings \['n_embd'\]"),
    ({"d_model": "8"}, TypeError, r"d_model must be an integer >= 1, got '8' of type str"),
    ({"dropout": None}, TypeError, r"dropout must be a real number in \[0, 1\], got None"),
    ({"activation": ["relu"]}, TypeError, r"from_dict: activation must be one of .*got \['relu'\] of type list"),
    ({"activation": "os.system"}, ValueError, r"activation must be one of .*got 'os\.system'"),
    ([("d_model", 8)], TypeError, r"from_dict: expected a dict, got list"),
])
def test_from_dict_is_strict(values, error, match):
    with pytest.raises(error, match=match):
        nn.TransformerConfig.from_dict(values)


def test_a_callable_activation_is_used_but_not_stored():
    config = nn.TransformerConfig(**SMALL, activation=F.relu)
    layer = nn.TransformerEncoderLayer(config=config)
    assert layer.activation is F.relu and layer.activation_name is None
    with pytest.raises(ValueError, match=r"to_dict: activation .* is a callable, which cannot be stored"):
        config.to_dict()


# -- passed whole from the top --------------------------------------------------------------------
def attention_modules(module):
    return [m for m in module.modules() if isinstance(m, nn.MultiheadAttention)]


def test_a_setting_given_at_the_top_reaches_every_layer_and_attention_module():
    config = nn.TransformerConfig(**SMALL, dropout=0.3, attention_dropout=0.1, activation_dropout=0.0,
                                  norm_first=True, bias=False, layer_norm_eps=1e-6, rotary=True,
                                  memory_efficient=True, block_size=3, attention_backend="memory_efficient")
    model = nn.Transformer(config=config)
    assert model.config is config and model.encoder.config is config and model.decoder.config is config
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    for layer in layers:
        assert layer.config is config and layer.self_attn.config is config and layer.norm_first
        assert (layer.dropout.p, layer.dropout1.p, layer.linear1.bias, layer.norm1.eps) == (0.0, 0.3, None, 1e-6)
        assert layer.self_attn.rotary
    for attn in attention_modules(model):
        assert attn.config.block_size == 3 and attn.config.memory_efficient and attn.backend == "memory_efficient"
        assert attn.dropout == 0.1 and attn.in_proj_bias is None
    cross = [layer.multihead_attn for layer in model.decoder.layers]
    assert all(not a.rotary and a.config == dataclasses.replace(config, rotary=False) for a in cross)


def test_device_and_dtype_from_the_top_reach_every_parameter():
    from autograd import backend
    model = nn.Transformer(config=nn.TransformerConfig(**SMALL, device="test", dtype=np.float64))
    assert model.config.dtype == "float64"
    assert {(backend.device_of(p.data), str(p.dtype)) for p in model.parameters()} == {("test", "float64")}


def test_the_torch_signatures_build_the_same_config():
    model = nn.Transformer(**SMALL, dropout=0.0, activation="gelu", norm_first=True, memory_efficient=True)
    expected = nn.TransformerConfig(**SMALL, dropout=0.0, activation="gelu", norm_first=True, memory_efficient=True)
    assert model.config == expected and model.config["activation"] == "gelu"
    assert all(a.config.memory_efficient for a in attention_modules(model))
    layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, "gelu", norm_first=True)
    assert layer.config == nn.TransformerConfig(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0,
                                                activation="gelu", norm_first=True)
    assert nn.TransformerEncoderLayer(config=layer.config).config is layer.config
    attn = nn.MultiheadAttention(8, 2, dropout=0.1, block_size=4)
    assert (attn.config.d_model, attn.config.nhead, attn.dropout, attn.config.block_size) == (8, 2, 0.1, 4)


def spy_attention(monkeypatch):
    """The keyword arguments of every F.scaled_dot_product_attention call."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("build, run", [
    (lambda **kw: nn.Transformer(**SMALL, **kw) if not kw else nn.Transformer(
        config=nn.TransformerConfig(**SMALL, **kw)),
     lambda m, rng: m(Tensor(rng.standard_normal((2, 5, 8))), Tensor(rng.standard_normal((2, 4, 8))))),
    (lambda **kw: models.CausalLM(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, **kw),
     lambda m, rng: m(rng.integers(0, 11, (2, 5)))),
    (lambda **kw: models.Seq2SeqTransformer(11, 12, **SMALL, **kw),
     lambda m, rng: m(rng.integers(0, 11, (2, 5)), rng.integers(0, 12, (2, 4)))),
    (lambda **kw: models.BidirectionalEncoder(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, **kw),
     lambda m, rng: m(rng.integers(0, 11, (2, 5)))[0]),
    (lambda **kw: models.EncoderClassifier(11, 3, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, **kw),
     lambda m, rng: m(rng.integers(0, 11, (2, 5)))),
], ids=["Transformer", "CausalLM", "Seq2SeqTransformer", "BidirectionalEncoder", "EncoderClassifier"])
def test_block_size_from_the_top_reaches_every_attention_call(build, run, monkeypatch, rng):
    """memory_efficient and block_size given at the top reach every attention call, and the
    outputs equal the default path's; the models' config dicts (what files store) do not change."""
    reference = build().double().eval()
    blockwise = build(memory_efficient=True, block_size=2).double().eval()
    blockwise.load_state_dict(reference.state_dict())
    assert getattr(blockwise, "config") == getattr(reference, "config") or isinstance(reference, nn.Transformer)
    want = run(reference, np.random.default_rng(0))
    calls = spy_attention(monkeypatch)
    got = run(blockwise, np.random.default_rng(0))
    assert calls and all(c["memory_efficient"] and c["block_size"] == 2 for c in calls)
    assert len(calls) == len(attention_modules(blockwise))
    assert_close(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-10 * max(1.0, np.abs(want.numpy()).max()))


# -- files: old config dicts still load ----------------------------------------------------------------
OLD_TRANSFORMER_CONFIG = dict(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
                              dropout=0.1, activation="relu", layer_norm_eps=1e-5, norm_first=False, bias=True,
                              rotary=False)  # nn.Transformer.config before TransformerConfig


def test_a_checkpoint_with_the_old_config_dict_loads(tmp_path):
    model = nn.Transformer(**SMALL)
    new_config = model.config
    model.config = dict(OLD_TRANSFORMER_CONFIG)  # written as before: the old dict
    path = save_checkpoint(tmp_path / "old.npz", model)
    model.config = new_config
    target = nn.Transformer(**SMALL, memory_efficient=True, block_size=4)  # runtime settings may differ
    ckpt = load_checkpoint(path, target)
    assert ckpt["config"] == OLD_TRANSFORMER_CONFIG
    for (key, a), (_, b) in zip(model.state_dict().items(), target.state_dict().items()):
        np.testing.assert_array_equal(a, b, err_msg=key)
    assert nn.TransformerConfig.from_dict(ckpt["config"]) == nn.TransformerConfig(**SMALL)
    with pytest.raises(ValueError, match=r"nhead: file 2, model 4"):
        load_checkpoint(path, nn.Transformer(**dict(SMALL, nhead=4)))


def test_files_store_the_config_as_a_dict(tmp_path):
    model = nn.Transformer(**SMALL, norm_first=True, memory_efficient=True)
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "new.npz", model), model)
    assert ckpt["config"]["norm_first"] is True and "memory_efficient" not in ckpt["config"]
    layer = nn.TransformerEncoderLayer(8, 2, 16, activation=F.relu)  # a callable: no config stored
    path = save_safetensors(layer, tmp_path / "layer.safetensors")
    other = nn.TransformerEncoderLayer(8, 2, 16, activation=F.relu)
    load_safetensors(path, other)
    np.testing.assert_array_equal(other.linear1.weight.numpy(), layer.linear1.weight.numpy())


# -- one internal mask convention ----------------------------------------------------------------------
B, T, S, E, H = 2, 4, 5, 8, 2


def public_masks(rng):
    """(blocked (B, H, T, S) bool, True = may not attend, every row keeps a key) and its public spellings."""
    attn = rng.random((T, S)) < 0.4
    padding = np.zeros((B, S), dtype=bool)
    padding[1, 3:] = True
    attn[:, 0] = False  # every query keeps key 0
    blocked = attn[None, None] | padding[:, None, None, :]
    as_float = lambda m: np.where(m, -np.inf, 0.0)  # noqa: E731
    per_head = np.repeat(attn[None], B * H, axis=0)
    spellings = {
        "bool": dict(attn_mask=attn, key_padding_mask=padding),
        "float": dict(attn_mask=as_float(attn), key_padding_mask=as_float(padding)),
        "bool attn, float padding": dict(attn_mask=attn, key_padding_mask=as_float(padding)),
        "per-head bool": dict(attn_mask=per_head, key_padding_mask=padding),
    }
    return np.broadcast_to(blocked, (B, H, T, S)), spellings


def test_each_public_mask_convention_gives_the_internal_mask_s_outputs(rng):
    attn = nn.MultiheadAttention(E, H).double()
    x = Tensor(rng.standard_normal((B, T, E)))
    memory = Tensor(rng.standard_normal((B, S, E)))
    blocked, spellings = public_masks(rng)
    want = attn.forward_masked(x, memory, memory, AttentionMask(~blocked))[0].numpy()
    direct = F.scaled_dot_product_attention(*attn.project_qkv(x, memory, memory), attn_mask=~blocked)
    assert_close(want, attn.out_proj(direct.transpose(1, 2).reshape(B, T, E)).numpy(), rtol=1e-12, atol=1e-12)
    for name, masks in spellings.items():
        got = attn(x, memory, memory, need_weights=False, **masks)[0].numpy()
        assert_close(got, want, rtol=1e-12, atol=1e-12, err_msg=name)
        converted = attention_mask(masks["attn_mask"], masks["key_padding_mask"], x.data, (B, H, T, S))
        assert isinstance(converted, AttentionMask) and not converted.is_causal
        if converted.mask.dtype == bool:
            np.testing.assert_array_equal(np.broadcast_to(converted.mask, blocked.shape), ~blocked, err_msg=name)
        else:
            np.testing.assert_array_equal(np.broadcast_to(converted.mask, blocked.shape) == 0, ~blocked, err_msg=name)


def test_is_causal_alone_stays_a_flag_and_equals_the_causal_mask(rng):
    attn = nn.MultiheadAttention(E, H).double()
    x = Tensor(rng.standard_normal((B, T, E)))
    assert attention_mask(None, None, x.data, (B, H, T, T), is_causal=True) == AttentionMask(None, True)
    causal = np.triu(np.ones((T, T), dtype=bool), 1)
    want = attn.forward_masked(x, x, x, AttentionMask(~causal[None, None]))[0].numpy()
    for masks in (dict(is_causal=True), dict(attn_mask=causal), dict(attn_mask=np.where(causal, -np.inf, 0.0))):
        assert_close(attn(x, x, x, need_weights=False, **masks)[0].numpy(), want, rtol=1e-12, atol=1e-12)


def test_layers_and_stacks_convert_their_masks_once_into_the_internal_convention(rng):
    model = nn.Transformer(**SMALL, dropout=0.0).double()
    src, tgt = Tensor(rng.standard_normal((B, S, 8))), Tensor(rng.standard_normal((B, T, 8)))
    padding = np.zeros((B, S), dtype=bool)
    padding[0, 4:] = True
    layer = model.encoder.layers[0]
    want = layer.forward_masked(src, AttentionMask(~padding[:, None, None, :])).numpy()
    assert_close(layer(src, src_key_padding_mask=padding).numpy(), want, rtol=1e-12, atol=1e-12)
    assert_close(layer(src, src_key_padding_mask=np.where(padding, -np.inf, 0.0)).numpy(), want,
                 rtol=1e-12, atol=1e-12)
    memory = model.encoder(src, src_key_padding_mask=padding)
    decoder_layer = model.decoder.layers[0]
    causal = np.triu(np.ones((T, T), dtype=bool), 1)
    want = decoder_layer.forward_masked(tgt, memory, AttentionMask(None, True),
                                        AttentionMask(~padding[:, None, None, :])).numpy()
    for masks in (dict(tgt_is_causal=True), dict(tgt_mask=causal), dict(tgt_mask=np.where(causal, -np.inf, 0.0))):
        got = decoder_layer(tgt, memory, memory_key_padding_mask=padding, **masks).numpy()
        assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_cache_keeps_its_padding_in_the_internal_convention(rng):
    cache = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 1).init_cache()
    like = rng.standard_normal((2, 3, 8))
    padding = np.array([[True, False, False], [False, False, False]])
    mask = cache.extend_padding(padding, 2, 3, like)
    np.testing.assert_array_equal(cache.attendable, ~padding)
    causal = np.tril(np.ones((3, 3), dtype=bool))
    np.testing.assert_array_equal(mask.mask, causal[None, None] & ~padding[:, None, None, :])
    assert not mask.is_causal


def test_a_gelu_tanh_layer_converts_to_torch_and_back(torch, rng):
    """activation="gelu_tanh" (a name now, run fused with linear1) is torch's GELU(approximate="tanh")."""
    from npformer import interop
    ours = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu_tanh").double()
    theirs = interop.to_torch(ours)
    assert isinstance(theirs.activation, torch.nn.GELU) and theirs.activation.approximate == "tanh"
    x = rng.standard_normal((2, 5, 8))
    want = theirs(torch.tensor(x)).detach().numpy()
    assert_close(ours(Tensor(x)).numpy(), want, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(want).max()))
    assert interop.from_torch(theirs).config == ours.config
