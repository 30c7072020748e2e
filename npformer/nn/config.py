"""TransformerConfig: every architecture setting of the Transformer modules, named in one place.

Like nanoGPT's GPTConfig and Hugging Face's PretrainedConfig, one dataclass holds the settings,
is checked once when it is made, and is passed whole to nn.Transformer, the encoder and decoder
layers and every MultiheadAttention (each keeps it as `module.config`). The torch-compatible
constructors (nn.Transformer(d_model=..., nhead=...), nn.TransformerEncoderLayer(d_model, nhead,
...), nn.MultiheadAttention(embed_dim, num_heads, ...)) build one from their arguments; each also
takes `config=` instead:

    config = nn.TransformerConfig(d_model=256, nhead=4, norm_first=True, memory_efficient=True, block_size=128)
    model = nn.Transformer(config=config)   # every layer and attention module gets `config`

`to_dict()` / `from_dict()` convert to and from plain JSON values. `from_dict` is strict: an
unknown key or a value of the wrong type is an error; an activation is a name from
`ACTIVATIONS` (a callable activation can be used in code but not stored).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import npformer.functional as F
from autograd import Tensor, backend
from autograd.checks import check_bool, check_float_dtype, check_int, check_real, is_real

# gelu: exact; gelu_tanh: GPT-2's "gelu_new"; silu: x sigmoid(x); swiglu: a gated feed-forward
# linear2(silu(linear1 x) * linear3 x) (Llama's w2(silu(w1 x) * w3 x))
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu")
NORMS = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The architecture of a Transformer stack (defaults: torch.nn.Transformer's, the paper's base model).

    d_model, nhead: model width and heads (d_model divisible by nhead); num_encoder_layers,
    num_decoder_layers: layers per stack (>= 0: a decoder-only model has no decoder layers);
    dim_feedforward: the feed-forward width. dropout: on each sublayer's output (and, unless
    given, on the attention probabilities and after the feed-forward activation:
    attention_dropout, activation_dropout, None = `dropout`). activation: "relu", "gelu",
    "gelu_tanh" or a callable (not storable by to_dict). layer_norm_eps, norm_first (pre-LN),
    bias (linear and LayerNorm biases), as torch's. activation "silu" is x sigmoid(x); "swiglu"
    makes the feed-forward gated, linear2(dropout(silu(linear1 x) * linear3 x)) (Llama's
    w2(silu(w1 x) * w3 x), a third d_model x dim_feedforward matrix linear3). norm: "layernorm"
    or "rmsnorm" (nn.RMSNorm with eps=layer_norm_eps, no bias) for every norm of the layers and
    stacks. num_kv_heads: the key/value heads of grouped-query attention (None = nhead; 1 =
    multi-query), each shared by nhead / num_kv_heads query heads, so nhead must be divisible by
    it. sliding_window: None, or W >= 1: causal self-attention sees the last W positions only
    (Mistral's), and the KV cache keeps no more. qkv_bias: whether the q, k, v projections have
    a bias (None = `bias`; Qwen2 has bias=False, qkv_bias=True). rotary: RoPE in self-attention,
    with rotary_base. Attention paths: memory_efficient (blockwise, blocks of block_size keys) and
    attention_backend (None, "naive", "memory_efficient", "flash": see
    F.scaled_dot_product_attention). batch_first must be True (npformer is batch-first).
    device ("cpu", "cuda", "test" or None: cpu) and dtype (a floating dtype name or None:
    float32) are where the parameters are created.
    Every value is checked when the config is made (TypeError / ValueError naming it); numbers
    are stored as plain ints and floats, dtype by its name. Frozen: derive variants with
    dataclasses.replace(config, ...). `config["name"]` reads a setting like the dict it replaces.
    """

    d_model: int = 512
    nhead: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    activation: str | Callable[[Tensor], Tensor] = "relu"
    layer_norm_eps: float = 1e-5
    norm_first: bool = False
    bias: bool = True
    norm: str = "layernorm"
    num_kv_heads: int | None = None
    sliding_window: int | None = None
    qkv_bias: bool | None = None
    rotary: bool = False
    rotary_base: float = 10000.0
    memory_efficient: bool = False
    block_size: int = 512
    attention_backend: str | None = None
    batch_first: bool = True
    device: str | None = None
    dtype: str | None = None

    def __post_init__(self):
        for name, value in _checked({name: getattr(self, name) for name in _FIELDS}, "TransformerConfig", {}).items():
            object.__setattr__(self, name, value)

    def __getitem__(self, name: str) -> Any:
        """config["d_model"]: a setting by name (KeyError for an unknown one), as the dict it replaces."""
        if name not in _FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def __deepcopy__(self, memo: dict) -> TransformerConfig:
        return self  # frozen: the deep copies of a layer share their config

    @property
    def attention_dropout_p(self) -> float:
        """The dropout probability on attention weights: attention_dropout, or dropout when it is None."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads: num_kv_heads, or nhead when it is None."""
        return self.nhead if self.num_kv_heads is None else self.num_kv_heads

    @property
    def qkv_bias_p(self) -> bool:
        """Whether the q, k, v projections have a bias: qkv_bias, or bias when it is None."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def activation_dropout_p(self) -> float:
        """The dropout probability after the feed-forward activation: activation_dropout, or dropout."""
        return self.dropout if self.activation_dropout is None else self.activation_dropout

    def to_dict(self) -> dict[str, Any]:
        """{setting: value} of plain JSON values (from_dict(to_dict()) == self). ValueError when the
        activation is a callable: only names from ACTIVATIONS can be stored."""
        if callable(self.activation):
            raise ValueError(f"TransformerConfig.to_dict: activation {self.activation!r} is a callable, which "
                             f"cannot be stored; use one of {ACTIVATIONS}")
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        """The config of a dict written by to_dict (missing settings take their defaults).
        TypeError for a non-dict, ValueError naming unknown keys, TypeError / ValueError for a
        value of the wrong type or out of range; an activation must be a name (never a callable)."""
        if not isinstance(values, dict):
            raise TypeError(f"TransformerConfig.from_dict: expected a dict, got {type(values).__name__}")
        unknown = sorted(str(k) for k in values if k not in _FIELDS)
        if unknown:
            raise ValueError(f"TransformerConfig.from_dict: unknown settings {unknown}; expected some of {list(_FIELDS)}")
        activation = values.get("activation", "relu")
        if not isinstance(activation, str):
            raise TypeError(f"TransformerConfig.from_dict: activation must be one of {ACTIVATIONS}, got "
                            f"{activation!r} of type {type(activation).__name__}")
        return cls(**values)

    @classmethod
    def from_arguments(cls, config: TransformerConfig | None, owner: str, function: Callable | None = None,
                       names: dict[str, str] | None = None, **settings: Any) -> TransformerConfig:
        """The config of a torch-compatible constructor `function` (named `owner` in errors): `config`
        when given (then every setting argument must be left at its default: TypeError naming the
        ones that were not), else a config of `settings` ({field: argument value}), checked with
        errors that name the arguments as the constructor spells them (`names`: {field: argument})."""
        names = names or {}
        if config is None:
            missing = [names.get(k, k) for k, v in settings.items() if v is None and _DEFAULTS[k] is not None]
            if missing:
                raise TypeError(f"{owner}: missing {', '.join(missing)} (or pass config=TransformerConfig(...))")
            return cls._of_checked(_checked(settings, owner, names))
        if not isinstance(config, cls):
            raise TypeError(f"{owner}: config must be a TransformerConfig, got {type(config).__name__}")
        defaults = _defaults(function)
        given = [names.get(k, k) for k, v in settings.items() if not _same(v, defaults[names.get(k, k)])]
        if given:
            raise TypeError(f"{owner}: pass the settings either in config= or as arguments, not both "
                            f"(got config= and {', '.join(given)}); use dataclasses.replace(config, ...)")
        return config

    @classmethod
    def _of_checked(cls, settings: dict[str, Any]) -> TransformerConfig:
        """The config of `settings` that _checked has already checked and normalised (the other
        fields at their defaults), made without __post_init__, which would check them again."""
        unknown = [name for name in settings if name not in _FIELDS]
        if unknown:  # as the dataclass's __init__ words it
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}")
        config = object.__new__(cls)
        for name in _FIELDS:
            object.__setattr__(config, name, settings.get(name, _DEFAULTS[name]))
        return config


# how and where the modules run, not what they compute: files leave them out (their weights load anywhere)
RUNTIME_SETTINGS = ("memory_efficient", "block_size", "attention_backend", "device", "dtype")


def stored_config(module: Any) -> dict[str, Any] | None:
    """`module.config` as checkpoints and safetensors metadata store it: a model's config dict as
    it is; a TransformerConfig as to_dict() without RUNTIME_SETTINGS (so the dicts nn.Transformer
    stored before TransformerConfig, the same keys minus the newer ones, read the same); None
    for a module without a config, or with a callable activation (which no file can hold)."""
    config = getattr(module, "config", None)
    if isinstance(config, dict):
        return config
    if not isinstance(config, TransformerConfig) or callable(config.activation):
        return None
    return {k: v for k, v in config.to_dict().items() if k not in RUNTIME_SETTINGS}


_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}


@functools.lru_cache(maxsize=None)
def _defaults(function):
    """{argument: default} of a constructor's signature."""
    return {name: p.default for name, p in inspect.signature(function).parameters.items()}


def _same(a, b):
    """Equal values of one type (numbers compare by value: 8, 8.0, np.int64(8))."""
    if a is b:
        return True
    if is_real(a) and is_real(b):
        return a == b
    return type(a) is type(b) and a == b


def check_d_model_nhead(d_model: Any, nhead: Any, owner: str, names: dict[str, str] | None = None) -> tuple[int, int]:
    """(d_model, nhead) as ints >= 1, d_model divisible by nhead; errors name `owner` and the
    two arguments (names: {"d_model": ..., "nhead": ...} when the caller spells them otherwise)."""
    names = names or {}
    d, h = names.get("d_model", "d_model"), names.get("nhead", "nhead")
    d_model, nhead = check_int(d_model, d, owner, at_least=1), check_int(nhead, h, owner, at_least=1)
    if d_model % nhead:
        choices = [n for n in range(1, min(d_model, 64) + 1) if d_model % n == 0]
        raise ValueError(f"{owner}: {d}={d_model} is not divisible by {h}={nhead}; each head gets {d} / {h} "
                         f"features, so {d}={d_model} must be divisible by {h}={nhead}: choose e.g. {h} in {choices}")
    return d_model, nhead


def check_num_kv_heads(nhead: int, num_kv_heads: Any, owner: str, names: dict[str, str] | None = None) -> int:
    """num_kv_heads as an int >= 1 that divides nhead (each key/value head serves nhead /
    num_kv_heads query heads); errors name `owner` and the arguments (as `names` spells them)."""
    names = names or {}
    k, h = names.get("num_kv_heads", "num_kv_heads"), names.get("nhead", "nhead")
    num_kv_heads = check_int(num_kv_heads, k, owner, at_least=1)
    if nhead % num_kv_heads:
        choices = [n for n in range(1, nhead + 1) if nhead % n == 0]
        raise ValueError(f"{owner}: {h}={nhead} is not divisible by {k}={num_kv_heads}; each key/value head is "
                         f"shared by {h} / {k} query heads, so {k} must divide {h}: choose {k} in {choices}")
    return num_kv_heads


def _checked(settings, owner, names):
    """`settings` ({field: value}, any subset of the fields) checked and normalised; errors name
    `owner` and each field as names[field] (default: the field's name)."""
    def name(field):
        return names.get(field, field)
    out = dict(settings)
    if "d_model" in out or "nhead" in out:
        out["d_model"], out["nhead"] = check_d_model_nhead(out.get("d_model", _DEFAULTS["d_model"]),
                                                            out.get("nhead", _DEFAULTS["nhead"]), owner, names)
    for field in ("num_encoder_layers", "num_decoder_layers"):
        if field in out:
            out[field] = check_int(out[field], name(field), owner, at_least=0)
    for field in ("dim_feedforward", "block_size"):
        if field in out:
            out[field] = check_int(out[field], name(field), owner, at_least=1)
    for field in ("dropout", "attention_dropout", "activation_dropout"):
        if out.get(field) is not None or field == "dropout" and field in out:
            out[field] = check_real(out[field], name(field), owner, at_least=0, at_most=1)
    for field in ("layer_norm_eps", "rotary_base"):
        if field in out:
            out[field] = check_real(out[field], name(field), owner, above=0)
    for field in ("norm_first", "bias", "rotary", "memory_efficient", "batch_first"):
        if field in out:
            out[field] = check_bool(out[field], name(field), owner)
    if out.get("qkv_bias") is not None:
        out["qkv_bias"] = check_bool(out["qkv_bias"], name("qkv_bias"), owner)
    if out.get("sliding_window") is not None:
        out["sliding_window"] = check_int(out["sliding_window"], name("sliding_window"), owner, at_least=1)
    if out.get("num_kv_heads") is not None:
        out["num_kv_heads"] = check_num_kv_heads(out.get("nhead", _DEFAULTS["nhead"]), out["num_kv_heads"], owner,
                                                 names)
    if "norm" in out and out["norm"] not in NORMS:
        raise ValueError(f"{owner}: {name('norm')} must be one of {NORMS}, got {out['norm']!r}")
    if out.get("batch_first") is False:
        raise ValueError(f"{owner}: npformer is batch-first only; pass {name('batch_first')}=True and inputs "
                         f"shaped (batch, seq, feature)")
    activation = out.get("activation", "relu")
    if not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: {name('activation')} must be one of {ACTIVATIONS} or a callable, got {activation!r}")
    if out.get("attention_backend") not in (None,) + F.attention.BACKENDS:
        raise ValueError(f"{owner}: {name('attention_backend')} must be None or one of {F.attention.BACKENDS}, "
                         f"got {out['attention_backend']!r}")
    if out.get("device") is not None and out["device"] not in backend.DEVICES:
        raise ValueError(f"{owner}: {name('device')} must be None or one of {backend.DEVICES}, got {out['device']!r}")
    if out.get("dtype") is not None:
        out["dtype"] = _dtype_name(out["dtype"], name("dtype"), owner)
    return out


def _dtype_name(dtype, name, owner):
    """A floating dtype (a dtype, a scalar type or a name) as its name, e.g. "float32"."""
    return check_float_dtype(dtype, name, owner).name
