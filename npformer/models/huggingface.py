"""Hugging Face GPT-2 and BERT in npformer's terms: configs and weight names, as plain dicts.

- `config_from_hf(hf_config)`: a Hugging Face config (config.json, or `model.config.to_dict()`)
  -> (npformer model class name, its config): GPT-2 -> CausalLM, BERT -> BidirectionalEncoder
  (BertModel) or EncoderClassifier (BertForSequenceClassification).
- `hf_config(model)`: the reverse, a config.json dict with "model_type" and "architectures".
- `state_dict_from_hf(model, tensors)`: a Hugging Face state dict ({name: array}, as in
  model.safetensors or `hf_model.state_dict()`) -> the model's state_dict; every weight mapped,
  an error naming the first missing, mis-shaped or unmapped key.
- `hf_state_dict(model)`: the model's weights under Hugging Face's names and layouts.

The mapping (one rule per npformer key; docs/huggingface.md has the table):
GPT-2's Conv1D stores weights (in, out), the transpose of a Linear's (out, in); BERT's
separate query/key/value Linears stack into MultiheadAttention's packed in_proj (3E, E).
Causal-mask buffers of old GPT-2 files (h.{i}.attn.bias, masked_bias) and BERT's position_ids
buffer are not weights and are skipped; BERT pretraining heads (cls.*) are returned as skipped.
No transformers or torch here: npformer.interop and npformer.models.pretrained use this.
"""
import re

from autograd import backend

GPT2_PREFIX, BERT_PREFIX = "transformer.", "bert."
# architecture -> (model_type, npformer class name, prefix of the base model's keys)
ARCHITECTURES = {
    "GPT2LMHeadModel": ("gpt2", "CausalLM", GPT2_PREFIX),
    "BertModel": ("bert", "BidirectionalEncoder", ""),
    "BertForSequenceClassification": ("bert", "EncoderClassifier", BERT_PREFIX),
}
_ARCHITECTURE_OF = {cls: name for name, (_, cls, _) in ARCHITECTURES.items()}
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu", "relu": "relu"}
_BERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
# buffers some files carry that are not weights (GPT-2's causal mask, BERT's position ids)
_NOT_WEIGHTS = re.compile(r"^(h\.\d+\.attn\.(bias|masked_bias)|embeddings\.(position_ids|token_type_ids))$")
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
    raise ValueError(f"config_from_hf: model_type {model_type!r} is not supported; npformer converts "
                     f"'gpt2' (GPT2LMHeadModel) and 'bert' (BertModel, BertForSequenceClassification)")


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


def _architecture(model):
    name = type(model).__name__
    _require(name in _ARCHITECTURE_OF, f"hf_config: {name} has no Hugging Face counterpart; CausalLM (GPT-2), "
                                       f"BidirectionalEncoder (BertModel) and EncoderClassifier "
                                       f"(BertForSequenceClassification) do")
    return _ARCHITECTURE_OF[name]


def hf_config(model) -> dict:
    """The Hugging Face config (a config.json dict with "model_type" and "architectures") of an
    npformer CausalLM (GPT-2), BidirectionalEncoder (BertModel) or EncoderClassifier
    (BertForSequenceClassification). Raises ValueError naming the option that the Hugging Face
    architecture cannot express. GPT-2 and BERT have no dropout between the feed-forward
    activation and its second linear: `activation_dropout` is not carried over."""
    architecture = _architecture(model)
    c, owner = model.config, type(model).__name__
    _require(c["positional"] == "learned", f"hf_config: {owner}(positional={c['positional']!r}) has no Hugging Face "
                                           f"counterpart: GPT-2 and BERT learn their positions (positional='learned')")
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
    COPY, TRANSPOSE (Conv1D (in, out) <-> Linear (out, in)) or STACK (q, k, v -> in_proj)."""
    architecture = _architecture(model)
    c = model.config
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


def _prefix(model):
    return ARCHITECTURES[_architecture(model)][2]


def _is_head(key):
    return key.startswith(("lm_head.", "classifier."))


def hf_state_dict(model, prefixed: bool = True) -> dict:
    """{Hugging Face name: host array} of the model's weights, in Hugging Face's layouts.
    prefixed: the base model's keys carry the head model's prefix ("transformer." for
    GPT2LMHeadModel, "bert." for BertForSequenceClassification), as save_pretrained writes them."""
    ours = model.state_dict()
    prefix = _prefix(model) if prefixed else ""
    out = {}
    for theirs, key, how in _rules(model):
        array = ours[key]
        if how == TRANSPOSE:
            parts = [array.T]
        elif how == STACK:
            n = array.shape[0] // len(theirs)
            parts = [array[j * n:(j + 1) * n] for j in range(len(theirs))]
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
    family = ARCHITECTURES[_architecture(model)][0]
    canonical, stripped = _canonical(tensors, {"gpt2": GPT2_PREFIX, "bert": BERT_PREFIX}[family])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state, used = {}, set()
    for theirs, key, how in _rules(model):
        for name in theirs:
            _require(name in canonical, f"missing key {name if _is_head(name) else stripped + name!r} "
                                        f"(npformer's {key}) in the Hugging Face weights")
        arrays = [canonical[name][1] for name in theirs]
        want = shapes[key]
        expected = {TRANSPOSE: want[::-1], STACK: (want[0] // len(theirs),) + want[1:]}.get(how, want)
        for name, array in zip(theirs, arrays):
            _require(tuple(array.shape) == expected, f"mis-shaped key {canonical[name][0]!r}: shape "
                                                     f"{tuple(array.shape)}, expected {expected} (npformer's {key})")
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
            wte = canonical["wte.weight"][1]
            _require(array.shape == wte.shape and bool((array == wte).all()),
                     f"key {key!r} differs from the word embeddings, but the config ties them "
                     f"(tie_word_embeddings=True)")
            continue
        if name.startswith("cls.") and model.config.get("type_vocab_size"):
            skipped.append(key)
            continue
        raise ValueError(f"unmapped key {key!r}: npformer's {type(model).__name__} has no counterpart for it")
    return state, skipped
