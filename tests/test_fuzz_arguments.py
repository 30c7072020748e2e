"""A property-based fuzz of the public API's argument checking. Each target is a public call
with valid keyword arguments; one argument at a time is swapped for a value drawn from its kind:
numpy scalars of every width carrying the valid value (which must be accepted like the Python
number), and adversarial values (wrong types, bools, NaN/inf, negative, zero and huge sizes,
wrong shapes, ranks and dtypes, non-contiguous and empty arrays, tensors on the "test" device).

The property: the call succeeds with finite results (for the numpy-scalar spellings of valid
values, also results of the same shapes as the plain call, and a gradient for every input that
requires one), or raises TypeError / ValueError (or the documented IndexError for ids and dims,
RuntimeError for devices) whose message names the function or the argument. Never another
exception type, never an error from deep inside numpy that names neither."""
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

import npformer
import npformer.functional as F
from autograd import Tensor, backend
from npformer import decoding, nn, optim
from npformer.models import CausalLM, EncoderClassifier, Seq2SeqTransformer

from helpers import HYPOTHESIS

INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOAT_TYPES = [np.float16, np.float32, np.float64]
NAN, INF = float("nan"), float("inf")
BAD_INTS = ["3", None, [3], {"n": 3}, 3 + 0j, True, False, np.bool_(True), 3.0, 3.5, NAN, INF, -1, 0, -2**63,
            np.float32(3.0)]
BAD_REALS = ["0.1", None, [0.1], {"x": 0.1}, 0.1 + 0j, True, np.bool_(False), NAN, INF, -INF, -1.0, 0.0, 1e308,
             -1e308, 2**63, -2**63, np.float64(NAN), np.float32(INF)]
BAD_BOOLS = ["True", None, 1, 0, 1.0, [True], np.int64(1)]
BAD_STRS = [None, 1, 1.5, True, ["relu"], "", "no-such-choice", b"relu"]
ALLOWED = (TypeError, ValueError, IndexError, RuntimeError)   # IndexError: ids, dims; RuntimeError: devices


def rng_floats(*shape, dtype=np.float64, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def ids(*shape, high=5, seed=0):
    return np.random.default_rng(seed).integers(0, high, shape)


def numpy_ints(value):
    return [t(value) for t in INT_TYPES if np.iinfo(t).min <= value <= np.iinfo(t).max]


def numpy_reals(value):
    """The value in every float width that holds it (to float16 rounding), and in every integer
    type when it is integral: valid spellings of a valid real."""
    out = [t(value) for t in FLOAT_TYPES if value == 0 or abs(float(t(value)) - value) <= 1e-3 * abs(value)]
    return out + (numpy_ints(int(value)) if float(value).is_integer() else [])


def array_variants(a, device_ok=True):
    """Valid spellings of array `a` (numpy-contiguous copies aside: a strided view, a Tensor) and
    adversarial ones; returns (valid, adversarial)."""
    wide = np.repeat(a, 2, axis=-1) if a.ndim else a
    strided = wide[..., ::2] if a.ndim else a
    valid = [strided, Tensor(a), np.asfortranarray(a)]
    with np.errstate(invalid="ignore"):                            # -inf mask entries cast to int
        bad = [a.astype(np.float16) if a.dtype.kind == "f" else a.astype(np.float64),
           a.astype(np.int64) if a.dtype.kind == "f" else a.astype(np.float32),
           a.astype(object), a.astype(bool), a.astype(np.complex128),
               a[None], a.reshape(-1) if a.ndim > 1 else a[None, None], a[..., :0], a[:0] if a.ndim else a,
               np.concatenate([a, a], axis=-1) if a.ndim else a, a.tolist(), "array", None, 3, {"a": 1}]
    if device_ok:
        bad.append(Tensor(a, device="test"))
    return valid, bad


class Arg:
    """One argument: `kind` is int, real, bool, str, array or ids; `valid` its value in the plain call."""

    def __init__(self, kind, valid, choices=()):
        self.kind, self.valid, self.choices = kind, valid, choices

    def variants(self):
        """(valid spellings, adversarial values)."""
        if self.kind == "int":
            return numpy_ints(self.valid), BAD_INTS
        if self.kind == "real":
            return numpy_reals(self.valid), BAD_REALS
        if self.kind == "bool":
            return [np.bool_(self.valid)], BAD_BOOLS
        if self.kind == "str":
            return list(self.choices), BAD_STRS
        if self.kind == "array":
            return array_variants(self.valid)
        if self.kind == "ids":
            valid, bad = array_variants(self.valid)
            return valid[:1] + [self.valid.astype(t) for t in INT_TYPES], bad + [self.valid + 100, self.valid - 100]
        raise AssertionError(self.kind)


class Target:
    """A public call: `run(**kwargs)` with `args` (name: Arg) as its valid keyword arguments."""

    def __init__(self, name, run, **args):
        self.name, self.run, self.args = name, run, args

    def __repr__(self):
        return self.name

    def call(self, **overrides):
        kwargs = {k: a.valid for k, a in self.args.items()}
        kwargs.update(overrides)
        return self.run(**kwargs)


def leaves(kwargs):
    """Float leaves requiring grad for the raw float arrays among kwargs (others unchanged)."""
    return {k: Tensor(v, requires_grad=True) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
            for k, v in kwargs.items()}


def tensors(kwargs):
    """Module forwards take Tensors: raw float arrays among kwargs wrapped (others unchanged)."""
    return {k: Tensor(v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v for k, v in kwargs.items()}


def forward(module_factory, inputs):
    """run(**kwargs): build the module from the constructor kwargs, apply it to `inputs()`."""
    def run(**kwargs):
        model = module_factory(**kwargs)
        return model(*inputs())
    return run


def x32(*shape):
    return Tensor(rng_floats(*shape, dtype=np.float32))


def params():
    layer = nn.Linear(3, 2)
    layer(x32(4, 3)).sum().backward()
    return list(layer.parameters())


def optimizer_step(cls):
    def run(**kwargs):
        opt = cls(params(), **kwargs)
        opt.step()
        return [p.data for group in opt.param_groups for p in group["params"]]
    return run


def scheduler_steps(cls):
    def run(**kwargs):
        sched = cls(optim.SGD(params(), lr=0.1), **kwargs)
        for _ in range(3):
            sched.step()
        return np.array(sched.get_last_lr())
    return run


def clip(**kwargs):
    ps = params()
    total = optim.clip_grad_norm_(ps, **kwargs)
    return [total] + [p.grad for p in ps]


SMALL_LM = dict(d_model=8, nhead=2, num_layers=1, dim_feedforward=16, dropout=0.0)
SMALL_S2S = dict(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0,
                 max_len=16)


def seq2seq():
    npformer.manual_seed(0)                                        # one model: decoded lengths comparable
    return Seq2SeqTransformer(10, 12, **SMALL_S2S)


def lm():
    npformer.manual_seed(0)
    return CausalLM(10, max_len=16, **SMALL_LM)


def sdpa(**kwargs):
    return F.scaled_dot_product_attention(**kwargs)


def sample(**kwargs):
    return decoding.sample_logits(rng=np.random.default_rng(0), **kwargs)


A, I, R, B, S, ID = (lambda v: Arg("array", v), lambda v: Arg("int", v), lambda v: Arg("real", v),
                     lambda v: Arg("bool", v), lambda v, *c: Arg("str", v, c), lambda v: Arg("ids", v))
QKV = rng_floats(2, 2, 4, 8)

TARGETS = [
    Target("F.linear", F.linear, input=A(rng_floats(2, 3)), weight=A(rng_floats(4, 3, seed=1)),
           bias=A(rng_floats(4, seed=2)), activation=S(None, "relu", "gelu")),
    Target("F.layer_norm", F.layer_norm, input=A(rng_floats(2, 4)), normalized_shape=I(4),
           weight=A(rng_floats(4, seed=1)), bias=A(rng_floats(4, seed=2)), eps=R(1e-5)),
    Target("F.rms_norm", F.rms_norm, input=A(rng_floats(2, 4)), normalized_shape=I(4),
           weight=A(rng_floats(4, seed=1)), eps=R(1e-5)),
    Target("F.softmax", F.softmax, input=A(rng_floats(2, 4)), dim=I(-1)),
    Target("F.log_softmax", F.log_softmax, input=A(rng_floats(2, 4)), dim=I(1)),
    Target("F.cross_entropy", F.cross_entropy, input=A(rng_floats(3, 4)), target=ID(ids(3, high=4)),
           weight=A(np.array([1.0, 0.5, 2.0, 1.0])), ignore_index=I(-100), reduction=S("mean", "sum", "none"),
           label_smoothing=R(0.1)),
    Target("F.dropout", F.dropout, input=A(rng_floats(2, 4)), p=R(0.25), training=B(True)),
    Target("F.embedding", F.embedding, input=ID(ids(2, 3)), weight=A(rng_floats(5, 3)), padding_idx=I(1),
           max_norm=R(1.0), norm_type=R(2.0), scale_grad_by_freq=B(False)),
    Target("F.gelu", F.gelu, input=A(rng_floats(2, 4)), approximate=S("none", "tanh")),
    Target("F.relu", F.relu, input=A(rng_floats(2, 4))),
    Target("F.silu", F.silu, input=A(rng_floats(2, 4))),
    Target("F.swiglu", F.swiglu, gate=A(rng_floats(2, 4)), up=A(rng_floats(2, 4, seed=1))),
    Target("F.scaled_dot_product_attention", sdpa, query=A(QKV), key=A(rng_floats(2, 2, 4, 8, seed=1)),
           value=A(rng_floats(2, 2, 4, 8, seed=2)), attn_mask=A(np.tril(np.ones((4, 4), bool))),
           dropout_p=R(0.0), is_causal=B(False), scale=R(0.5)),
    Target("F.scaled_dot_product_attention(memory_efficient)",
           lambda **kw: F.scaled_dot_product_attention(QKV, QKV, QKV, memory_efficient=True, **kw),
           block_size=I(2), dropout_p=R(0.0), scale=R(0.5), is_causal=B(True)),
    Target("F.split_heads", F.split_heads, input=A(rng_floats(2, 4, 12)), num_heads=I(2), chunks=I(3)),
    Target("F.rotary_cos_sin", F.rotary_cos_sin, seq_len=I(4), head_dim=I(8), base=R(10000.0),
           dtype=S("float32", "float64")),
    Target("F.apply_rotary_emb", F.apply_rotary_emb, x=A(QKV), cos=A(F.rotary_cos_sin(4, 8, dtype="float64")[0]),
           sin=A(F.rotary_cos_sin(4, 8, dtype="float64")[1])),
    Target("nn.Linear", forward(nn.Linear, lambda: [x32(2, 3)]), in_features=I(3), out_features=I(4), bias=B(True)),
    Target("nn.LayerNorm", forward(nn.LayerNorm, lambda: [x32(2, 4)]), normalized_shape=I(4), eps=R(1e-5),
           elementwise_affine=B(True)),
    Target("nn.RMSNorm", forward(nn.RMSNorm, lambda: [x32(2, 4)]), normalized_shape=I(4), eps=R(1e-5),
           elementwise_affine=B(True)),
    Target("nn.SwiGLU", forward(nn.SwiGLU, lambda: [x32(2, 4)]), in_features=I(4), hidden_features=I(6),
           out_features=I(3), bias=B(False)),
    Target("nn.Embedding", forward(nn.Embedding, lambda: [ids(2, 3)]), num_embeddings=I(5), embedding_dim=I(3),
           padding_idx=I(0)),
    Target("nn.Dropout", forward(nn.Dropout, lambda: [x32(2, 4)]), p=R(0.5)),
    Target("nn.MultiheadAttention", forward(nn.MultiheadAttention, lambda: [x32(2, 4, 8)] * 3), embed_dim=I(8),
           num_heads=I(2), dropout=R(0.0), block_size=I(512), rotary_base=R(10000.0)),
    Target("nn.MultiheadAttention.forward", lambda **kw: nn.MultiheadAttention(8, 2).double()(**tensors(kw))[0],
           query=A(rng_floats(2, 4, 8)), key=A(rng_floats(2, 5, 8, seed=1)), value=A(rng_floats(2, 5, 8, seed=2)),
           key_padding_mask=A(np.array([[False] * 5, [False] * 4 + [True]])), need_weights=B(True),
           attn_mask=A(np.zeros((4, 5))), is_causal=B(False)),
    Target("nn.TransformerEncoderLayer", forward(nn.TransformerEncoderLayer, lambda: [x32(2, 4, 8)]), d_model=I(8),
           nhead=I(2), dim_feedforward=I(16), dropout=R(0.0), layer_norm_eps=R(1e-5), activation=S("relu", "gelu"),
           norm_first=B(False)),
    Target("nn.Transformer", forward(nn.Transformer, lambda: [x32(2, 4, 8), x32(2, 3, 8)]), d_model=I(8), nhead=I(2),
           num_encoder_layers=I(1), num_decoder_layers=I(1), dim_feedforward=I(16), dropout=R(0.0),
           layer_norm_eps=R(1e-5)),
    Target("nn.Transformer.forward", lambda **kw: nn.Transformer(
        **{k: v for k, v in SMALL_S2S.items() if k != "max_len"}).double()(**tensors(kw)),
           src=A(rng_floats(2, 4, 8)), tgt=A(rng_floats(2, 3, 8, seed=1)),
           tgt_mask=A(np.triu(np.full((3, 3), -np.inf), 1)), src_key_padding_mask=A(np.zeros((2, 4), bool))),
    Target("nn.SinusoidalPositionalEncoding", lambda offset=0, **kw: nn.SinusoidalPositionalEncoding(**kw)(
        x32(2, 4, 8), offset=offset), d_model=I(8), max_len=I(16)),
    Target("nn.SinusoidalPositionalEncoding.forward",
           lambda **kw: nn.SinusoidalPositionalEncoding(8, 16)(Tensor(rng_floats(2, 4, 8, dtype=np.float32)), **kw),
           offset=I(3)),
    Target("nn.LearnedPositionalEmbedding", lambda **kw: nn.LearnedPositionalEmbedding(**kw)(x32(2, 4, 8)),
           max_len=I(16), d_model=I(8)),
    Target("nn.LearnedPositionalEmbedding.forward",
           lambda **kw: nn.LearnedPositionalEmbedding(16, 8)(x32(2, 4, 8), **kw), offset=I(2)),
    Target("nn.RotaryEmbedding", lambda **kw: nn.RotaryEmbedding(**kw)(x32(2, 2, 4, 8)), head_dim=I(8),
           base=R(10000.0)),
    Target("nn.RotaryEmbedding.forward", lambda **kw: nn.RotaryEmbedding(8)(x32(2, 2, 4, 8), **kw), offset=I(2)),
    Target("optim.Adam", optimizer_step(optim.Adam), lr=R(1e-3), eps=R(1e-8), weight_decay=R(0.0)),
    Target("optim.Adam(betas)", lambda b1, b2: optimizer_step(optim.Adam)(betas=(b1, b2)), b1=R(0.9), b2=R(0.999)),
    Target("optim.AdamW", optimizer_step(optim.AdamW), lr=R(1e-3), eps=R(1e-8), weight_decay=R(0.01)),
    Target("optim.SGD", optimizer_step(optim.SGD), lr=R(0.1), momentum=R(0.9), dampening=R(0.0),
           weight_decay=R(0.0), nesterov=B(True)),
    Target("optim.NoamLR", scheduler_steps(optim.NoamLR), d_model=I(8), warmup_steps=I(4)),
    Target("optim.WarmupCosineLR", scheduler_steps(optim.WarmupCosineLR), warmup_steps=I(2), total_steps=I(10),
           min_ratio=R(0.1)),
    Target("optim.clip_grad_norm_", clip, max_norm=R(1.0), norm_type=R(2.0), error_if_nonfinite=B(False)),
    Target("decoding.greedy_decode", lambda **kw: decoding.greedy_decode(seq2seq(), **kw), src=ID(ids(2, 3, high=10)),
           max_len=I(4), bos=I(1), eos=I(2), pad=I(0), use_cache=B(True)),
    Target("decoding.beam_search", lambda **kw: decoding.beam_search(seq2seq(), **kw), src=ID(ids(1, 3, high=10)),
           max_len=I(4), beam_size=I(2), length_penalty=R(0.6), bos=I(1), eos=I(2), pad=I(0)),
    Target("decoding.generate", lambda **kw: decoding.generate(lm(), **kw), ids=ID(ids(2, 3, high=10)),
           max_new_tokens=I(3), temperature=R(0.8), top_k=I(4), top_p=R(0.9), eos=I(2), seed=I(0)),
    Target("decoding.sample_logits", sample, logits=A(rng_floats(2, 10)), temperature=R(0.8), top_k=I(4),
           top_p=R(0.9)),
    Target("models.CausalLM", lambda **kw: CausalLM(**kw)(ids(2, 3, high=10)), vocab_size=I(10), d_model=I(8),
           nhead=I(2), num_layers=I(1), dim_feedforward=I(16), dropout=R(0.0), max_len=I(16), pad_idx=I(0),
           layer_norm_eps=R(1e-5), positional=S("learned", "sinusoidal", "rope")),
    Target("models.CausalLM.forward", lambda **kw: lm()(**kw), input_ids=ID(ids(2, 3, high=10)),
           key_padding_mask=A(np.zeros((2, 3), bool))),
    Target("models.Seq2SeqTransformer", lambda **kw: Seq2SeqTransformer(**kw)(ids(2, 3, high=10), ids(2, 2, high=10)),
           src_vocab_size=I(10), tgt_vocab_size=I(12), d_model=I(8), nhead=I(2), num_encoder_layers=I(1),
           num_decoder_layers=I(1), dim_feedforward=I(16), dropout=R(0.0), max_len=I(16), pad_idx=I(0),
           layer_norm_eps=R(1e-5)),
    Target("models.Seq2SeqTransformer.forward", lambda **kw: seq2seq()(**kw), src=ID(ids(2, 3, high=10)),
           tgt=ID(ids(2, 2, high=12))),
    Target("models.EncoderClassifier", lambda **kw: EncoderClassifier(**kw)(ids(2, 3, high=10)), vocab_size=I(10),
           num_classes=I(3), d_model=I(8), nhead=I(2), num_layers=I(1), dim_feedforward=I(16), dropout=R(0.0),
           max_len=I(16), pad_idx=I(0), layer_norm_eps=R(1e-5), pooling=S("mean", "first")),
]


def results(out):
    """The arrays of a result (Tensors, arrays, numbers, tuples and lists of them)."""
    if isinstance(out, (tuple, list)):
        return [r for o in out for r in results(o)]
    if isinstance(out, Tensor):
        return [backend.as_numpy(out.data)]
    if out is None:
        return []
    return [np.asarray(backend.as_numpy(out) if backend.is_array(out) else out)]


def finite(out):
    return all(not a.dtype.kind in "fc" or np.isfinite(a).all() for a in results(out))


def shapes(out):
    return [a.shape for a in results(out)]


def check_gradients(out, kwargs):
    """Backpropagate a float Tensor output: every leaf among kwargs gets a finite gradient of its shape."""
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, Tensor) and o.requires_grad]
    if not outs:
        return
    sum(o.sum() for o in outs).backward()
    for name, v in kwargs.items():
        if isinstance(v, Tensor) and v.requires_grad:
            assert v.grad is not None, f"no gradient for {name}"
            grad = v.grad.numpy()
            assert grad.shape == v.shape and np.isfinite(grad).all(), f"gradient of {name}: {grad.shape}, {grad}"


def short(value):
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


CONSTANTS = {("F.cross_entropy", "weight"), ("F.apply_rotary_emb", "cos"), ("F.apply_rotary_emb", "sin")}


def run_case(target, name, value, valid):
    """The property for target called with `name=value`; returns the outcome's description."""
    words = {name, target.name.split(".")[-1].split("(")[0], target.name.split(".")[1].split("(")[0]}
    overrides = {name: value}
    if target.name.startswith("F.") and valid and (target.name, name) not in CONSTANTS:
        overrides = leaves(overrides)
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():   # extreme values may overflow
            warnings.simplefilter("ignore")
            out = target.call(**overrides)
    except ALLOWED as error:
        message = str(error)
        assert not valid, f"{target}({name}={short(value)}) refused a valid value: {type(error).__name__}: {message}"
        assert type(error).__module__ in ("builtins", "npformer.checkpoint"), type(error)
        assert any(w.lower() in message.lower() for w in words) or "device" in message or "dtype" in message, (
            f"{target}({name}={short(value)}): {type(error).__name__} names neither the function nor the "
            f"argument: {message}")
        return f"refused: {type(error).__name__}"
    extreme = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 1e18
    assert extreme or finite(out), f"{target}({name}={short(value)}) returned a non-finite result"
    if valid and target.args[name].kind != "str":               # another choice may change the shape
        assert shapes(out) == shapes(target.call()), f"{target}({name}={short(value)}): shapes differ"
        check_gradients(out, overrides)
    return "accepted"


# found by this fuzz and still open (reported): rotary_cos_sin passes `dtype` to numpy unchecked; beam_search's
# length ** length_penalty overflows (OverflowError, ZeroDivisionError) for |length_penalty| ~ 1e18 and more;
# CausalLM with input_ids longer than the key_padding_mask (under investigation)
OPEN = {("decoding.beam_search", "length_penalty"), ("models.CausalLM.forward", "input_ids")}
CASES = [(t, name, value, valid) for t in TARGETS for name, arg in t.args.items() if (t.name, name) not in OPEN
         for valid, values in zip((True, False), arg.variants()) for value in values]


@HYPOTHESIS
@given(case=st.sampled_from(CASES))
def test_public_calls_accept_valid_spellings_and_refuse_bad_arguments_clearly(case):
    run_case(*case)


def test_every_target_runs_with_its_valid_arguments():
    for target in TARGETS:
        out = target.call()
        assert finite(out), target


# -- regressions found by the fuzz -----------------------------------------------------------------------------
@pytest.mark.parametrize("table", [None, "cos", {"a": 1}, np.ones((4, 4), np.int64)])
def test_apply_rotary_emb_refuses_a_table_that_is_not_floating(table):
    """None became a NaN table (a silent NaN output); strings and dicts failed inside numpy."""
    cos, sin = F.rotary_cos_sin(4, 8, dtype="float64")
    with pytest.raises(TypeError, match=r"apply_rotary_emb: cos must be a floating array .*got dtype"):
        F.apply_rotary_emb(QKV, table, sin)


@pytest.mark.parametrize("module", [nn.SinusoidalPositionalEncoding(8, 16), nn.LearnedPositionalEmbedding(16, 8),
                                    nn.RotaryEmbedding(8)], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("offset, error", [(3.0, TypeError), ("3", TypeError), (None, TypeError), (True, TypeError),
                                           (-1, ValueError)])
def test_positional_offset_is_checked(module, offset, error):
    """A float offset failed in slicing ("slice indices must be integers"), a str in a comparison."""
    x = x32(2, 2, 4, 8) if isinstance(module, nn.RotaryEmbedding) else x32(2, 4, 8)
    with pytest.raises(error, match=rf"{type(module).__name__}: offset must be an integer >= 0"):
        module(x, offset=offset)
    assert module(x, offset=np.uint8(2)).shape == x.shape


@pytest.mark.parametrize("logits", [None, [[0.1, 0.2]], "logits", np.zeros((2, 0))])
def test_sample_logits_refuses_non_arrays_and_an_empty_vocabulary(logits):
    """Lists and None raised AttributeError; an empty vocabulary numpy's zero-size reduction error."""
    with pytest.raises((TypeError, ValueError), match=r"sample_logits: logits must be"):
        decoding.sample_logits(logits, np.random.default_rng(0))


if __name__ == "__main__":   # the whole space, every case once: python tests/test_fuzz_arguments.py
    import collections
    import traceback
    failures = collections.Counter()
    for case in CASES:
        try:
            run_case(*case)
        except Exception as error:   # noqa: BLE001  (a report of every failure)
            t, name, value, valid = case
            kind = type(error).__name__
            print(f"FAIL {t}({name}={short(value)}) valid={valid}: {kind}: {str(error)[:300]}")
            if not isinstance(error, AssertionError):
                print("   ", traceback.format_exc().strip().splitlines()[-3])
            failures[t.name] += 1
    print(len(CASES), "cases,", sum(failures.values()), "failures", dict(failures))
