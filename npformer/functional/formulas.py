"""Where each op's backward formula is: every Function of the op folders gets the class attribute
`backward_formula`, the function of its folder that its backward computes (math.py's, or for
attention the file beside it), which `autograd.backward_steps` shows as the op's file and line.
The backward itself runs the formula through a kernel table (or a fast variant of it); this names
the reference to read. A new op's Functions go in the table (tests/autograd/test_backward_steps.py
checks that every Function of the folders has one)."""
import importlib as _importlib

BACKWARD_FORMULAS = {  # folder: {its Function: "module.function" of the folder, its backward's formula}
    "linear": {"LinearFunction": "math.linear_backward"},
    "activation": {"ReLUFunction": "math.bias_activation_backward", "GELUFunction": "math.bias_activation_backward",
                   "GELUBackward": "math.gelu_double_backward", "DropoutFunction": "math.dropout_backward"},
    "silu": {"SiLUFunction": "math.silu_backward", "SiLUBackward": "math.silu_double_backward",
             "SwiGLUFunction": "math.swiglu_backward", "SwiGLUBackward": "math.swiglu_double_backward"},
    "dropout_add": {"DropoutAddFunction": "math.dropout_add_backward"},
    "softmax": {"SoftmaxFunction": "math.softmax_backward", "LogSoftmaxFunction": "math.log_softmax_backward"},
    "cross_entropy": {"CrossEntropyFunction": "math.cross_entropy_backward"},
    "layer_norm": {"LayerNormFunction": "math.layer_norm_backward",
                   "LayerNormBackward": "math.layer_norm_double_backward"},
    "rms_norm": {"RMSNormFunction": "math.rms_norm_backward", "RMSNormBackward": "math.rms_norm_double_backward"},
    # the embedding's backward is a scatter-add of rows; the scatter-add's backward is the lookup again
    "embedding": {"EmbeddingFunction": "math.scatter_add_rows", "ScatterAddRowsFunction": "math.embedding_forward"},
    "attention": {"AttentionFunction": "math.attention_backward",
                  "AttentionBackward": "higher.attention_double_backward",
                  "MemoryEfficientAttentionFunction": "blockwise.attention_blockwise_backward",
                  "MemoryEfficientAttentionBackward": "blockwise.attention_blockwise_double_backward",
                  "SplitHeadsFunction": "split_heads.split_heads_backward",
                  "MergeHeadsFunction": "split_heads._heads_of"},  # (the merge's backward is the split)
    "rotary": {"RotaryEmbeddingFunction": "math.rotary_backward"},
}

for _folder, _functions in BACKWARD_FORMULAS.items():
    _package = _importlib.import_module(f"{__package__}.{_folder}")
    for _name, _where in _functions.items():
        _module, _, _function = _where.partition(".")
        _formula = getattr(_importlib.import_module(f"{_package.__name__}.{_module}"), _function)
        getattr(_package, _name).backward_formula = staticmethod(getattr(_formula, "__wrapped__", _formula))
