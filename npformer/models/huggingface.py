"""Hugging Face GPT-2, BERT, Llama, Qwen2 and Mistral in npformer's terms: configs and weight
names, as plain dicts.

- `config_from_hf(hf_config)`: a Hugging Face config (config.json, or `model.config.to_dict()`)
  -> (npformer model class name, its config): GPT-2 -> CausalLM, BERT -> BidirectionalEncoder
  (BertModel) or EncoderClassifier (BertForSequenceClassification), Llama, Qwen2 and Mistral
  (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) -> a Llama-style CausalLM
  (norm="rmsnorm", activation="swiglu", positional="rope", bias=False; num_kv_heads, Qwen2's
  qkv_bias=True, Mistral's sliding_window). Every option npformer does not compute is refused
  by name (ValueError), never ignored: another hidden_act, a head_dim other than
  hidden_size / num_attention_heads, Llama's attention_bias / mlp_bias, a rotary scaling other
  than "linear" and "llama3", per-layer sliding windows.
- `hf_config(model)`: the reverse, a config.json dict with "model_type" and "architectures"
  (a Llama-style CausalLM is Qwen2 when it has qkv_bias, Mistral when it has a sliding_window,
  else Llama).
- `state_dict_from_hf(model, tensors)`: a Hugging Face state dict ({name: array}, as in
  model.safetensors or `hf_model.state_dict()`) -> the model's state_dict; every weight mapped,
  an error naming the first missing, mis-shaped or unmapped key.
- `hf_state_dict(model)`: the model's weights under Hugging Face's names and layouts.

The mapping (one rule per npformer key; docs/huggingface.md has the table):
GPT-2's Conv1D stores weights (in, out), the transpose of a Linear's (out, in); BERT's
separate query/key/value Linears stack into MultiheadAttention's packed in_proj (3E, E), and
Llama's q/k/v_proj likewise into ((H + 2 H_kv) head_dim, E) (grouped-query attention: k and v
have H_kv heads). Llama's rotary layout is npformer's (half-split, transformers' rotate_half):
q_proj and k_proj need no permutation.
Causal-mask buffers of old GPT-2 files (h.{i}.attn.bias, masked_bias), BERT's position_ids
buffer and the rotary inv_freq buffers of old Llama files are not weights and are skipped;
BERT pretraining heads (cls.*) are returned as skipped.
No transformers or torch here: npformer.interop and npformer.models.pretrained use this.
"""
import re

from autograd import backend

GPT2_PREFIX, BERT_PREFIX, LLAMA_PREFIX = "transformer.", "bert.", "model."
# architecture -> (model_type, npformer class name, prefix of the base model's keys)
ARCHITECTURES = {
    "GPT2LMHeadModel": ("gpt2", "CausalLM", GPT2_PREFIX),
    "BertModel": ("bert", "BidirectionalEncoder", ""),
    "BertForSequenceClassification": ("bert", "EncoderClassifier", BERT_PREFIX),
    "LlamaForCausalLM": ("llama", "CausalLM", LLAMA_PREFIX),
    "Qwen2ForCausalLM": ("qwen2", "CausalLM", LLAMA_PREFIX),
    "MistralForCausalLM": ("mistral", "CausalLM", LLAMA_PREFIX),
}
# the architectures of GPT-2/BERT-style models, by npformer class (a Llama-style CausalLM is told apart by its config)
_ARCHITECTURE_OF = {cls: name for name, (family, cls, _) in ARCHITECTURES.items() if family in ("gpt2", "bert")}
LLAMA_FAMILY = {"llama": ("Llama", "LlamaForCausalLM"), "qwen2": ("Qwen2", "Qwen2ForCausalLM"),
                "mistral": ("Mistral", "MistralForCausalLM")}
# the prefix stripped from the keys of a file, by model_type
_FILE_PREFIX = {"gpt2": GPT2_PREFIX, "bert": BERT_PREFIX, "llama": LLAMA_PREFIX, "qwen2": LLAMA_PREFIX,
                "mistral": LLAMA_PREFIX}
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu", "relu": "relu"}
_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# buffers some files carry that are not weights (GPT-2's causal mask, BERT's position ids)
_NOT_WEIGHTS = re.compile(r"^(h\.\d+\.attn\.(bias|masked_bias)|embeddings\.(position_ids|token_type_ids)"
                          r"|(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq)$")
_OLD_LAYER_NORM = re.compile(r"\.LayerNorm\.(gamma|beta)$")  # TensorFlow-era BERT names
COPY, TRANSPOSE, STACK = "copy", "transpose", "stack"


def _require(condition, message):
    if not condition:
        raise ValueError(message)


def _choice(table, value, name, family):
    _require(isinstance(value, str) and value in table,
             f"{family} config: {name}={value!r} has no npformer counterpart (supported: {sorted(table)})")
    return table[value]


# -- configs ---------------------------------------------------------------------------------
def config_from_hf(hf_config: dict, architecture: str | None = None, pooler: bool = True) -> tuple[str, dict]:
    """(npformer class name, config) equivalent to a Hugging Face GPT-2 or BERT config.

    architecture: the Hugging Face class (default: hf_config["architectures"][0]); GPT-2 gives
    CausalLM whatever the head, BERT gives EncoderClassifier for BertForSequenceClassification
    and BidirectionalEncoder otherwise. pooler: whether the BERT model has its pooler."""
    if not isinstance(hf_config, dict):
        raise TypeError(f"config_from_hf: expected a dict (config.json), got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures")
    _require(architectures is None or (isinstance(architectures, list)
                                       and all(isinstance(a, str) for a in architectures)),
             f"config_from_hf: architectures must be a list of class names, got {architectures!r}")
    if architecture is None:
        architecture = (architectures or [None])[0]
    if model_type == "gpt2":
        return "CausalLM", _gpt2_config(hf_config)
    if model_type == "bert":
        classifier = architecture == "BertForSequenceClassification"
        name = "EncoderClassifier" if classifier else "BidirectionalEncoder"
        return name, _bert_config(hf_config, classifier, pooler)
    if isinstance(model_type, str) and model_type in LLAMA_FAMILY:
        return "CausalLM", _llama_config(hf_config, model_type)
    raise ValueError(f"config_from_hf: model_type {model_type!r} is not supported; npformer converts "
                     f"'gpt2' (GPT2LMHeadModel), 'bert' (BertModel, BertForSequenceClassification), 'llama' "
                     f"(LlamaForCausalLM), 'qwen2' (Qwen2ForCausalLM) and 'mistral' (MistralForCausalLM)")


def _flag(c, name, default, family):
    """config.json's true/false field `name` (default when absent) as a bool; ValueError for another type
    (bool("false") would be True)."""
    value = c.get(name, default)
    _require(isinstance(value, bool), f"{family} config: {name} must be true or false, got {value!r}")
    return value


def _gpt2_config(c):
    _require(_flag(c, "scale_attn_weights", True, "GPT-2"),
             "GPT-2 config: scale_attn_weights=False has no npformer counterpart")
    _require(not _flag(c, "scale_attn_by_inverse_layer_idx", False, "GPT-2"),
             "GPT-2 config: scale_attn_by_inverse_layer_idx=True has no npformer counterpart")
    _require(not _flag(c, "add_cross_attention", False, "GPT-2"),
             "GPT-2 config: add_cross_attention=True is not supported")
    resid, embd = c.get("resid_pdrop", 0.1), c.get("embd_pdrop", 0.1)
    _require(resid == embd, f"GPT-2 config: npformer uses one dropout rate for embeddings and residuals, got "
                            f"embd_pdrop={embd} and resid_pdrop={resid}")
    d_model = c["n_embd"]
    return dict(vocab_size=c["vocab_size"], d_model=d_model, nhead=c["n_head"], num_layers=c["n_layer"],
                dim_feedforward=c.get("n_inner") or 4 * d_model, dropout=resid, max_len=c["n_positions"],
                norm_first=True,
                activation=_choice(_GPT2_ACTIVATIONS, c.get("activation_function", "gelu_new"),
                                   "activation_function", "GPT-2"),
                positional="learned", tie_weights=_flag(c, "tie_word_embeddings", True, "GPT-2"), pad_idx=None,
                layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), attention_dropout=c.get("attn_pdrop", 0.1),
                activation_dropout=0.0)


# the defaults of transformers' config classes for the fields read here (a config.json may omit them)
_LLAMA_DEFAULTS = {
    "llama": dict(hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_dropout=0.0, num_key_value_heads=None, head_dim=None, attention_bias=False,
                  mlp_bias=False),
    "qwen2": dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  attention_dropout=0.0, num_key_value_heads=32, head_dim=None, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28, layer_types=None),
    "mistral": dict(hidden_act="silu", max_position_embeddings=4096 * 32, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, attention_dropout=0.0, num_key_value_heads=8, head_dim=None,
                    sliding_window=4096, layer_types=None),
}
# rotary scalings npformer applies (CausalLM's rope_scaling), with the keys each takes besides rope_type
ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# rope_parameters keys that every rope type may hold
_ROPE_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _number(value, name, owner, positive=True):
    _require(isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 or not positive),
             f"{owner}: {name} must be a {'positive ' if positive else ''}number, got {value!r}")
    return value


def _rope(c, owner, max_len):
    """(rotary_base, rope_scaling or None) of a Llama-family config: transformers 5's
    rope_parameters, or the rope_theta / rope_scaling of older config.json files (both read;
    values given twice must agree). Every entry is applied or refused by name. max_len: the
    config's max_position_embeddings, Llama 3's original_max_position_embeddings when absent."""
    params = c.get("rope_parameters")
    scaling = c.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        _require(value is None or isinstance(value, dict), f"{owner}: {name} must be a dict or null, got {value!r}")
        _require(value is None or not any(isinstance(v, dict) for v in value.values()),
                 f"{owner}: {name} per layer type ({sorted(value or {})}) is not supported: npformer's layers share "
                 f"one rotary embedding")
    merged = {}
    top = {k: c[k] for k in ("rope_theta", "partial_rotary_factor") if c.get(k) is not None}
    for name, entries in (("rope_parameters", params or {}), ("rope_scaling", scaling or {}), ("config", top)):
        for key, value in entries.items():
            if key in merged:
                _require(merged[key][1] == value, f"{owner}: {key}={value!r} ({name}) contradicts "
                                                  f"{key}={merged[key][1]!r} ({merged[key][0]})")
            else:
                merged[key] = (name, value)
    values = {key: value for key, (_, value) in merged.items()}
    kind = values.get("rope_type", values.get("type", "default"))
    _require(values.get("type", kind) == kind,
             f"{owner}: rope_type={kind!r} contradicts type={values.get('type')!r} ({merged.get('type', ('',))[0]})")
    source = merged.get("rope_type", merged.get("type", ("default",)))[0]
    _require(kind == "default" or kind in ROPE_SCALINGS,
             f"{owner}: rope_type={kind!r} ({source}) is not supported: "
             f"npformer applies rotary positions of type 'default' and {', '.join(map(repr, ROPE_SCALINGS))}")
    factor = values.get("partial_rotary_factor", 1.0)
    _require(factor == 1.0, f"{owner}: partial_rotary_factor={factor!r} is not supported (npformer rotates the "
                            f"whole head: 1.0)")
    known = _ROPE_COMMON + ROPE_SCALINGS.get(kind, ())
    for key, (name, value) in merged.items():
        _require(key in known, f"{owner}: {key}={value!r} ({name}) is not supported with rope_type={kind!r} "
                               f"(npformer reads {', '.join(known)})")
    base = _number(values.get("rope_theta", 10000.0), "rope_theta", owner)
    if kind == "default":
        return float(base), None
    if kind == "llama3" and "original_max_position_embeddings" not in values:  # as transformers' standardize
        values["original_max_position_embeddings"] = max_len
    for key in ROPE_SCALINGS[kind]:
        _require(key in values, f"{owner}: rope_type={kind!r} needs {key}")
    return float(base), {"rope_type": kind, **{key: _number(values[key], key, owner) for key in ROPE_SCALINGS[kind]}}


def _window(value, owner):
    _require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
             f"{owner}: sliding_window must be a positive integer or null, got {value!r}")
    return value


def _llama_window(c, family, owner, num_layers):
    """The sliding window shared by every layer (None: full causal attention), or ValueError when the
    layers differ (Qwen2's max_window_layers, a layer_types list)."""
    if family == "llama":
        return None
    window = _window(c.get("sliding_window", _LLAMA_DEFAULTS[family]["sliding_window"]), owner)
    if family == "qwen2" and not _flag(c, "use_sliding_window", False, LLAMA_FAMILY[family][0]):
        window = None  # as Qwen2Config: sliding_window only counts with use_sliding_window=True
    layer_types = c.get("layer_types")
    if family == "qwen2" and layer_types is None:  # Qwen2Config's rule: layers from max_window_layers on slide
        first = c.get("max_window_layers", _LLAMA_DEFAULTS["qwen2"]["max_window_layers"])
        _require(isinstance(first, int) and not isinstance(first, bool),
                 f"{owner}: max_window_layers must be an integer, got {first!r}")
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(num_layers)]
        where = f"use_sliding_window=True, max_window_layers={first}"
    else:
        where = f"layer_types={layer_types!r}"
    if layer_types is None:  # Mistral: every layer slides when there is a window
        return window
    _require(isinstance(layer_types, list) and len(layer_types) == num_layers
             and all(t in ("full_attention", "sliding_attention") for t in layer_types),
             f"{owner}: layer_types must list 'full_attention' or 'sliding_attention' for each of the "
             f"{num_layers} layers, got {layer_types!r}")
    windows = {window if t == "sliding_attention" else None for t in layer_types}
    if family == "mistral":  # MistralForCausalLM ignores layer_types (Ministral reads them): they must agree
        _require(windows == {window}, f"{owner}: {where} disagrees with sliding_window={window!r}, which "
                                      f"MistralForCausalLM applies to every layer")
    _require(len(windows) == 1, f"{owner}: {where} gives some layers a sliding window of {window} and others full "
                                f"attention; npformer's layers share one sliding_window")
    return windows.pop()


def _llama_config(c, family):
    name = LLAMA_FAMILY[family][0]
    owner = f"{name} config"
    defaults = _LLAMA_DEFAULTS[family]

    def get(name):
        return c.get(name, defaults[name])

    activation = get("hidden_act")
    _require(activation == "silu", f"{owner}: hidden_act={activation!r} has no npformer counterpart (npformer's "
                                   f"SwiGLU feed-forward uses 'silu')")
    d_model, nhead, num_layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    head_dim = get("head_dim")
    _require(head_dim is None or (isinstance(d_model, int) and isinstance(nhead, int) and nhead > 0
                                  and head_dim * nhead == d_model),
             f"{owner}: head_dim={head_dim!r} is not hidden_size / num_attention_heads = {d_model} / {nhead}: "
             f"npformer's attention heads split the model width")
    if family == "llama":
        for option in ("attention_bias", "mlp_bias"):
            _require(not _flag(c, option, False, name), f"{owner}: {option}=True is not supported (npformer's "
                                                         f"Llama-style CausalLM has bias=False)")
    num_kv_heads = get("num_key_value_heads")
    base, scaling = _rope(c, owner, get("max_position_embeddings"))
    window = _llama_window(c, family, owner, num_layers)
    return dict(vocab_size=c["vocab_size"], d_model=d_model, nhead=nhead, num_layers=num_layers,
                dim_feedforward=c["intermediate_size"], dropout=0.0, max_len=get("max_position_embeddings"),
                norm_first=True, activation="swiglu", positional="rope",
                tie_weights=_flag(c, "tie_word_embeddings", False, name), pad_idx=None,
                layer_norm_eps=get("rms_norm_eps"), attention_dropout=get("attention_dropout"),
                activation_dropout=0.0, bias=False, norm="rmsnorm",
                num_kv_heads=nhead if num_kv_heads is None else num_kv_heads, sliding_window=window,
                qkv_bias=True if family == "qwen2" else None, rotary_base=base, rope_scaling=scaling)


def _bert_config(c, classifier, pooler):
    _require(c.get("position_embedding_type", "absolute") == "absolute",
             f"BERT config: position_embedding_type={c.get('position_embedding_type')!r} is not supported "
             f"(only 'absolute')")
    _require(not _flag(c, "is_decoder", False, "BERT"), "BERT config: is_decoder=True (a causal BERT) is not supported")
    _require(not _flag(c, "add_cross_attention", False, "BERT"),
             "BERT config: add_cross_attention=True is not supported")
    type_vocab_size = c.get("type_vocab_size", 2)
    _require(isinstance(type_vocab_size, int) and not isinstance(type_vocab_size, bool) and type_vocab_size >= 1,
             f"BERT config: type_vocab_size must be an integer >= 1, got {type_vocab_size!r} (BERT always adds "
             f"token-type embeddings)")
    hidden_dropout = c.get("hidden_dropout_prob", 0.1)
    config = dict(vocab_size=c["vocab_size"], d_model=c["hidden_size"], nhead=c["num_attention_heads"],
                  num_layers=c["num_hidden_layers"], dim_feedforward=c["intermediate_size"], dropout=hidden_dropout,
                  max_len=c["max_position_embeddings"], norm_first=False,
                  activation=_choice(_BERT_ACTIVATIONS, c.get("hidden_act", "gelu"), "hidden_act", "BERT"),
                  pooling="first", positional="learned", pad_idx=c.get("pad_token_id"),
                  layer_norm_eps=c.get("layer_norm_eps", 1e-12),
                  attention_dropout=c.get("attention_probs_dropout_prob", 0.1), activation_dropout=0.0,
                  type_vocab_size=type_vocab_size, embed_norm=True, final_norm=False, pooler=bool(pooler))
    if classifier:
        _require(pooler, "BERT config: BertForSequenceClassification needs the pooler")
        labels = c.get("id2label")
        _require(labels is None or isinstance(labels, dict),
                 f"BERT config: id2label must map label ids to names, got {type(labels).__name__}")
        num_classes = len(labels) if labels else c.get("num_labels", 2)
        head_dropout = c.get("classifier_dropout")
        config = dict(vocab_size=config.pop("vocab_size"), num_classes=num_classes, **config,
                      classifier_dropout=hidden_dropout if head_dropout is None else head_dropout)
    return config


def _is_llama_style(model):
    """Whether `model` is a CausalLM meant as a Llama-family model (RMSNorm or a SiLU/SwiGLU feed-forward)."""
    c = getattr(model, "config", None) or {}
    return type(model).__name__ == "CausalLM" and (c.get("norm") == "rmsnorm" or c.get("activation") in ("silu",
                                                                                                       "swiglu"))


def _architecture(model):
    name = type(model).__name__
    if _is_llama_style(model):
        c = model.config
        if c.get("qkv_bias") is True:
            return "Qwen2ForCausalLM"
        return "MistralForCausalLM" if c.get("sliding_window") is not None else "LlamaForCausalLM"
    _require(name in _ARCHITECTURE_OF, f"hf_config: {name} has no Hugging Face counterpart; CausalLM (GPT-2, or "
                                       f"Llama, Qwen2, Mistral), BidirectionalEncoder (BertModel) and "
                                       f"EncoderClassifier (BertForSequenceClassification) do")
    return _ARCHITECTURE_OF[name]


def _family(model):
    return ARCHITECTURES[_architecture(model)][0]


def _head_counts(c):
    """(nhead, num_kv_heads, head_dim) of a model config (num_kv_heads None or absent: nhead)."""
    nhead = c["nhead"]
    kv = c.get("num_kv_heads")
    return nhead, nhead if kv is None else kv, c["d_model"] // nhead


def _check_plain(c, owner, family):
    """ValueError naming the first option of a BERT-bound model that BERT does not have (the
    options of Llama-style models, when the model carries them)."""
    nhead, kv, _ = _head_counts(c)
    for option, value, wanted in (("bias", c.get("bias", True), True), ("norm", c.get("norm", "layernorm"),
                                  "layernorm"), ("num_kv_heads", kv, nhead),
                                  ("sliding_window", c.get("sliding_window"), None),
                                  ("qkv_bias", c.get("qkv_bias", None) in (None, True), True)):
        _require(value == wanted, f"hf_config: {family} has no counterpart for {owner}({option}="
                                  f"{c.get(option)!r}) (it needs {option}={wanted!r})")


def _llama_hf_config(model, architecture):
    """The config.json of a Llama-style CausalLM: LlamaForCausalLM, Qwen2ForCausalLM (qkv_bias)
    or MistralForCausalLM (sliding_window)."""
    c, family = model.config, ARCHITECTURES[architecture][0]
    name = LLAMA_FAMILY[family][0]
    # what made it Llama-style rather than GPT-2 (named: the model may have been meant as a GPT-2)
    trigger = "norm='rmsnorm'" if c.get("norm") == "rmsnorm" else f"activation={c.get('activation')!r}"
    for option, wanted in (("norm", "rmsnorm"), ("activation", "swiglu"), ("positional", "rope"), ("bias", False),
                           ("norm_first", True)):
        _require(c.get(option) == wanted, f"hf_config: CausalLM({trigger}) has no GPT-2 counterpart, and {name} "
                                          f"({architecture}) needs CausalLM({option}={wanted!r}), got "
                                          f"{option}={c.get(option)!r}")
    nhead, kv, head_dim = _head_counts(c)
    attention_dropout = c["dropout"] if c.get("attention_dropout") is None else c["attention_dropout"]
    base, scaling = float(c.get("rotary_base", 10000.0)), c.get("rope_scaling")
    if scaling is not None:  # numbers as transformers writes them (npformer's config holds floats)
        scaling = {key: int(value) if key == "original_max_position_embeddings" and value == int(value) else value
                   for key, value in scaling.items()}
    rope = {"rope_type": "default", "rope_theta": base} if scaling is None else {**scaling, "rope_theta": base}
    config = dict(model_type=family, architectures=[architecture], vocab_size=c["vocab_size"],
                  hidden_size=c["d_model"], intermediate_size=c["dim_feedforward"],
                  num_hidden_layers=c["num_layers"], num_attention_heads=nhead, num_key_value_heads=kv,
                  hidden_act="silu", max_position_embeddings=c["max_len"], rms_norm_eps=c["layer_norm_eps"],
                  tie_word_embeddings=c["tie_weights"], attention_dropout=attention_dropout,
                  # transformers 5 reads rope_parameters; rope_theta (and rope_scaling) are what older releases read
                  rope_parameters=rope, rope_theta=base, bos_token_id=None, eos_token_id=None,
                  pad_token_id=c["pad_idx"])
    if scaling is not None:
        config["rope_scaling"] = dict(scaling)
    window = c.get("sliding_window")
    if family == "qwen2":  # every layer slides: max_window_layers=0 (Qwen2's layers from that index on slide)
        config.update(use_sliding_window=window is not None, sliding_window=window,
                      max_window_layers=0 if window is not None else c["num_layers"])
    else:
        config["head_dim"] = head_dim
        if family == "mistral":
            config["sliding_window"] = window
        else:
            config.update(attention_bias=False, mlp_bias=False)
    return config


def hf_config(model) -> dict:
    """The Hugging Face config (a config.json dict with "model_type" and "architectures") of an
    npformer CausalLM (GPT-2; or Llama, Qwen2, Mistral for a Llama-style CausalLM: RMSNorm,
    SwiGLU, RoPE, no biases; Qwen2 when it has qkv_bias=True, Mistral when it has a
    sliding_window), BidirectionalEncoder (BertModel) or EncoderClassifier
    (BertForSequenceClassification). Raises ValueError naming the option that the Hugging Face
    architecture cannot express. GPT-2 and BERT have no dropout between the feed-forward
    activation and its second linear: `activation_dropout` is not carried over; Llama, Qwen2
    and Mistral have only attention dropout: `dropout` and `activation_dropout` are not carried
    over either (training only: the numbers in evaluation are the same)."""
    architecture = _architecture(model)
    c, owner = model.config, type(model).__name__
    if ARCHITECTURES[architecture][0] in LLAMA_FAMILY:
        return _llama_hf_config(model, architecture)
    if architecture != "GPT2LMHeadModel":  # (GPT-2's: _gpt2_options)
        _check_plain(c, owner, "BERT")
    _require(c["positional"] == "learned", f"hf_config: {owner}(positional={c['positional']!r}) has no Hugging Face "
                                           f"counterpart: GPT-2 and BERT learn their positions (positional='learned'); "
                                           f"Llama needs norm='rmsnorm' and activation='swiglu' too")
    activation = _choice(_HF_ACTIVATION, c["activation"], "activation", owner)
    attention_dropout = c["dropout"] if c.get("attention_dropout") is None else c["attention_dropout"]
    if architecture == "GPT2LMHeadModel":
        _require(c["norm_first"], "hf_config: GPT-2 is pre-LN: CausalLM(norm_first=False) has no GPT-2 counterpart")
        _gpt2_options(c)
        vocab = c["vocab_size"]
        token = 50256 if vocab > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
        return dict(model_type="gpt2", architectures=[architecture], vocab_size=vocab, n_positions=c["max_len"],
                    n_embd=c["d_model"], n_layer=c["num_layers"], n_head=c["nhead"], n_inner=c["dim_feedforward"],
                    activation_function=activation, resid_pdrop=c["dropout"], embd_pdrop=c["dropout"],
                    attn_pdrop=attention_dropout, layer_norm_epsilon=c["layer_norm_eps"],
                    tie_word_embeddings=c["tie_weights"], bos_token_id=token, eos_token_id=token,
                    pad_token_id=c["pad_idx"])
    for option, wanted in (("norm_first", False), ("embed_norm", True), ("final_norm", False)):
        _require(c.get(option) == wanted, f"hf_config: BERT needs {owner}({option}={wanted}), got {c.get(option)}")
    _require(c["type_vocab_size"] > 0, f"hf_config: BERT has token-type embeddings: {owner} needs type_vocab_size > 0")
    if architecture == "BertForSequenceClassification" or c["pooler"]:
        _require(c["pooler"] and c["pooling"] == "first",
                 f"hf_config: BERT's pooler reads the first token: {owner} needs pooler=True and pooling='first'")
    config = dict(model_type="bert", architectures=[architecture], vocab_size=c["vocab_size"],
                  hidden_size=c["d_model"], num_hidden_layers=c["num_layers"], num_attention_heads=c["nhead"],
                  intermediate_size=c["dim_feedforward"], hidden_act=activation, hidden_dropout_prob=c["dropout"],
                  attention_probs_dropout_prob=attention_dropout, max_position_embeddings=c["max_len"],
                  type_vocab_size=c["type_vocab_size"], layer_norm_eps=c["layer_norm_eps"], pad_token_id=c["pad_idx"])
    if architecture == "BertForSequenceClassification":
        config.update(num_labels=c["num_classes"], classifier_dropout=c["classifier_dropout"])
    return config


# CausalLM options GPT-2 has only at their defaults (nanoGPT's bias=False models too: interop.to_nanogpt)
_GPT2_DEFAULTS = (("bias", True), ("norm", "layernorm"), ("sliding_window", None))


def _gpt2_options(c):
    """ValueError naming the first option of a CausalLM config that GPT-2 cannot express."""
    for option, default in _GPT2_DEFAULTS:
        _require(c.get(option, default) == default,
                 f"hf_config: CausalLM({option}={c[option]!r}) has no GPT-2 counterpart (GPT-2 has "
                 f"{option}={default!r})" + ("; npformer.interop.to_nanogpt writes nanoGPT's bias-free checkpoints"
                                             if option == "bias" else ""))
    heads = c.get("num_kv_heads")
    _require(heads in (None, c["nhead"]), f"hf_config: CausalLM(num_kv_heads={heads!r}) has no GPT-2 counterpart "
                                          f"(GPT-2 has one key/value head per query head)")
    qkv_bias = c.get("qkv_bias")
    _require(qkv_bias in (None, c.get("bias", True)),
             f"hf_config: CausalLM(qkv_bias={qkv_bias!r}) has no GPT-2 counterpart (its q/k/v biases are its other "
             f"biases)")


# -- weights ---------------------------------------------------------------------------------
def _rules(model):
    """[(Hugging Face keys, npformer key, how)] with the base model's keys unprefixed; how is
    COPY, TRANSPOSE (Conv1D (in, out) <-> Linear (out, in)) or STACK (q, k, v -> in_proj, rows
    as _stack_sizes gives them)."""
    architecture = _architecture(model)
    c = model.config
    if ARCHITECTURES[architecture][0] in LLAMA_FAMILY:
        return _llama_rules(c)
    if architecture == "GPT2LMHeadModel":
        rules = [(("wte.weight",), "tok_embed.weight", COPY), (("wpe.weight",), "pos_embed.weight", COPY)]
        for i in range(c["num_layers"]):
            h, o = f"h.{i}.", f"encoder.layers.{i}."
            for theirs, ours, how in (("ln_1", "norm1.{}", COPY), ("attn.c_attn", "self_attn.in_proj_{}", TRANSPOSE),
                                      ("attn.c_proj", "self_attn.out_proj.{}", TRANSPOSE), ("ln_2", "norm2.{}", COPY),
                                      ("mlp.c_fc", "linear1.{}", TRANSPOSE), ("mlp.c_proj", "linear2.{}", TRANSPOSE)):
                rules.append(((f"{h}{theirs}.weight",), o + ours.format("weight"), how))
                rules.append(((f"{h}{theirs}.bias",), o + ours.format("bias"), COPY))
        rules += [(("ln_f.weight",), "encoder.norm.weight", COPY), (("ln_f.bias",), "encoder.norm.bias", COPY)]
        if not c["tie_weights"]:
            rules.append((("lm_head.weight",), "lm_head.weight", COPY))
        return rules
    rules = [(("embeddings.word_embeddings.weight",), "tok_embed.weight", COPY),
             (("embeddings.position_embeddings.weight",), "pos_embed.weight", COPY),
             (("embeddings.token_type_embeddings.weight",), "type_embed.weight", COPY),
             (("embeddings.LayerNorm.weight",), "embed_norm.weight", COPY),
             (("embeddings.LayerNorm.bias",), "embed_norm.bias", COPY)]
    for i in range(c["num_layers"]):
        h, o = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            rules.append((tuple(f"{h}attention.self.{p}.{kind}" for p in ("query", "key", "value")),
                          f"{o}self_attn.in_proj_{kind}", STACK))
            for theirs, ours in (("attention.output.dense", "self_attn.out_proj"), ("attention.output.LayerNorm",
                                 "norm1"), ("intermediate.dense", "linear1"), ("output.dense", "linear2"),
                                 ("output.LayerNorm", "norm2")):
                rules.append(((f"{h}{theirs}.{kind}",), f"{o}{ours}.{kind}", COPY))
    if c["pooler"]:
        rules += [(("pooler.dense.weight",), "pooler.weight", COPY), (("pooler.dense.bias",), "pooler.bias", COPY)]
    if architecture == "BertForSequenceClassification":
        rules += [(("classifier.weight",), "classifier.weight", COPY), (("classifier.bias",), "classifier.bias", COPY)]
    return rules


def _llama_rules(c):
    """The rules of LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases: qkv_bias=True) and MistralForCausalLM."""
    rules = [(("embed_tokens.weight",), "tok_embed.weight", COPY)]
    kinds = ("weight", "bias") if c.get("qkv_bias") else ("weight",)
    for i in range(c["num_layers"]):
        h, o = f"layers.{i}.", f"encoder.layers.{i}."
        for kind in kinds:
            rules.append((tuple(f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"), f"{o}self_attn.in_proj_{kind}", STACK))
        for theirs, ours in (("self_attn.o_proj", "self_attn.out_proj"), ("mlp.gate_proj", "linear1"),
                             ("mlp.up_proj", "linear3"), ("mlp.down_proj", "linear2"), ("input_layernorm", "norm1"),
                             ("post_attention_layernorm", "norm2")):
            rules.append(((f"{h}{theirs}.weight",), f"{o}{ours}.weight", COPY))
    rules.append((("norm.weight",), "encoder.norm.weight", COPY))
    if not c["tie_weights"]:
        rules.append((("lm_head.weight",), "lm_head.weight", COPY))
    return rules


def _stack_sizes(c, parts):
    """The rows of each of the `parts` (q, k, v) stacked into in_proj: H head_dim, H_kv head_dim, H_kv head_dim."""
    nhead, kv, head_dim = _head_counts(c)
    sizes = [nhead * head_dim, kv * head_dim, kv * head_dim]
    assert len(parts) == len(sizes)
    return sizes


def _prefix(model):
    return ARCHITECTURES[_architecture(model)][2]


def _is_head(key):
    return key.startswith(("lm_head.", "classifier."))


def hf_state_dict(model, prefixed: bool = True) -> dict:
    """{Hugging Face name: host array} of the model's weights, in Hugging Face's layouts.
    prefixed: the base model's keys carry the head model's prefix ("transformer." for
    GPT2LMHeadModel, "bert." for BertForSequenceClassification, "model." for LlamaForCausalLM,
    Qwen2ForCausalLM and MistralForCausalLM), as save_pretrained writes them."""
    ours = model.state_dict()
    prefix = _prefix(model) if prefixed else ""
    out = {}
    for theirs, key, how in _rules(model):
        array = ours[key]
        if how == TRANSPOSE:
            parts = [array.T]
        elif how == STACK:
            sizes = _stack_sizes(model.config, theirs)
            parts = [array[sum(sizes[:j]):sum(sizes[:j + 1])] for j in range(len(sizes))]
        else:
            parts = [array]
        for name, part in zip(theirs, parts):
            out[name if _is_head(name) else prefix + name] = part
    return out


def _canonical(tensors, prefix):
    """({name as _rules names it: (name in `tensors`, array)}, the prefix stripped): the base
    model's prefix stripped (files saved from a model with a head carry it, e.g. BERT's
    pretraining checkpoints; GPT-2's original files do not),
    TensorFlow-era BERT LayerNorm gamma/beta renamed weight/bias. ValueError when two keys
    become one name (e.g. "transformer.h.0.ln_1.weight" and "h.0.ln_1.weight")."""
    canonical = {}
    stripped = prefix if prefix and any(k.startswith(prefix) for k in tensors) else ""
    for key, array in tensors.items():
        name = key[len(stripped):] if stripped and key.startswith(stripped) else key
        name = _OLD_LAYER_NORM.sub(lambda m: ".LayerNorm." + {"gamma": "weight", "beta": "bias"}[m.group(1)], name)
        if name in canonical:
            first, second = sorted((canonical[name][0], key))
            raise ValueError(f"the keys {first!r} and {second!r} are two values of one weight ({name!r}): the file "
                             f"means two things")
        canonical[name] = (key, array)
    return canonical, stripped


def state_dict_from_hf(model, tensors: dict) -> tuple[dict, list]:
    """(state_dict for `model`, skipped keys) from a Hugging Face state dict `tensors`
    ({name: array}, prefixed or not). Raises ValueError naming the first missing, mis-shaped
    or unmapped key, or two keys of one weight (prefixed and not, LayerNorm gamma and weight).
    Skipped: BERT pretraining heads (cls.*). Causal-mask and position-id buffers are dropped;
    a tied lm_head.weight must equal the word embeddings."""
    canonical, stripped = _canonical(tensors, _FILE_PREFIX[_family(model)])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state, used, embedding = {}, set(), None
    for theirs, key, how in _rules(model):
        for name in theirs:
            _require(name in canonical, f"missing key {name if _is_head(name) else stripped + name!r} "
                                        f"(npformer's {key}) in the Hugging Face weights")
        arrays = [canonical[name][1] for name in theirs]
        want = shapes[key]
        if how == STACK:
            expected = [(size,) + want[1:] for size in _stack_sizes(model.config, theirs)]
        else:
            expected = [want[::-1] if how == TRANSPOSE else want]
        for name, array, shape in zip(theirs, arrays, expected):
            _require(tuple(array.shape) == shape, f"mis-shaped key {canonical[name][0]!r}: shape "
                                                  f"{tuple(array.shape)}, expected {shape} (npformer's {key})")
        if key == "tok_embed.weight":
            embedding = arrays[0]
        if how == TRANSPOSE:
            state[key] = arrays[0].T
        elif how == STACK:
            state[key] = backend.get_array_module(arrays[0]).concatenate(arrays, axis=0)
        else:
            state[key] = arrays[0]
        used.update(theirs)
    skipped = []
    for name, (key, array) in canonical.items():
        if name in used or _NOT_WEIGHTS.match(name):
            continue
        if name == "lm_head.weight" and model.config.get("tie_weights"):
            _require(array.shape == embedding.shape and bool((array == embedding).all()),
                     f"key {key!r} differs from the word embeddings, but the config ties them "
                     f"(tie_word_embeddings=True)")
            continue
        if name.startswith("cls.") and model.config.get("type_vocab_size"):
            skipped.append(key)
            continue
        raise ValueError(f"unmapped key {key!r}: npformer's {type(model).__name__} has no counterpart for it")
    return state, skipped
