"""The gradient-check suite as a command: every functional op and every nn module, in float64.

    python -m npformer.gradcheck [-k SUBSTRING] [--no-torch] [--no-modules]

One row per check: the gradient of every input and parameter against central finite
differences (eps 1e-6; pass when |analytic - numeric| <= 1e-5 + 1e-3 |numeric| everywhere,
the criterion of autograd.gradcheck), then outputs and gradients against torch (when it is
installed) and against the composite twin (the same code run with npformer.functional's ops
swapped for the slow versions built from autograd primitives). "abs" is the largest absolute
difference, "rel" that divided by the largest reference magnitude. Losses use a random
upstream gradient, never a plain sum(). Exit status 1 when any row fails.
"""
import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

import autograd
import npformer.functional as F
from autograd import Tensor, no_grad
from autograd.gradcheck import numeric_gradient
from npformer import interop, nn
from npformer.functional import composite

EPS, FD_ATOL, FD_RTOL = 1e-6, 1e-5, 1e-3


@dataclass
class Case:
    """fn(*inputs) -> Tensor or tuple (None entries ignored); inputs are float64 leaves (for
    modules: the input tensors, then the parameters in named_parameters() order).
    torch_fn(torch, arrays) -> (outputs, torch leaves aligned with inputs), or None."""
    fn: Callable
    inputs: list
    torch_fn: Optional[Callable] = None
    twin: bool = True
    finite_differences: bool = True
    tolerance: float = 1e-10        # against torch and the twin, relative to max(1, |reference|)
    reseed: Optional[int] = None    # autograd.manual_seed before every evaluation (module dropout)


@dataclass
class Check:
    name: str
    build: Callable  # numpy Generator -> Case
    module: bool = False


def _outputs(result):
    items = result if isinstance(result, (tuple, list)) else [result]
    return [o for o in items if o is not None]


def _evaluate(case, fn, upstream):
    """Outputs and input gradients (numpy) of loss = sum(out * upstream)."""
    if case.reseed is not None:
        autograd.manual_seed(case.reseed)
    for t in case.inputs:
        t.grad = None
    outs = _outputs(fn(*case.inputs))
    loss = None
    for o, g in zip(outs, upstream):
        if o.requires_grad:
            term = (o * Tensor(g)).sum()
            loss = term if loss is None else loss + term
    if loss is not None:
        loss.backward()
    grads = [np.zeros(t.shape) if t.grad is None else autograd.backend.as_numpy(t.grad).copy() for t in case.inputs]
    return [o.numpy() for o in outs], grads


def _numeric_gradients(case, upstream):
    def loss():
        if case.reseed is not None:
            autograd.manual_seed(case.reseed)
        with no_grad():
            return sum(float((o.data * g).sum()) for o, g in zip(_outputs(case.fn(*case.inputs)), upstream))

    return [numeric_gradient(loss, t, EPS) for t in case.inputs]


def _difference(ours, reference):
    """(max abs difference, max |reference|) over two lists of arrays."""
    worst = max((float(np.max(np.abs(a - b))) for a, b in zip(ours, reference) if np.size(b)), default=0.0)
    scale = max((float(np.max(np.abs(b))) for b in reference if np.size(b)), default=0.0)
    return worst, scale


def run_check(check, rng, torch=None):
    """One row: {"name", "fd", "torch", "twin": (abs, rel, passed) or None, "passed"}."""
    case = check.build(rng)
    for t in case.inputs:
        t.data = np.ascontiguousarray(t.data)
    first = _outputs(case.fn(*case.inputs))
    upstream = [rng.standard_normal(o.shape) for o in first]
    outs, grads = _evaluate(case, case.fn, upstream)
    row = {"name": check.name, "fd": None, "torch": None, "twin": None}
    if case.finite_differences:
        numeric = _numeric_gradients(case, upstream)
        passed = all(np.all(np.abs(a - n) <= FD_ATOL + FD_RTOL * np.abs(n)) for a, n in zip(grads, numeric))
        worst, scale = _difference(grads, numeric)
        row["fd"] = (worst, worst / scale if scale else 0.0, passed)
    if torch is not None and case.torch_fn is not None:
        arrays = [t.numpy().copy() for t in case.inputs]
        t_outs, leaves = case.torch_fn(torch, arrays)
        t_outs = [o for o in (t_outs if isinstance(t_outs, (tuple, list)) else [t_outs]) if o is not None]
        sum(((o * torch.tensor(g)).sum() for o, g in zip(t_outs, upstream)), torch.zeros((), dtype=torch.float64)).backward()
        reference = [o.detach().numpy() for o in t_outs] + [
            np.zeros(t.shape) if leaf.grad is None else leaf.grad.numpy() for t, leaf in zip(case.inputs, leaves)]
        row["torch"] = _comparison(outs + grads, reference, case.tolerance)
    if case.twin:
        with composite.installed():
            twin_outs, twin_grads = _evaluate(case, case.fn, upstream)
        row["twin"] = _comparison(outs + grads, twin_outs + twin_grads, case.tolerance)
    row["passed"] = all(r[2] for r in (row["fd"], row["torch"], row["twin"]) if r is not None)
    return row


def _comparison(ours, reference, tolerance):
    shapes_match = len(ours) == len(reference) and all(np.shape(a) == np.shape(b) for a, b in zip(ours, reference))
    if not shapes_match:
        return (float("inf"), float("inf"), False)
    worst, scale = _difference(ours, reference)
    return worst, worst / scale if scale else 0.0, worst <= tolerance * max(1.0, scale)


# -- the checks -----------------------------------------------------------------------------------
def leaf(array):
    return Tensor(np.asarray(array, dtype=np.float64), requires_grad=True)


def functional_case(fn, arrays, torch_fn=None, **options):
    """A Case for an op: torch_fn(torch, *leaves) -> output(s), run on torch leaves made from arrays."""
    def run_torch(torch, values):
        leaves = [torch.tensor(v, requires_grad=True) for v in values]
        return torch_fn(torch, *leaves), leaves
    return Case(fn, [leaf(a) for a in arrays], run_torch if torch_fn else None, **options)


def _away_from_zero(rng, shape):
    """Values with |x| >= 0.1, so finite differences never straddle ReLU's kink."""
    return np.sign(rng.standard_normal(shape)) * (0.1 + np.abs(rng.standard_normal(shape)))


def _padding_and_causal(batch, tq, tk):
    keep = np.ones((batch, 1, 1, tk), dtype=bool)
    keep[-1, ..., -1] = False
    return keep & np.tril(np.ones((tq, tk), dtype=bool))


def _fully_masked_float(rng, tq, tk):
    mask = rng.standard_normal((tq, tk))
    mask[1] = -np.inf
    mask[0, 0] = -np.inf
    return mask


def _rope_torch(torch, x, cos, sin):
    half = x.shape[-1] // 2
    c, s = torch.tensor(cos), torch.tensor(sin)
    return torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], dim=-1)


def _functional_checks():
    ids = np.array([[1, 3, 3, 0], [6, 1, 3, 3]])
    target = np.array([2, -100, 4, 0, 4])
    class_weight = np.array([0.5, 1.0, 2.0, 0.3, 1.5])
    cos, sin = F.rotary_cos_sin(4, 6, dtype="float64")
    tf = lambda torch: torch.nn.functional  # noqa: E731

    def sdpa(**kw):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)

    def torch_sdpa(**kw):
        return lambda torch, q, k, v: tf(torch).scaled_dot_product_attention(
            q, k, v, **{key: torch.tensor(val) if isinstance(val, np.ndarray) else val for key, val in kw.items()})

    def qkv(rng):
        return [rng.standard_normal((2, 2, 4, 3)) for _ in range(3)]

    def seeded_dropout(x):
        return F.dropout(x, 0.4, generator=autograd.random.Philox(7))

    def seeded_attention_dropout(q, k, v, **kw):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True,
                                              generator=autograd.random.Philox(7), **kw)

    def float_mask_case(rng):
        mask = _fully_masked_float(rng, 4, 4)
        return functional_case(sdpa(attn_mask=mask), qkv(rng), torch_sdpa(attn_mask=mask))

    def mask_case(rng, memory_efficient=False):
        mask = _padding_and_causal(2, 4, 4)
        extra = {"memory_efficient": True, "block_size": 3} if memory_efficient else {}
        return functional_case(sdpa(attn_mask=mask, **extra), qkv(rng), torch_sdpa(attn_mask=mask))

    return [
        Check("F.linear", lambda rng: functional_case(
            F.linear, [rng.standard_normal(s) for s in ((2, 3, 4), (5, 4), (5,))], lambda t, *a: tf(t).linear(*a))),
        Check("F.relu", lambda rng: functional_case(F.relu, [_away_from_zero(rng, (3, 5))], lambda t, x: t.relu(x))),
        Check("F.gelu", lambda rng: functional_case(F.gelu, [3 * rng.standard_normal((3, 5))], lambda t, x: tf(t).gelu(x))),
        Check("F.gelu (tanh)", lambda rng: functional_case(
            lambda x: F.gelu(x, approximate="tanh"), [3 * rng.standard_normal((3, 5))],
            lambda t, x: tf(t).gelu(x, approximate="tanh"))),
        Check("F.dropout (seeded)", lambda rng: functional_case(seeded_dropout, [rng.standard_normal((4, 5))])),
        Check("F.softmax", lambda rng: functional_case(
            lambda x: F.softmax(x, dim=0), [rng.standard_normal((4, 5))], lambda t, x: t.softmax(x, dim=0))),
        Check("F.softmax [[-1000, 1]]", lambda rng: functional_case(
            F.softmax, [[[-1000.0, 1.0]]], lambda t, x: t.softmax(x, dim=-1))),
        Check("F.log_softmax", lambda rng: functional_case(
            F.log_softmax, [rng.standard_normal((4, 5))], lambda t, x: t.log_softmax(x, dim=-1))),
        Check("F.layer_norm", lambda rng: functional_case(
            lambda x, w, b: F.layer_norm(x, (5,), w, b),
            [rng.standard_normal((2, 3, 5)), 1 + rng.standard_normal(5), rng.standard_normal(5)],
            lambda t, x, w, b: tf(t).layer_norm(x, (5,), w, b))),
        Check("F.embedding", lambda rng: functional_case(
            lambda w: F.embedding(ids, w), [rng.standard_normal((7, 3))],
            lambda t, w: tf(t).embedding(t.tensor(ids), w))),
        Check("F.embedding (padding_idx, no FD)", lambda rng: functional_case(
            lambda w: F.embedding(ids, w, padding_idx=3), [rng.standard_normal((7, 3))],
            lambda t, w: tf(t).embedding(t.tensor(ids), w, padding_idx=3), finite_differences=False)),
        Check("F.cross_entropy (smoothing, ignore, weight)", lambda rng: functional_case(
            lambda x: F.cross_entropy(x, target, weight=class_weight, label_smoothing=0.1),
            [rng.standard_normal((5, 5))],
            lambda t, x: tf(t).cross_entropy(x, t.tensor(target), weight=t.tensor(class_weight), label_smoothing=0.1))),
        Check("F.sdpa (causal + padding)", mask_case),
        Check("F.sdpa (float mask, fully masked row)", float_mask_case),
        Check("F.sdpa memory-efficient (causal + padding)", lambda rng: mask_case(rng, memory_efficient=True)),
        Check("F.sdpa memory-efficient (is_causal, Tq != Tk)", lambda rng: functional_case(
            sdpa(is_causal=True, memory_efficient=True, block_size=2),
            [rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((1, 2, 3, 2))],
            torch_sdpa(is_causal=True))),
        Check("F.sdpa (return_weights)", lambda rng: functional_case(
            sdpa(is_causal=True, return_weights=True), qkv(rng),
            lambda t, q, k, v: _torch_attention_with_weights(t, q, k, v))),
        Check("F.sdpa (seeded dropout)", lambda rng: functional_case(seeded_attention_dropout, qkv(rng))),
        Check("F.sdpa memory-efficient (seeded dropout)", lambda rng: functional_case(
            lambda q, k, v: seeded_attention_dropout(q, k, v, memory_efficient=True, block_size=3), qkv(rng),
            twin=False)),
        Check("F.split_heads (3 chunks)", lambda rng: functional_case(
            lambda x: _mix_heads(*F.split_heads(x, 2, chunks=3)), [rng.standard_normal((2, 4, 12))],
            lambda t, x: _mix_heads(*x.reshape(2, 4, 3, 2, 2).permute(2, 0, 3, 1, 4)))),
        Check("F.apply_rotary_emb", lambda rng: functional_case(
            lambda x: F.apply_rotary_emb(x, cos, sin), [rng.standard_normal((2, 4, 6))],
            lambda t, x: _rope_torch(t, x, cos, sin))),
    ]


def _mix_heads(q, k, v):
    return q * k + 2.0 * v


def _torch_attention_with_weights(torch, q, k, v):
    scores = (q @ k.transpose(-1, -2)) / np.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return weights @ v, weights


def module_case(module, inputs, call, torch_call=None, convert=True, **options):
    """A Case for a module: call(module, *input_tensors) and torch_call(torch, torch_module, *leaves),
    where torch_module = interop.to_torch(module) (None with convert=False)."""
    names = [name for name, _ in module.named_parameters()]
    n_inputs = len(inputs)

    def run_torch(torch, arrays):
        torch_module = interop.to_torch(module) if convert else None
        leaves = [torch.tensor(a, requires_grad=True) for a in arrays[:n_inputs]]
        params = dict(torch_module.named_parameters()) if convert else {}
        return torch_call(torch, torch_module, *leaves), leaves + [params[name] for name in names]

    return Case(lambda *ts: call(module, *ts[:n_inputs]), [leaf(a) for a in inputs] + [p for _, p in module.named_parameters()],
                run_torch if torch_call else None, tolerance=1e-9, **options)


def _built(factory, seed=0):
    autograd.manual_seed(seed)
    return factory().double()


def _module_checks():
    ids = np.array([[1, 3, 3, 0], [6, 1, 3, 3]])
    pad = np.array([[False, False, False, True], [False, False, False, False]])      # True = padding
    causal = np.triu(np.ones((4, 4), dtype=bool), 1)                                   # True = may not attend

    def layer_kwargs():
        return dict(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)

    def t_mask(torch, a):
        return torch.tensor(a)

    return [
        Check("nn.Linear", lambda rng: module_case(
            _built(lambda: nn.Linear(4, 3)), [rng.standard_normal((2, 5, 4))],
            lambda m, x: m(x), lambda t, m, x: m(x)), module=True),
        Check("nn.Embedding", lambda rng: module_case(
            _built(lambda: nn.Embedding(7, 3)), [], lambda m: m(ids), lambda t, m: m(t.tensor(ids))), module=True),
        Check("nn.LayerNorm", lambda rng: module_case(
            _built(lambda: nn.LayerNorm(5)), [rng.standard_normal((2, 3, 5))],
            lambda m, x: m(x), lambda t, m, x: m(x)), module=True),
        Check("nn.Dropout (eval)", lambda rng: module_case(
            _built(lambda: nn.Dropout(0.3)).eval(), [rng.standard_normal((3, 4))], lambda m, x: m(x),
            lambda t, m, x: t.nn.functional.dropout(x, 0.3, training=False), convert=False), module=True),
        Check("nn.Dropout (train, seeded)", lambda rng: module_case(
            _built(lambda: nn.Dropout(0.3)), [rng.standard_normal((3, 4))], lambda m, x: m(x), reseed=3), module=True),
        Check("nn.MultiheadAttention", lambda rng: module_case(
            _built(lambda: nn.MultiheadAttention(8, 2, batch_first=True)),
            [rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4, 8))],
            lambda m, x, mem: m(x, mem, mem, key_padding_mask=pad, attn_mask=causal),
            lambda t, m, x, mem: m(x, mem, mem, key_padding_mask=t_mask(t, pad), attn_mask=t_mask(t, causal))),
            module=True),
        Check("nn.TransformerEncoderLayer", lambda rng: module_case(
            _built(lambda: nn.TransformerEncoderLayer(**layer_kwargs())), [rng.standard_normal((2, 4, 8))],
            lambda m, x: m(x, src_key_padding_mask=pad),
            lambda t, m, x: m(x, src_key_padding_mask=t_mask(t, pad))), module=True),
        Check("nn.TransformerDecoderLayer", lambda rng: module_case(
            _built(lambda: nn.TransformerDecoderLayer(**layer_kwargs(), activation="gelu", norm_first=True)),
            [rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4, 8))],
            lambda m, x, mem: m(x, mem, tgt_mask=causal, memory_key_padding_mask=pad),
            lambda t, m, x, mem: m(x, mem, tgt_mask=t_mask(t, causal), memory_key_padding_mask=t_mask(t, pad))),
            module=True),
        Check("nn.Transformer (1+1 layers, d=8)", lambda rng: module_case(
            _built(lambda: nn.Transformer(num_encoder_layers=1, num_decoder_layers=1, **layer_kwargs())),
            [rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 3, 8))],
            lambda m, s, x: m(s, x, tgt_mask=causal[:3, :3], src_key_padding_mask=pad, memory_key_padding_mask=pad),
            lambda t, m, s, x: m(s, x, tgt_mask=t_mask(t, causal[:3, :3]), src_key_padding_mask=t_mask(t, pad),
                                 memory_key_padding_mask=t_mask(t, pad))), module=True),
    ]


def all_checks():
    return _functional_checks() + _module_checks()


def _cell(result):
    if result is None:
        return f"{'-':>9} {'-':>9}"
    return f"{result[0]:9.1e} {result[1]:9.1e}" + ("" if result[2] else "!")


def run(checks, torch=None, stream=None, seed=0):
    """Run `checks`, print the table to `stream` (stdout); returns True when every row passed."""
    stream = stream or sys.stdout
    width = max([len("check (float64)")] + [len(c.name) for c in checks])
    stream.write(f"{'check (float64)':<{width}} | {'finite differences':^19} | {'torch':^19} | "
                 f"{'composite twin':^19} | result\n")
    stream.write(f"{'':<{width}} | " + " | ".join(f"{'max abs':>9} {'max rel':>9}" for _ in range(3)) + " |\n")
    all_passed = True
    for check in checks:
        row = run_check(check, np.random.default_rng(seed), torch)
        all_passed &= row["passed"]
        stream.write(f"{row['name']:<{width}} | {_cell(row['fd']):<19} | {_cell(row['torch']):<19} | "
                     f"{_cell(row['twin']):<19} | {'PASS' if row['passed'] else 'FAIL'}\n")
        stream.flush()
    return all_passed


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npformer.gradcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="pattern", default="", help="only checks whose name contains this")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    parser.add_argument("--no-modules", action="store_true", help="functional ops only")
    args = parser.parse_args(argv)
    checks = [c for c in all_checks() if args.pattern.lower() in c.name.lower() and not (args.no_modules and c.module)]
    torch = None
    if not args.no_torch:
        try:
            torch = interop._torch()
        except ImportError:
            print("torch is not installed: the torch column is skipped")
    start = time.perf_counter()
    passed = run(checks, torch)
    print(f"{len(checks)} checks in {time.perf_counter() - start:.1f} s: {'all passed' if passed else 'FAILURES'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
