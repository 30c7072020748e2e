"""The op-case registry: one description per op case (its inputs and edge cases, the PyTorch
reference, the composite twin, the tolerances), which drives

- the per-op test files (`tests/functional/test_op_<family>.py`, through `tests/helpers.py::op_tests`),
- `python -m npformer.gradcheck` (one row per case),
- the op table of docs/backprop.md (`markdown_table()`, checked by tests/test_docs.py).

    from npformer import opcases
    for case in opcases.cases("softmax"):
        opcases.gradcheck_case(case, np.random.default_rng(0))      # autograd.gradcheck, float64
        print(opcases.compare_with_torch(case, torch, np.random.default_rng(0)))

A new op adds a `Family` below, its cases (in ops.py, or modules.py for an nn module), a test
file that calls `op_tests(family)`, and a section in docs/backprop.md.
"""
import dataclasses
import re

from . import modules, ops
from .case import (TOLERANCE, Comparison, Instance, OpCase, compare, compare_with_torch, compare_with_twin,
                   gradcheck_case, instantiate, torch_args)


@dataclasses.dataclass(frozen=True)
class Family:
    """An op family: the public names it covers, where its code lives (`source` and the
    autograd.Function classes in it), its derivation (`section`, a heading of docs/backprop.md;
    None for modules built from other ops) and its test file."""
    name: str
    ops: tuple
    source: str
    functions: tuple
    section: object
    tests: str


def _op(name, ops_, source, functions, section):
    return Family(name, ops_, f"npformer/functional/{source}", functions, section, f"tests/functional/test_op_{name}.py")


FAMILIES = {f.name: f for f in [
    _op("linear", ("F.linear", "nn.Linear"), "linear.py", ("LinearFunction",), "Linear"),
    _op("relu", ("F.relu", "nn.ReLU"), "activation.py", ("ReLUFunction",), "ReLU"),
    _op("gelu", ("F.gelu", "nn.GELU"), "activation.py", ("GELUFunction",), "GELU"),
    _op("dropout", ("F.dropout", "nn.Dropout"), "activation.py", ("DropoutFunction",), "Dropout"),
    _op("dropout_add", ("F.dropout_add",), "residual.py", ("DropoutAddFunction",), "Dropout + residual"),
    _op("softmax", ("F.softmax", "F.log_softmax"), "softmax.py", ("SoftmaxFunction", "LogSoftmaxFunction"),
        "Softmax"),
    _op("cross_entropy", ("F.cross_entropy",), "loss.py", ("CrossEntropyFunction",), "Cross-entropy"),
    _op("layer_norm", ("F.layer_norm", "nn.LayerNorm"), "normalization.py", ("LayerNormFunction",), "LayerNorm"),
    _op("embedding", ("F.embedding", "nn.Embedding"), "embedding.py", ("EmbeddingFunction",), "Embedding"),
    _op("attention", ("F.scaled_dot_product_attention", "F.attention_backend"), "attention.py",
        ("AttentionFunction", "MemoryEfficientAttentionFunction"), "Scaled dot-product attention"),
    _op("split_heads", ("F.split_heads",), "attention.py", ("SplitHeadsFunction",), "Splitting heads"),
    _op("rotary", ("F.apply_rotary_emb", "F.rotary_cos_sin", "nn.RotaryEmbedding"), "rotary.py",
        ("RotaryEmbeddingFunction",), "RoPE"),
    Family("multihead_attention", ("nn.MultiheadAttention",), "npformer/nn/attention.py", (), None,
           "tests/nn/test_nn_attention.py"),
    Family("transformer", ("nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer", "nn.Transformer"),
           "npformer/nn/transformer.py", (), None, "tests/nn/test_nn_transformer.py"),
]}

CASES = ops.CASES + modules.CASES


def cases(family=None):
    """Every registered case, or those of one family (a key of FAMILIES)."""
    if family is not None and family not in FAMILIES:
        raise KeyError(f"no op family {family!r}; the families are {sorted(FAMILIES)}")
    return [c for c in CASES if family is None or c.family == family]


def select(pattern="", modules=True):
    """The cases whose name or family contains `pattern` (case-insensitive); modules=False
    leaves out the nn modules' cases."""
    pattern = pattern.lower()
    return [c for c in CASES if (pattern in c.name.lower() or pattern in c.family.lower())
            and (modules or c.module is None)]


def anchor(heading):
    """The link target of a markdown heading (GitHub's rule): lower case, punctuation dropped,
    spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def markdown_table():
    """The op table of docs/backprop.md: one row per op family with a derivation."""
    rows = ["| ops | derivation | code | autograd.Function | tests |", "|---|---|---|---|---|"]
    for f in FAMILIES.values():
        if f.section is not None:
            rows.append(f"| {', '.join(f'`{op}`' for op in f.ops)} | [{f.section}](#{anchor(f.section)}) | `{f.source}` | "
                        f"{', '.join(f'`{name}`' for name in f.functions)} | `{f.tests}` |")
    return "\n".join(rows)


__all__ = ["CASES", "FAMILIES", "TOLERANCE", "Comparison", "Family", "Instance", "OpCase", "anchor", "cases", "compare",
           "compare_with_torch", "compare_with_twin", "gradcheck_case", "instantiate", "markdown_table", "select",
           "torch_args"]
