"""nanoGPT (Karpathy's model.py / train.py) checkpoints <-> npformer's CausalLM.

nanoGPT's GPT is a pre-LN GPT-2: learned positions, exact GELU, a feed-forward of 4 n_embd,
LayerNorm eps 1e-5, the output layer tied to the token embedding, one dropout rate (none after
the feed-forward activation), biases optional (GPTConfig.bias), and the residual projections
initialised at std 0.02 / sqrt(2 n_layer). That is

    CausalLM(vocab_size, d_model=n_embd, nhead=n_head, num_layers=n_layer, dim_feedforward=4 * n_embd,
             dropout=dropout, max_len=block_size, tie_weights=True, activation_dropout=0.0, bias=bias,
             residual_init="gpt2")

(`nanogpt_config(model_args)` gives it). Its weights are torch.nn.Linear's, (out, in) like
ours (not GPT-2's Conv1D (in, out)), so every tensor is copied as it is:

    transformer.wte / wpe                -> tok_embed / pos_embed
    transformer.h.{i}.ln_1 / ln_2        -> encoder.layers.{i}.norm1 / norm2
    transformer.h.{i}.attn.c_attn        -> encoder.layers.{i}.self_attn.in_proj_weight / in_proj_bias (q, k, v rows)
    transformer.h.{i}.attn.c_proj        -> encoder.layers.{i}.self_attn.out_proj
    transformer.h.{i}.mlp.c_fc / c_proj  -> encoder.layers.{i}.linear1 / linear2
    transformer.ln_f                     -> encoder.norm
    lm_head.weight                       -> tied to tok_embed (a separate lm_head if it differs)

- `from_nanogpt(checkpoint, model_args=None)`: a ckpt.pt path (train.py's {"model", "model_args",
  ...}), such a dict, or a state_dict with model_args -> CausalLM (eval mode). torch.compile's
  "_orig_mod." prefix is stripped; the causal-mask buffers of nanoGPT's non-flash attention
  (h.{i}.attn.bias) are skipped. Files are read with torch.load(weights_only=True): no pickled
  code runs.
- `to_nanogpt(model)`: {"model_args": ..., "model": state_dict of torch tensors} that nanoGPT's
  GPT(GPTConfig(**model_args)).load_state_dict(...) takes (torch.save it as a ckpt.pt).

torch is imported inside these functions only.
"""
from __future__ import annotations

import os
from typing import Any

from autograd.checks import check_bool

from ..models import CausalLM
from .pytorch import _torch

# nanoGPT's GPTConfig and its defaults (train.py's model_args hold every one)
GPT_CONFIG = dict(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True)
COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper prefixes every key with it
_LAYER = (("ln_1", "norm1"), ("attn.c_attn", "self_attn.in_proj"), ("attn.c_proj", "self_attn.out_proj"),
          ("ln_2", "norm2"), ("mlp.c_fc", "linear1"), ("mlp.c_proj", "linear2"))
_NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of the non-flash attention


def nanogpt_config(model_args: dict[str, Any]) -> dict[str, Any]:
    """CausalLM's config (its constructor arguments) of nanoGPT's GPTConfig fields `model_args`
    (missing ones take GPTConfig's defaults). ValueError naming an unknown field, TypeError for
    a non-dict or a bias that is not True or False; the numbers are checked by CausalLM."""
    if not isinstance(model_args, dict):
        raise TypeError(f"nanoGPT: model_args must be a dict of GPTConfig fields, got {type(model_args).__name__}")
    unknown = sorted(str(k) for k in model_args if k not in GPT_CONFIG)
    if unknown:
        raise ValueError(f"nanoGPT: unknown model_args {unknown}; GPTConfig has {list(GPT_CONFIG)}")
    a = {**GPT_CONFIG, **model_args}
    return dict(vocab_size=a["vocab_size"], d_model=a["n_embd"], nhead=a["n_head"], num_layers=a["n_layer"],
                dim_feedforward=4 * a["n_embd"], dropout=a["dropout"], max_len=a["block_size"], norm_first=True,
                activation="gelu", positional="learned", tie_weights=True, pad_idx=None, layer_norm_eps=1e-5,
                activation_dropout=0.0, bias=check_bool(a["bias"], "model_args['bias']", "nanoGPT"),
                residual_init="gpt2")


def _pairs(num_layers, bias):
    """[(nanoGPT key, CausalLM key)] of every weight but lm_head."""
    pairs = [("transformer.wte.weight", "tok_embed.weight"), ("transformer.wpe.weight", "pos_embed.weight")]
    kinds = ("weight", "bias") if bias else ("weight",)
    for i in range(num_layers):
        for theirs, ours in _LAYER:
            for kind in kinds:
                key = f"{ours}_{kind}" if ours == "self_attn.in_proj" else f"{ours}.{kind}"
                pairs.append((f"transformer.h.{i}.{theirs}.{kind}", f"encoder.layers.{i}.{key}"))
    pairs += [(f"transformer.ln_f.{kind}", f"encoder.norm.{kind}") for kind in kinds]
    return pairs


def _array(value, key):
    """A state_dict value (torch tensor or numpy array) as a host numpy array; half precision as float32."""
    torch = _torch()
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.float16, torch.bfloat16):
            value = value.float()
        return value.numpy()
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return value
    raise TypeError(f"from_nanogpt: {key!r} is a {type(value).__name__}, not a tensor")


def _read(checkpoint, model_args):
    """(state_dict, model_args) of from_nanogpt's arguments."""
    if isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        # weights_only: torch's restricted unpickler (tensors, dicts, numbers, strings): no pickled code runs
        checkpoint = _torch().load(path, map_location="cpu", weights_only=True)
        if not isinstance(checkpoint, dict) or "model" not in checkpoint:
            raise ValueError(f"from_nanogpt: {path} is not a nanoGPT checkpoint (a dict with 'model' and "
                             f"'model_args', as train.py saves)")
    if not isinstance(checkpoint, dict):
        raise TypeError(f"from_nanogpt: expected a ckpt.pt path, a checkpoint dict or a state_dict, got "
                        f"{type(checkpoint).__name__}")
    if "model" in checkpoint and isinstance(checkpoint["model"], dict):
        if model_args is None:
            if "model_args" not in checkpoint:
                raise ValueError("from_nanogpt: the checkpoint has no 'model_args'; pass model_args=")
            model_args = checkpoint["model_args"]
        checkpoint = checkpoint["model"]
    elif model_args is None:
        raise ValueError("from_nanogpt: a bare state_dict needs model_args= (GPTConfig's fields: "
                         f"{list(GPT_CONFIG)})")
    state = {}
    for key, value in checkpoint.items():
        name = key[len(COMPILED_PREFIX):] if isinstance(key, str) and key.startswith(COMPILED_PREFIX) else key
        if name in state:
            raise ValueError(f"from_nanogpt: {name!r} appears with and without the {COMPILED_PREFIX!r} prefix")
        state[name] = value
    return state, model_args


def from_nanogpt(checkpoint: str | os.PathLike | dict[str, Any], model_args: dict[str, Any] | None = None) -> CausalLM:
    """The CausalLM of a nanoGPT model, with its weights (copied) and dtype (float64 if every
    floating tensor is, else float32), in eval mode.

    checkpoint: the path of a ckpt.pt that nanoGPT's train.py wrote (read with
    torch.load(weights_only=True)), such a dict ({"model": state_dict, "model_args": {...}}), or
    a state_dict (GPT.state_dict(), torch tensors or numpy arrays) with `model_args`
    (GPTConfig's fields; given, they replace the checkpoint's). Keys may carry torch.compile's
    "_orig_mod." prefix. A lm_head.weight equal to the token embedding (nanoGPT ties them) gives
    tie_weights=True; a different one, a separate lm_head. ValueError naming a missing,
    mis-shaped or unmapped key or a bad model_args field."""
    state, model_args = _read(checkpoint, model_args)
    config = nanogpt_config(model_args)
    arrays = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"from_nanogpt: state_dict keys must be strings, got {key!r}")
        if not key.endswith(_NOT_WEIGHTS):
            arrays[key] = _array(value, key)
    pairs = _pairs(config["num_layers"], config["bias"])
    missing = [theirs for theirs, _ in pairs if theirs not in arrays]
    if missing:
        raise ValueError(f"from_nanogpt: missing key {missing[0]!r} (model_args bias={config['bias']}, "
                         f"n_layer={config['num_layers']}; {len(missing)} missing in all)")
    wte, head = arrays["transformer.wte.weight"], arrays.get("lm_head.weight")
    config["tie_weights"] = head is None or (head.shape == wte.shape and bool((head == wte).all()))
    mapped = dict(pairs) if config["tie_weights"] else {**dict(pairs), "lm_head.weight": "lm_head.weight"}
    unmapped = [k for k in arrays if k not in mapped and k != "lm_head.weight"]
    if unmapped:
        raise ValueError(f"from_nanogpt: unmapped key {unmapped[0]!r}: nanoGPT's GPT (model_args bias="
                         f"{config['bias']}, n_layer={config['num_layers']}) has no such weight")
    floats = {a.dtype.name for a in arrays.values() if a.dtype.kind == "f"}
    model = CausalLM(**config).to(dtype="float64" if floats == {"float64"} else "float32")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {}
    for theirs, key in mapped.items():
        if tuple(arrays[theirs].shape) != shapes[key]:
            raise ValueError(f"from_nanogpt: mis-shaped key {theirs!r}: shape {tuple(arrays[theirs].shape)}, "
                             f"expected {shapes[key]} (npformer's {key}) from model_args")
        ours[key] = arrays[theirs]
    model.load_state_dict(ours)
    return model.eval()


def to_nanogpt(model: CausalLM) -> dict[str, Any]:
    """{"model_args": GPTConfig's fields, "model": state_dict} of a CausalLM that nanoGPT's GPT
    expresses, the tensors torch tensors (copied) in the model's dtype under nanoGPT's names
    (lm_head.weight is transformer.wte.weight, tied); `torch.save` it as a ckpt.pt for
    nanoGPT's sample.py, or GPT(GPTConfig(**d["model_args"])).load_state_dict(d["model"]).
    (nanoGPT's non-flash attention also keeps causal-mask buffers: load with strict=False there.)
    ValueError naming the first option nanoGPT cannot express (nanoGPT: learned positions, pre-LN,
    exact GELU, 4 d_model feed-forward, eps 1e-5, tied output layer, LayerNorm, one dropout rate,
    none after the activation, no pad_idx, full multi-head attention)."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"to_nanogpt: expected an npformer CausalLM, got {type(model).__name__}")
    c = model.config
    dropout = c["dropout"]
    # activation_dropout None means `dropout`: nanoGPT has none inside its MLP
    no_activation_dropout = (0.0, None) if dropout == 0 else (0.0,)
    for name, allowed in (("positional", ("learned",)), ("norm_first", (True,)), ("activation", ("gelu",)),
                          ("dim_feedforward", (4 * c["d_model"],)), ("layer_norm_eps", (1e-5,)),
                          ("tie_weights", (True,)), ("pad_idx", (None,)), ("norm", ("layernorm",)),
                          ("num_kv_heads", (None, c["nhead"])), ("sliding_window", (None,)),
                          ("qkv_bias", (None, c.get("bias", True))), ("attention_dropout", (None, dropout)),
                          ("activation_dropout", no_activation_dropout)):
        if c.get(name) not in allowed:
            raise ValueError(f"to_nanogpt: CausalLM({name}={c.get(name)!r}) has no nanoGPT counterpart (nanoGPT: "
                             f"{name} in {list(dict.fromkeys(allowed))})")
    torch = _torch()
    state = model.state_dict()
    tensors = {theirs: torch.tensor(state[ours]) for theirs, ours in _pairs(c["num_layers"], c.get("bias", True))}
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"]  # tied, as nanoGPT's state_dict lists it
    model_args = dict(n_layer=c["num_layers"], n_head=c["nhead"], n_embd=c["d_model"], block_size=c["max_len"],
                      bias=c.get("bias", True), vocab_size=c["vocab_size"], dropout=dropout)
    return {"model_args": model_args, "model": tensors}
