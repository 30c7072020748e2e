"""Hugging Face Llama, Qwen2 and Mistral against npformer's Llama-style CausalLM, on random
tiny models built from configs in code (nothing downloaded).

- The mapping alone (no npformer model built): config_from_hf of each family, the key table on
  a stand-in model holding the Llama-style CausalLM's shapes (written out in this file) (every key used once, q/k/v stacked as
  ((H + 2 H_kv) head_dim, E), back to transformers' state dict bit for bit), hf_config read
  back by transformers' config classes, and every option npformer does not compute refused by
  name.
- End to end (npformer's CausalLM built): logits and every gradient within 1e-10 relative in
  float64 and 1e-5 in float32 of transformers' (SDPA attention: transformers' eager attention
  takes its softmax in float32 even in a float64 model); greedy generation token for token;
  save_pretrained -> transformers' from_pretrained, and transformers' save_pretrained ->
  load_pretrained; round trips bit for bit.

transformers' LlamaRMSNorm (Qwen2's, Mistral's) computes in float32 and its rotary embedding
computes cos/sin in float32 whatever the model's dtype. In float64 the comparison gives
transformers the same two forwards in the input dtype (`float64_shim`, the same formulas
without the casts); in float32 transformers runs as it is.
"""
import json
import math
import types

import numpy as np
import pytest

from autograd import Tensor
from npformer import decoding, interop, models
from npformer.models import huggingface, load_pretrained, save_pretrained

from helpers import randomised

TOLERANCE = {"float32": 1e-5, "float64": 1e-10}
SMALL = dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
# family, options: grouped-query (2 kv heads of 4), multi-query with tied embeddings and linear rotary scaling,
# Llama 3.1's rotary scaling (head_dim 4: one frequency between its two wavelength bounds, one above),
# Qwen2's q/k/v biases (full attention, and every layer sliding), Mistral's window of 3 < the sequences' 9
VARIANTS = {
    "llama": ("llama", {}),
    "llama-mqa-tied-linear": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 500.0})),
    "llama3-rope": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16})),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=0)),
    "mistral": ("mistral", dict(sliding_window=3)),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}


def hf_settings(transformers, variant, **options):
    family, extra = VARIANTS[variant]
    return getattr(transformers, CLASSES[family][0])(**{**SMALL, **extra, **options})


def hf_model_of(torch, transformers, variant, dtype, **options):
    """A random transformers model of `variant` in `dtype`, eval mode, SDPA attention, every
    parameter moved off its initial value (RMSNorm weights start at one, Qwen2's biases at zero)."""
    settings = hf_settings(transformers, variant, **options)
    settings._attn_implementation = "sdpa"
    model = getattr(transformers, CLASSES[VARIANTS[variant][0]][1])(settings)
    return randomised(torch, model, dtype)


def float64_shim(torch, hf_model):
    """Give transformers' RMSNorm and rotary embedding forwards in the input dtype.

    transformers' LlamaRMSNorm casts its input to float32 and its rotary embedding computes
    the angles, cos and sin in float32, so a float64 transformers model is float32 in those
    two places (~1e-7 relative). These replacements are the same formulas without the casts:
    weight * (x * rsqrt(mean(x^2) + eps)), and cos/sin of position * inv_freq with
    inv_freq = 1 / theta^(2i / head_dim) (scaled as transformers scales it for rope_type "linear"
    and "llama3"),
    computed in float64 and cast to the input's dtype."""
    def rms_norm(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        c = self.config
        rope = c.rope_parameters
        dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        assert rope["rope_type"] in ("default", "linear", "llama3")
        if rope["rope_type"] == "linear":
            inv_freq = inv_freq / rope["factor"]
        elif rope["rope_type"] == "llama3":  # transformers' _compute_llama3_parameters, in float64
            factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
            context = rope["original_max_position_embeddings"]
            wavelength = 2 * math.pi / inv_freq
            scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
            smooth = (context / wavelength - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            middle = ~(wavelength < context / high) * ~(wavelength > context / low)
            inv_freq = torch.where(middle, smoothed, scaled)
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    replaced = 0
    for module in hf_model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward, replaced = types.MethodType(rms_norm, module), replaced + 1
        elif name.endswith("RotaryEmbedding"):
            module.forward, replaced = types.MethodType(rotary, module), replaced + 1
    assert replaced == 2 * hf_model.config.num_hidden_layers + 2  # every norm and the one rotary embedding
    return hf_model


def converted(torch, transformers, variant, dtype, **options):
    """(transformers model, npformer model from from_hf), the float64 shim applied in float64."""
    hf_model = hf_model_of(torch, transformers, variant, dtype, **options)
    if dtype == "float64":
        float64_shim(torch, hf_model)
    return hf_model, interop.from_hf(hf_model)


def assert_close(ours, theirs, tolerance, what):
    """max |ours - theirs| <= tolerance * max |theirs| (relative to the magnitude involved)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs {theirs.shape}"
    error, scale = np.abs(ours - theirs).max(), np.abs(theirs).max()
    assert error <= tolerance * scale, f"{what}: max |difference| {error:.3g} > {tolerance} * {scale:.3g}"


def batch(rng, lengths, width, vocab=61):
    """(ids (B, width) in [1, vocab) right-padded with 0, attention mask (B, width), 1 = token)."""
    ids = rng.integers(1, vocab, size=(len(lengths), width))
    attention = np.arange(width)[None, :] < np.array(lengths)[:, None]
    return np.where(attention, ids, 0), attention.astype(np.int64)


# -- the mapping alone: configs and the key table on dicts -------------------------------------------
def llama_style_shapes(config):
    """{key: shape} of a Llama-style CausalLM's state_dict, written out from the key table of docs/huggingface.md."""
    E, V, F = config["d_model"], config["vocab_size"], config["dim_feedforward"]
    H, H_kv = config["nhead"], config["num_kv_heads"]
    rows = (H + 2 * H_kv) * (E // H)
    shapes = {"tok_embed.weight": (V, E)}
    for i in range(config["num_layers"]):
        p = f"encoder.layers.{i}."
        shapes[p + "self_attn.in_proj_weight"] = (rows, E)
        if config["qkv_bias"]:
            shapes[p + "self_attn.in_proj_bias"] = (rows,)
        shapes.update({p + "self_attn.out_proj.weight": (E, E), p + "linear1.weight": (F, E),
                       p + "linear3.weight": (F, E), p + "linear2.weight": (E, F), p + "norm1.weight": (E,),
                       p + "norm2.weight": (E,)})
    shapes["encoder.norm.weight"] = (E,)
    if not config["tie_weights"]:
        shapes["lm_head.weight"] = (V, E)
    return shapes


class CausalLM:
    """A stand-in for npformer's CausalLM with llama_style_shapes' state_dict: the mapping reads
    only a model's class name, config and state_dict, so the key table is tested without the model."""

    def __init__(self, config, state=None):
        self.config, self.state = config, state

    def state_dict(self):
        return dict(self.state or {key: np.zeros(shape) for key, shape in llama_style_shapes(self.config).items()})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_configs_map_to_causal_lm_options(variant, transformers):
    family, _ = VARIANTS[variant]
    name, config = huggingface.config_from_hf(hf_settings(transformers, variant).to_dict())
    assert name == "CausalLM"
    expected = dict(vocab_size=61, d_model=16, nhead=4, num_layers=2, dim_feedforward=24, dropout=0.0, max_len=32,
                    norm_first=True, activation="swiglu", positional="rope", tie_weights=False, pad_idx=None,
                    layer_norm_eps=1e-6, attention_dropout=0.0, activation_dropout=0.0, bias=False, norm="rmsnorm",
                    num_kv_heads=2, sliding_window=None, qkv_bias=None, rotary_base=10000.0, rope_scaling=None)
    expected.update({"llama-mqa-tied-linear": dict(num_kv_heads=1, tie_weights=True, rotary_base=500.0,
                                                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
                     "llama3-rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16}),
                     "qwen2": dict(qkv_bias=True), "qwen2-sliding": dict(qkv_bias=True, sliding_window=3),
                     "mistral": dict(sliding_window=3)}.get(variant, {}))
    assert config == expected


def test_old_config_files_rope_theta_and_rope_scaling_are_read():
    """config.json files written before transformers 5 hold rope_theta and rope_scaling at the top
    level ("type" for "rope_type" in older ones still); both spellings are read, and must agree."""
    old = dict(model_type="llama", vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=4, rope_theta=500000.0, rope_scaling=None)
    assert huggingface.config_from_hf(old)[1]["rotary_base"] == 500000.0
    assert huggingface.config_from_hf(old)[1]["num_kv_heads"] == 4  # Llama's default: one kv head per head
    for scaling in ({"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4}):
        config = huggingface.config_from_hf({**old, "rope_scaling": scaling})[1]
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0} and config["rotary_base"] == 500000.0
    both = {**old, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert huggingface.config_from_hf(both)[1]["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match=r"factor=2\.0 \(rope_scaling\) contradicts factor=4\.0 \(rope_parameters\)"):
        huggingface.config_from_hf({**both, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    # Mistral's and Qwen2's own defaults for fields a config.json omits
    mistral = {**old, "model_type": "mistral", "hidden_size": 32, "num_attention_heads": 8}
    assert huggingface.config_from_hf(mistral)[1]["num_kv_heads"] == 8
    assert huggingface.config_from_hf(mistral)[1]["sliding_window"] == 4096
    qwen2 = {**old, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False,
             "max_window_layers": 28}
    assert huggingface.config_from_hf(qwen2)[1]["sliding_window"] is None  # a window only with use_sliding_window


REFUSED = [
    ("llama", dict(hidden_act="gelu"), r"Llama config: hidden_act='gelu' has no npformer counterpart"),
    ("mistral", dict(hidden_act="relu"), r"Mistral config: hidden_act='relu'"),
    ("llama", dict(head_dim=8), r"Llama config: head_dim=8 is not hidden_size / num_attention_heads = 16 / 4"),
    ("mistral", dict(head_dim=2), r"Mistral config: head_dim=2"),
    ("llama", dict(attention_bias=True), r"Llama config: attention_bias=True is not supported"),
    ("llama", dict(mlp_bias=True), r"Llama config: mlp_bias=True is not supported"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                    "original_max_position_embeddings": 16}),
     r"Llama config: rope_type='yarn' \(rope_parameters\) is not supported"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     r"rope_type='dynamic'"),
    ("llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.0],
                                    "long_factor": [1.0, 1.0], "original_max_position_embeddings": 16}),
     r"rope_type='longrope'"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
     r"Qwen2 config: layer_types=\['full_attention', 'sliding_attention'\] gives some layers a sliding window of 3"),
]


@pytest.mark.parametrize("family, options, message", REFUSED, ids=[m[:30] for _, _, m in REFUSED])
def test_unsupported_options_are_refused_by_name(family, options, message, transformers):
    settings = getattr(transformers, CLASSES[family][0])(**{**SMALL, **options})
    with pytest.raises(ValueError, match=message):
        huggingface.config_from_hf(settings.to_dict())


def test_unsupported_entries_of_config_files_are_refused_by_name():
    base = dict(model_type="llama", vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4)
    for options, message in (
            (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_type='dynamic' \(rope_scaling\)"),
            (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}),
             r"factor=2\.0 \(rope_parameters\) is not supported with rope_type='default'"),
            (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "low_freq_factor": 1.0}),
             r"low_freq_factor=1\.0 \(rope_parameters\) is not supported with rope_type='linear'"),
            (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), r"rope_type='linear' needs factor"),
            (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
             r"partial_rotary_factor=0\.5 is not supported"),
            (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5"),
            (dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
             r"rope_theta=10000\.0 \(config\) contradicts rope_theta=500000\.0 \(rope_parameters\)"),
            (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
             r"rope_parameters per layer type \(\['full_attention'\]\) is not supported"),
            (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                  rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_type='linear' contradicts type='dynamic'"),
            (dict(tie_word_embeddings="false"), r"Llama config: tie_word_embeddings must be true or false"),
            (dict(model_type="mistral", sliding_window=0), r"Mistral config: sliding_window must be a positive"),
            (dict(model_type="mistral", sliding_window=4, layer_types=["full_attention"] * 2),
             r"Mistral config: layer_types=\['full_attention', 'full_attention'\] disagrees with sliding_window=4"),
            (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
             r"use_sliding_window=True, max_window_layers=1 gives some layers a sliding window of 4")):
        with pytest.raises(ValueError, match=message):
            huggingface.config_from_hf({**base, **options})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_key_table_maps_every_weight_once(variant, torch, transformers):
    """On the stand-in model: state_dict_from_hf uses every key of transformers' state dict once,
    stacks q; k; v (and Qwen2's biases) into in_proj with no permutation of the rotary halves, and
    hf_state_dict gives transformers' state dict back bit for bit (a tied lm_head stored once)."""
    hf_model = hf_model_of(torch, transformers, variant, "float64")
    tensors = {key: t.numpy() for key, t in hf_model.state_dict().items()}
    _, config = huggingface.config_from_hf(hf_model.config.to_dict())
    stand_in = CausalLM(config)
    state, skipped = huggingface.state_dict_from_hf(stand_in, tensors)
    assert skipped == [] and {k: v.shape for k, v in state.items()} == llama_style_shapes(config)
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        q, k, v = (tensors[f"{p}{n}_proj.weight"] for n in "qkv")
        assert q.shape[0] == 16 and k.shape[0] == v.shape[0] == 4 * config["num_kv_heads"]
        np.testing.assert_array_equal(state[f"encoder.layers.{i}.self_attn.in_proj_weight"], np.concatenate([q, k, v]))
        if config["qkv_bias"]:
            np.testing.assert_array_equal(state[f"encoder.layers.{i}.self_attn.in_proj_bias"],
                                          np.concatenate([tensors[f"{p}{n}_proj.bias"] for n in "qkv"]))
        np.testing.assert_array_equal(state[f"encoder.layers.{i}.linear3.weight"],
                                      tensors[f"model.layers.{i}.mlp.up_proj.weight"])
    back = huggingface.hf_state_dict(CausalLM(config, state))
    tied = {"lm_head.weight"} if config["tie_weights"] else set()
    assert set(back) == set(tensors) - tied
    for key, value in back.items():
        np.testing.assert_array_equal(value, tensors[key], err_msg=key)
    # unprefixed keys (a LlamaModel's) and old files' rotary inv_freq buffers read the same
    bare = {key.removeprefix("model."): value for key, value in tensors.items()}
    bare["layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2)
    again, _ = huggingface.state_dict_from_hf(stand_in, bare)
    assert all(np.array_equal(again[key], state[key]) for key in state)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_config_is_read_by_transformers(variant, transformers):
    """hf_config of a Llama-style model: the family (Qwen2 for qkv_bias, Mistral for a sliding
    window), a config.json that transformers' config class takes with the same numbers, and back."""
    family, _ = VARIANTS[variant]
    _, config = huggingface.config_from_hf(hf_settings(transformers, variant).to_dict())
    exported = huggingface.hf_config(CausalLM(config))
    assert exported["model_type"] == family and exported["architectures"] == [CLASSES[family][1]]
    json.dumps(exported)
    settings = getattr(transformers, CLASSES[family][0]).from_dict(
        {k: v for k, v in exported.items() if k != "model_type"})
    original = hf_settings(transformers, variant)
    for option in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                   "rope_parameters", "sliding_window", "layer_types", "head_dim", "attention_bias", "mlp_bias"):
        assert getattr(settings, option, None) == getattr(original, option, None), option
    assert huggingface.config_from_hf(settings.to_dict())[1] == config
    assert huggingface.config_from_hf(exported)[1] == config


def test_hf_config_refuses_what_the_families_cannot_express():
    llama = dict(vocab_size=61, d_model=16, nhead=4, num_layers=2, dim_feedforward=24, dropout=0.0, max_len=32,
                 norm_first=True, activation="swiglu", positional="rope", tie_weights=False, pad_idx=None,
                 layer_norm_eps=1e-6, attention_dropout=0.0, activation_dropout=0.0, bias=False, norm="rmsnorm",
                 num_kv_heads=2, sliding_window=None, qkv_bias=None, rotary_base=1e4, rope_scaling=None)
    for options, message in ((dict(norm="layernorm"), r"Llama \(LlamaForCausalLM\) needs CausalLM\(norm='rmsnorm'\)"),
                             (dict(activation="silu"), r"needs CausalLM\(activation='swiglu'\)"),
                             (dict(positional="learned"), r"needs CausalLM\(positional='rope'\)"),
                             (dict(bias=True), r"needs CausalLM\(bias=False\)"),
                             (dict(norm_first=False, sliding_window=4), r"Mistral \(MistralForCausalLM\) needs "
                                                                        r"CausalLM\(norm_first=True\)")):
        with pytest.raises(ValueError, match=message):
            huggingface.hf_config(CausalLM({**llama, **options}))
    gpt = dict(llama, norm="layernorm", activation="gelu", positional="learned", bias=True, num_kv_heads=None)
    for options, message in ((dict(bias=False), r"CausalLM\(bias=False\)"),
                             (dict(num_kv_heads=2), r"CausalLM\(num_kv_heads=2\)"),
                             (dict(sliding_window=8), r"CausalLM\(sliding_window=8\)"),
                             (dict(qkv_bias=False), r"CausalLM\(qkv_bias=False\)")):
        with pytest.raises(ValueError, match=message):
            huggingface.hf_config(CausalLM({**gpt, **options}))


# -- end to end: npformer's CausalLM against transformers ----------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_model_has_the_key_tables_shapes(variant, transformers):
    _, config = huggingface.config_from_hf(hf_settings(transformers, variant).to_dict())
    assert models.CausalLM.state_shapes(config) == llama_style_shapes(config)
    model = models.CausalLM(**config)
    assert {k: v.shape for k, v in model.state_dict().items()} == llama_style_shapes(config)
    assert {key: model.config[key] for key in config} == config


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_logits_match(variant, dtype, torch, transformers, rng):
    hf_model, ours = converted(torch, transformers, variant, dtype)
    assert isinstance(ours, models.CausalLM) and not ours.training
    assert ours.tok_embed.weight.dtype == np.dtype(dtype)
    ids, attention = batch(rng, [9, 6, 9], 9)
    want = hf_model(torch.tensor(ids), attention_mask=torch.tensor(attention)).logits.detach().numpy()
    got = ours(ids, key_padding_mask=attention == 0).numpy()
    assert_close(got, want, TOLERANCE[dtype], "logits")
    full = hf_model(torch.tensor(ids)).logits.detach().numpy()
    assert_close(ours(ids).numpy(), full, TOLERANCE[dtype], "logits without a mask")
    if ours.config["sliding_window"] is not None:  # the window (3 of 9 positions) changes the numbers
        unbounded = models.CausalLM(**{**ours.config, "sliding_window": None}).to(dtype=dtype).eval()
        unbounded.load_state_dict(ours.state_dict())
        assert np.abs(unbounded(ids).numpy() - full).max() > 1e3 * TOLERANCE[dtype] * np.abs(full).max()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_gradient_matches(variant, dtype, torch, transformers, rng):
    hf_model, ours = converted(torch, transformers, variant, dtype)
    ids, attention = batch(rng, [9, 7], 9)
    upstream = rng.standard_normal((2, 9, 61)).astype(dtype)
    logits = hf_model(torch.tensor(ids), attention_mask=torch.tensor(attention)).logits
    (logits * torch.tensor(upstream)).sum().backward()
    (ours(ids, key_padding_mask=attention == 0) * Tensor(upstream)).sum().backward()
    grads = {name: p.grad.numpy() for name, p in hf_model.named_parameters()}
    theirs, _ = huggingface.state_dict_from_hf(ours, grads)
    named = dict(ours.named_parameters())
    assert set(theirs) == set(named), "every parameter has a transformers gradient"
    for name, p in named.items():
        assert_close(p.grad, theirs[name], TOLERANCE[dtype], f"gradient of {name}")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_generation_matches(variant, dtype, torch, transformers, rng):
    """10 new tokens after 6 (16 positions: Mistral's window of 3 bounds the cache many times over)."""
    hf_model, ours = converted(torch, transformers, variant, dtype)
    ids = rng.integers(1, 61, size=(2, 6))
    want = hf_model.generate(torch.tensor(ids), attention_mask=torch.ones(2, 6, dtype=torch.long), do_sample=False,
                             max_new_tokens=10, min_new_tokens=10, pad_token_id=0, eos_token_id=None).numpy()
    got = decoding.generate(ours, ids, 10, temperature=0.0)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(decoding.generate(ours, ids, 10, temperature=0.0, use_cache=False), want)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_round_trips_keep_every_number(variant, dtype, torch, transformers):
    hf_model = hf_model_of(torch, transformers, variant, dtype).train()
    ours = interop.from_hf(hf_model)
    assert ours.training
    back = interop.to_hf(ours)
    assert type(back) is type(hf_model) and back.training and back.dtype == hf_model.dtype
    theirs, again = hf_model.state_dict(), back.state_dict()
    assert list(theirs) == list(again)
    for key in theirs:
        assert torch.equal(theirs[key], again[key]), key
    ours_again = interop.from_hf(back)
    assert ours_again.config == ours.config
    for (key, a), (key_again, b) in zip(ours.state_dict().items(), ours_again.state_dict().items()):
        assert key == key_again
        np.testing.assert_array_equal(a, b, err_msg=key)
    if hf_model.config.tie_word_embeddings:
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_pretrained_is_read_by_transformers(variant, torch, transformers, rng, tmp_path):
    hf_model, ours = converted(torch, transformers, variant, "float64")
    save_pretrained(ours, tmp_path / "ours")
    family = VARIANTS[variant][0]
    loaded = getattr(transformers, CLASSES[family][1]).from_pretrained(tmp_path / "ours", attn_implementation="sdpa",
                                                                       dtype=torch.float64).eval()
    assert loaded.config.model_type == family
    for key, value in hf_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    float64_shim(torch, loaded)
    ids = rng.integers(0, 61, size=(2, 9))
    assert_close(ours(ids).numpy(), loaded(torch.tensor(ids)).logits.detach().numpy(), 1e-10, "logits")
    again = load_pretrained(tmp_path / "ours")
    assert again.config == ours.config and not again.training
    for key, value in ours.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[key], value, err_msg=key)
    # a single safetensors file: Hugging Face's names, the model rebuilt from its own metadata
    path = models.save_safetensors(ours, tmp_path / "lm.safetensors")
    rebuilt = models.load_safetensors(path)
    assert rebuilt.config == ours.config
    for key, value in ours.state_dict().items():
        np.testing.assert_array_equal(rebuilt.state_dict()[key], value, err_msg=key)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_load_pretrained_reads_a_transformers_folder(variant, dtype, torch, transformers, rng, tmp_path):
    hf_model = hf_model_of(torch, transformers, variant, dtype)
    hf_model.save_pretrained(tmp_path / "theirs")
    ours = load_pretrained(tmp_path / "theirs")
    assert isinstance(ours, models.CausalLM) and not ours.training
    assert ours.tok_embed.weight.dtype == np.dtype(dtype)
    reference = interop.from_hf(hf_model)
    assert ours.config == reference.config
    for key, value in reference.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[key], value, err_msg=key)
    if dtype == "float64":
        float64_shim(torch, hf_model)
    ids = rng.integers(0, 61, size=(2, 9))
    assert_close(ours(ids).numpy(), hf_model(torch.tensor(ids)).logits.detach().numpy(), TOLERANCE[dtype], "logits")


def test_load_pretrained_refuses_an_unsupported_config_by_name(torch, transformers, tmp_path):
    hf_model = hf_model_of(torch, transformers, "llama", "float32")
    hf_model.save_pretrained(tmp_path / "theirs")
    path = tmp_path / "theirs" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                              "rope_theta": 10000.0}}))
    with pytest.raises(ValueError, match=r"config\.json: Llama config: rope_type='dynamic'"):
        load_pretrained(tmp_path / "theirs")
    path.write_text(json.dumps({**config, "num_hidden_layers": 100000}))
    with pytest.raises(ValueError, match=r"num_layers=100000 layers, but the file holds"):
        load_pretrained(tmp_path / "theirs")
    path.write_text(json.dumps(config))
    weights = dict(hf_model.state_dict())
    weights["model.layers.1.self_attn.key.weight"] = weights.pop("model.layers.1.self_attn.k_proj.weight")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({k: v.contiguous() for k, v in weights.items()},
                                str(tmp_path / "theirs" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing key 'model\.layers\.1\.self_attn\.k_proj\.weight' \(npformer's "
                                         r"encoder\.layers\.1\.self_attn\.in_proj_weight\)"):
        load_pretrained(tmp_path / "theirs")


def test_load_pretrained_reads_a_bfloat16_download_as_float32(torch, transformers, rng, tmp_path):
    """Most Llama-family downloads are bfloat16, which NumPy cannot hold: each weight is widened
    exactly to float32 (a bfloat16 is the upper half of a float32), so npformer holds the very
    numbers of the file, and its logits match transformers' model of those numbers in float32."""
    hf_model = hf_model_of(torch, transformers, "llama", "float32").to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path / "theirs")
    ours = load_pretrained(tmp_path / "theirs")
    assert ours.tok_embed.weight.dtype == np.float32
    widened = hf_model.float()  # the same bfloat16 values, exactly, as float32
    reference = interop.from_hf(widened)
    for key, value in reference.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[key], value, err_msg=key)
    ids = rng.integers(0, 61, size=(2, 9))
    assert_close(ours(ids).numpy(), widened(torch.tensor(ids)).logits.detach().numpy(), TOLERANCE["float32"], "logits")
