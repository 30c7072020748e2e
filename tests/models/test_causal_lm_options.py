"""CausalLM's layer options (issue 42): bias, norm, num_kv_heads, sliding_window, qkv_bias,
rotary_base, rope_scaling, residual_init and the silu/swiglu activations, each recorded in
model.config so that state_shapes, checkpoints (load_model), safetensors and CausalLM(**config)
round-trip it exactly; to_torch converts what torch.nn's layers express and refuses the rest by
name; save_pretrained / hf_config refuse what GPT-2 cannot express with a ValueError naming it;
the scaled residual init; rope scaling against transformers; nanoGPT's parameter groups."""
import math

import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor
from npformer import interop, optim
from npformer.models import CausalLM, load_safetensors, save_pretrained, save_safetensors
from npformer.models.huggingface import hf_config

SMALL = dict(d_model=16, nhead=4, num_layers=2, dim_feedforward=24, dropout=0.0, max_len=12)
LINEAR = {"rope_type": "linear", "factor": 2.0}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
LLAMA_STYLE = dict(norm="rmsnorm", activation="swiglu", positional="rope", bias=False, tie_weights=False,
                   num_kv_heads=2)
OPTIONS = {  # name: options
    "bias-free": dict(bias=False),
    "bias-free tied": dict(bias=False, tie_weights=True),
    "gpt2 init": dict(residual_init="gpt2"),
    "rope base": dict(positional="rope", rotary_base=500.0),
    "rope linear": dict(positional="rope", rope_scaling=LINEAR),
    "rope llama3": dict(positional="rope", rope_scaling=LLAMA3),
    "silu": dict(activation="silu"),
    "swiglu": dict(activation="swiglu"),
    "rmsnorm": dict(norm="rmsnorm"),
    "gqa": dict(num_kv_heads=2),
    "mqa bias-free": dict(num_kv_heads=1, bias=False),
    "sliding window": dict(sliding_window=3),
    "qkv bias": dict(bias=False, qkv_bias=True),
    "llama": LLAMA_STYLE,
    "qwen2": dict(LLAMA_STYLE, qkv_bias=True),
    "mistral": dict(LLAMA_STYLE, sliding_window=4),
}


def model_of(options, seed=0):
    npformer.manual_seed(seed)
    return CausalLM(31, **SMALL, **options).double().eval()


def ids_of(rng, batch=2, length=9):
    return rng.integers(0, 31, size=(batch, length))


@pytest.mark.parametrize("name", OPTIONS)
def test_every_option_is_recorded_and_round_trips(name, tmp_path, rng):
    model = model_of(OPTIONS[name])
    for option, value in OPTIONS[name].items():
        assert model.config[option] == value
    state = model.state_dict()
    assert CausalLM.state_shapes(model.config) == {k: v.shape for k, v in state.items()}
    ids = ids_of(rng)
    want = model(ids).numpy()
    rebuilt = CausalLM(**model.config).double().eval()
    assert list(rebuilt.state_dict()) == list(state)
    rebuilt.load_state_dict(state)
    np.testing.assert_array_equal(rebuilt(ids).numpy(), want)

    loaded, _ = npformer.load_model(npformer.save_checkpoint(tmp_path / "ck.npz", model))
    assert loaded.config == model.config
    np.testing.assert_array_equal(loaded(ids).numpy(), want)
    stored = load_safetensors(save_safetensors(model, tmp_path / "model.safetensors"))
    assert stored.config == model.config
    np.testing.assert_array_equal(stored(ids).numpy(), want)


def test_the_options_shape_the_state_dict():
    shapes = CausalLM.state_shapes(model_of(OPTIONS["qwen2"]).config)
    hd = 16 // 4
    assert shapes["encoder.layers.0.self_attn.in_proj_weight"] == ((4 + 2 * 2) * hd, 16)
    assert shapes["encoder.layers.0.self_attn.in_proj_bias"] == ((4 + 2 * 2) * hd,)
    assert shapes["encoder.layers.0.linear3.weight"] == (24, 16)
    assert "encoder.layers.0.self_attn.out_proj.bias" not in shapes and "encoder.norm.bias" not in shapes
    assert [k for k in shapes if "norm" in k] == ["encoder.layers.0.norm1.weight", "encoder.layers.0.norm2.weight",
                                                  "encoder.layers.1.norm1.weight", "encoder.layers.1.norm2.weight",
                                                  "encoder.norm.weight"]
    assert not any(k.endswith("bias") for k in CausalLM.state_shapes(model_of(dict(bias=False)).config))


def test_configs_without_the_new_options_still_load():
    """Configs stored before these options existed (checkpoints, safetensors) lack their keys."""
    model = model_of({})
    old = {k: v for k, v in model.config.items() if k not in ("bias", "norm", "num_kv_heads", "sliding_window",
                                                                "qkv_bias", "rotary_base", "rope_scaling",
                                                                "residual_init")}
    assert CausalLM.state_shapes(old) == {k: v.shape for k, v in model.state_dict().items()}
    assert CausalLM(**old).config == model.config


@pytest.mark.parametrize("options, error, message", [
    (dict(bias="no"), TypeError, "CausalLM: bias must be True or False"),
    (dict(qkv_bias=1), TypeError, "CausalLM: qkv_bias"),
    (dict(norm="batchnorm"), ValueError, r"CausalLM: norm must be one of \('layernorm', 'rmsnorm'\)"),
    (dict(num_kv_heads=3), ValueError, "CausalLM: nhead=4 is not divisible by num_kv_heads=3"),
    (dict(num_kv_heads=0), ValueError, "CausalLM: num_kv_heads must be an integer >= 1"),
    (dict(sliding_window=0), ValueError, "CausalLM: sliding_window must be an integer >= 1"),
    (dict(residual_init="xavier"), ValueError, r"CausalLM: residual_init must be one of \('normal', 'gpt2'\)"),
    (dict(activation="tanh"), ValueError, "CausalLM: activation must be one of"),
    (dict(rope_scaling=LINEAR), ValueError, r"rope_scaling=.* only acts on rotary positions, but "
                                            r"positional='learned'"),
    (dict(rotary_base=10.0), ValueError, "rotary_base=10.0 only acts on rotary positions"),
    (dict(positional="rope", rope_scaling={"rope_type": "yarn", "factor": 2.0}), ValueError,
     r"rope_scaling rope_type 'yarn' is not supported \(supported: \['linear', 'llama3'\]\)"),
    (dict(positional="rope", rope_scaling={"type": "linear", "factor": 2.0}), ValueError, "rope_type None"),
    (dict(positional="rope", rope_scaling={**LINEAR, "original_max_position_embeddings": 8}), ValueError,
     r"unknown \['original_max_position_embeddings'\]"),
    (dict(positional="rope", rope_scaling={"rope_type": "llama3", "factor": 8.0}), ValueError,
     r"missing \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]"),
    (dict(positional="rope", rope_scaling={"rope_type": "linear", "factor": -1.0}), ValueError,
     r"rope_scaling\['factor'\] must be"),
    (dict(positional="rope", rope_scaling=[("rope_type", "linear")]), TypeError, "rope_scaling must be None or a dict"),
])
def test_bad_options_are_refused_by_name(options, error, message):
    with pytest.raises(error, match=message):
        CausalLM(31, **SMALL, **options)


# -- GPT-2 and torch.nn: what they express converts, the rest is refused by name -----------------
@pytest.mark.parametrize("options, named", [
    (dict(bias=False), "bias=False"), (dict(norm="rmsnorm"), "norm='rmsnorm'"),
    (dict(activation="swiglu"), "activation"), (dict(activation="silu"), "activation"),
    (dict(num_kv_heads=2), "num_kv_heads=2"), (dict(sliding_window=3), "sliding_window=3"),
    (dict(bias=False, qkv_bias=True), "bias=False")])
def test_save_pretrained_refuses_what_gpt2_cannot_express(options, named, tmp_path):
    model = model_of(options)
    for attempt in (lambda: hf_config(model), lambda: save_pretrained(model, tmp_path / "gpt2")):
        with pytest.raises(ValueError, match=named):
            attempt()
    assert not (tmp_path / "gpt2").exists()


@pytest.mark.parametrize("options", [dict(bias=False), dict(bias=False, tie_weights=True), dict(activation="silu"),
                                     dict(residual_init="gpt2", positional="sinusoidal")])
def test_to_torch_converts_bias_free_and_silu_models(options, torch, rng):
    model = model_of(options).train()
    theirs = interop.to_torch(model)
    assert set(theirs.state_dict()) == set(model.state_dict())
    ids = ids_of(rng)
    g = rng.standard_normal((2, 9, 31))
    out, ref = model(ids), theirs(torch.tensor(ids))
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-10, atol=1e-12)
    (out * Tensor(g)).sum().backward()
    (ref * torch.tensor(g)).sum().backward()
    named = dict(theirs.named_parameters())
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), named[name].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    back = interop.from_torch(theirs)
    assert back.config == model.config


@pytest.mark.parametrize("options, named", [
    (dict(norm="rmsnorm"), "norm='rmsnorm'"), (dict(activation="swiglu"), "activation='swiglu'"),
    (dict(num_kv_heads=2), "num_kv_heads=2"), (dict(sliding_window=3), "sliding_window=3"),
    (dict(bias=False, qkv_bias=True), "qkv_bias=True"), (LLAMA_STYLE, "RoPE")])
def test_to_torch_refuses_what_torch_nn_cannot_express(options, named, torch):
    with pytest.raises(NotImplementedError, match=f"{named}.*interop.to_hf"):
        interop.to_torch(model_of(options))


# -- residual init ---------------------------------------------------------------------------------
def test_gpt2_residual_init_scales_the_residual_projections():
    npformer.manual_seed(0)
    model = CausalLM(64, d_model=64, nhead=4, num_layers=8, dim_feedforward=256, residual_init="gpt2")
    residual = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        std = float(p.numpy().std())
        if name.endswith(("self_attn.out_proj.weight", "linear2.weight")):
            assert abs(std - residual) < 0.1 * residual, name
        elif p.ndim == 2:
            assert abs(std - 0.02) < 0.1 * 0.02, name
    plain = CausalLM(64, d_model=64, nhead=4, num_layers=8, dim_feedforward=256)
    assert abs(float(plain.encoder.layers[0].linear2.weight.numpy().std()) - 0.02) < 0.002


# -- rope scaling ------------------------------------------------------------------------------------
def test_linear_rope_scaling_divides_the_positions(rng):
    cos, sin = F.rotary_cos_sin(12, 8, dtype="float64", scaling=LINEAR)
    half = F.rotary_cos_sin(24, 8, dtype="float64")  # position p / 2 of the plain table: row p for even p ...
    np.testing.assert_allclose(cos[::2][:6], half[0][:6], rtol=0, atol=1e-15)  # ... rows 0, 2, 4 = 0, 1, 2
    model, plain = model_of(dict(positional="rope", rope_scaling=LINEAR)), model_of(dict(positional="rope"))
    ids = ids_of(rng)
    assert not np.allclose(model(ids).numpy(), plain(ids).numpy())
    # the cached path (offsets) and position_ids both use the scaled tables
    cache = model.init_cache()
    model.decode_step(ids[:, :5], cache)
    step = model.decode_step(ids[:, 5:6], cache).numpy()
    np.testing.assert_allclose(step, model(ids[:, :6]).numpy()[:, -1], rtol=1e-12, atol=1e-13)
    positions = np.tile(np.arange(9), (2, 1))
    np.testing.assert_allclose(model(ids, position_ids=positions).numpy(), model(ids).numpy(), rtol=1e-12, atol=1e-13)


def test_llama3_rope_scaling_matches_transformers(transformers, torch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
                                      rope_parameters={**LLAMA3, "rope_theta": 10000.0})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")   # (hd/2,) float32
    from npformer.functional.rotary.math import inverse_frequencies
    got = inverse_frequencies(np, 32, 10000.0, F.rotary.check_rope_scaling(LLAMA3, "test"))
    assert (got != 10000.0 ** (-np.arange(0, 32, 2) / 32)).any()  # some frequencies scaled, ...
    np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-6)  # transformers computes in float32


# -- nanoGPT's parameter groups ----------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(tie_weights=True), dict(tie_weights=False, bias=False)])
def test_weight_decay_groups_decay_the_matrices_only(options):
    model = model_of(options)
    decay, rest = optim.weight_decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    named = dict(model.named_parameters())
    assert [id(p) for p in decay["params"]] == [id(p) for p in named.values() if p.ndim >= 2]
    assert [id(p) for p in rest["params"]] == [id(p) for p in named.values() if p.ndim < 2]
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))  # the tied weight once
    assert all(p.ndim == 1 for p in rest["params"]) and "tok_embed.weight" in named
    optimizer = optim.AdamW(optim.weight_decay_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_weight_decay_groups_leave_out_frozen_parameters_and_check_arguments():
    model = model_of(dict(bias=False))
    model.tok_embed.weight.requires_grad = False
    decay, _ = optim.weight_decay_groups(model, 0.0)
    assert all(p is not model.tok_embed.weight for p in decay["params"])
    with pytest.raises(ValueError, match="weight_decay_groups: weight_decay must be"):
        optim.weight_decay_groups(model, -0.1)
    with pytest.raises(TypeError, match="expected a module with named_parameters"):
        optim.weight_decay_groups([model.tok_embed.weight], 0.1)


@pytest.mark.parametrize("name", ["llama", "mistral", "gqa", "rope linear"])
def test_generation_with_the_options_equals_the_uncached_loop(name):
    """Greedy generation on the KV cache (grouped-query heads, a cache bounded by the sliding
    window, scaled rotary tables) gives the tokens of the whole prefix re-run at every step, past
    max_len (rotary positions are not cropped; learned ones see the last max_len tokens)."""
    from npformer.decoding import generate
    model = model_of(OPTIONS[name])
    prompt = np.array([[3, 1, 4, 1, 5, 9, 2]])
    cached = generate(model, prompt, 16, temperature=0.0)            # 23 tokens, max_len 12
    np.testing.assert_array_equal(cached, generate(model, prompt, 16, temperature=0.0, use_cache=False))
    ids = prompt
    with npformer.no_grad():
        for _ in range(16):
            context = ids if model.config["positional"] == "rope" else ids[:, -12:]
            ids = np.append(ids, [[int(model(context).numpy()[0, -1].argmax())]], axis=1)
    np.testing.assert_array_equal(cached, ids)
