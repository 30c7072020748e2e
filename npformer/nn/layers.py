"""Basic layers mirroring torch.nn: Linear, Embedding, LayerNorm, RMSNorm, Dropout, ReLU, GELU, SiLU,
Identity; and SwiGLU, the gated feed-forward of Llama, Qwen2 and Mistral."""
from __future__ import annotations

import math
from typing import Any

import npformer.functional as F
from autograd import Tensor, backend
from autograd.backend import ArrayLike, DType
from autograd.checks import (as_array, check_bool, check_float_dtype, check_int, check_optional_int, check_real,
                             check_shape)

from . import init
from .hook_points import add_hook_points
from .module import Module, Parameter


def new_parameter(shape, device=None, dtype=None):
    """An uninitialised (zero) Parameter of `shape` on `device` (default cpu) in `dtype` (default float32)."""
    xp = backend.module_for(device or "cpu")
    dtype = check_float_dtype(dtype or "float32", "dtype", "parameters")
    return Parameter(xp.zeros(shape, dtype=dtype))


def check_features(x, features, owner, name="input"):
    """`x` must be a floating Tensor whose last dimension is `features`."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: {name} must be an autograd.Tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] != features:
        raise ValueError(f"{owner}: {name}'s last dimension must be {features}, got shape {x.shape}")
    return x


class Identity(Module):
    """Returns its input unchanged (torch.nn.Identity): a placeholder where a layer is optional."""

    def forward(self, x: Any) -> Any:
        """`x` itself."""
        return x


class Linear(Module):
    """y = x W^T + b (torch.nn.Linear); weight (out_features, in_features), bias (out_features,)
    or none with bias=False. Input (..., in_features) -> (..., out_features).

    Init like torch: W, b ~ U(-1/sqrt(in_features), 1/sqrt(in_features)). device (default "cpu")
    and dtype (default float32) of the parameters. Raises TypeError / ValueError for sizes that
    are not integers >= 1.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: str | None = None,
                 dtype: DType | None = None):
        super().__init__()
        self.in_features = in_features = check_int(in_features, "in_features", "Linear", at_least=1)
        self.out_features = out_features = check_int(out_features, "out_features", "Linear", at_least=1)
        self.weight = new_parameter((out_features, in_features), device, dtype)
        if bias:
            self.bias = new_parameter((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the weight and bias again from torch's initial distribution (in place)."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:
        """input (..., in_features) -> (..., out_features). TypeError unless input is a Tensor,
        ValueError for another last dimension."""
        check_features(input, self.in_features, "Linear")
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """Lookup table: ids (...) of ints in [0, num_embeddings) -> vectors (..., embedding_dim).

    Init N(0, 1) like torch; the `padding_idx` row (negative counts from the end) starts at zero
    and never gets a gradient. torch.nn.Embedding; weight (num_embeddings, embedding_dim).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 device: str | None = None, dtype: DType | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings = check_int(num_embeddings, "num_embeddings", "Embedding", at_least=1)
        self.embedding_dim = embedding_dim = check_int(embedding_dim, "embedding_dim", "Embedding", at_least=1)
        padding_idx = check_optional_int(padding_idx, "padding_idx", "Embedding", at_least=-num_embeddings,
                                         at_most=num_embeddings - 1)
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.weight = new_parameter((num_embeddings, embedding_dim), device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the weight again from N(0, 1) and zero the padding row (in place)."""
        init.normal_(self.weight)
        self.zero_padding_row()

    def zero_padding_row(self) -> None:
        """Set the `padding_idx` row of the weight to zero (nothing without a padding_idx)."""
        if self.padding_idx is not None:
            self.weight.data[self.padding_idx] = 0

    def forward(self, input: Tensor | ArrayLike) -> Tensor:
        """Integer ids of any shape (an array, nested lists or a Tensor) -> (*ids.shape,
        embedding_dim). TypeError for non-integer ids, IndexError for ids out of range."""
        return F.embedding(as_ids(input, self.weight.data, "Embedding"), self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def as_ids(ids, like, owner, name="input"):
    """Token ids (array, list or Tensor) as an integer array on the device of the array `like`."""
    if isinstance(ids, Tensor):
        ids = ids.data
    if not backend.is_array(ids):
        ids = as_array(ids, name, owner, backend.get_array_module(like))
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{owner}: {name} must hold integer token ids, got dtype {ids.dtype}")
    return backend.to_device(ids, backend.device_of(like))


class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the trailing `normalized_shape` dims
    (torch.nn.LayerNorm): weight starts at ones, bias at zeros; elementwise_affine=False has
    neither, bias=False no bias. Input (..., *normalized_shape), e.g. (B, T, E), same shape out."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: str | None = None, dtype: DType | None = None):
        super().__init__()
        self.normalized_shape = check_shape(normalized_shape, "normalized_shape", "LayerNorm")
        self.eps = check_real(eps, "eps", "LayerNorm", above=0)
        self.elementwise_affine = elementwise_affine
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = init.ones_(new_parameter(self.normalized_shape, device, dtype))
            if bias:
                self.bias = new_parameter(self.normalized_shape, device, dtype)
        add_hook_points(self, "hook_normalized")

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) normalized over its trailing dims, same shape. TypeError
        unless input is a Tensor, ValueError for other trailing dimensions."""
        if not isinstance(input, Tensor):
            raise TypeError(f"LayerNorm: input must be an autograd.Tensor, got {type(input).__name__}")
        n = len(self.normalized_shape)
        if input.shape[input.ndim - n:] != self.normalized_shape or input.ndim < n:
            raise ValueError(f"LayerNorm: input's trailing dimensions must be {self.normalized_shape}, "
                             f"got shape {input.shape}")
        if self.hooks_active:
            return self.hook_normalized(F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps))
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the trailing `normalized_shape` dims
    (torch.nn.RMSNorm; Llama's, Qwen2's and Mistral's norm): no mean subtracted and no bias; weight
    starts at ones, elementwise_affine=False has none. eps=None takes the machine epsilon of the
    input's dtype (torch's default). Input (..., *normalized_shape), e.g. (B, T, E), same shape out.
    Raises ValueError for eps <= 0, TypeError / ValueError for a normalized_shape that is not
    integers >= 1."""

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float | None = None,
                 elementwise_affine: bool = True, device: str | None = None, dtype: DType | None = None):
        super().__init__()
        self.normalized_shape = check_shape(normalized_shape, "normalized_shape", "RMSNorm")
        self.eps = None if eps is None else check_real(eps, "eps", "RMSNorm", above=0)
        self.elementwise_affine = check_bool(elementwise_affine, "elementwise_affine", "RMSNorm")
        self.register_parameter("weight", None)
        if self.elementwise_affine:
            self.weight = init.ones_(new_parameter(self.normalized_shape, device, dtype))
        add_hook_points(self, "hook_normalized")

    def reset_parameters(self) -> None:
        """The weight back to ones (in place)."""
        if self.weight is not None:
            init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) normalized over its trailing dims, same shape. TypeError
        unless input is a Tensor, ValueError for other trailing dimensions."""
        if not isinstance(input, Tensor):
            raise TypeError(f"RMSNorm: input must be an autograd.Tensor, got {type(input).__name__}")
        n = len(self.normalized_shape)
        if input.shape[input.ndim - n:] != self.normalized_shape or input.ndim < n:
            raise ValueError(f"RMSNorm: input's trailing dimensions must be {self.normalized_shape}, "
                             f"got shape {input.shape}")
        if self.hooks_active:
            return self.hook_normalized(F.rms_norm(input, self.normalized_shape, self.weight, self.eps))
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    """Zero each element with probability p and scale the rest by 1/(1-p) in training mode. The
    masks come from the global dropout stream (npformer.runtime.random.dropout_stream(), seeded by
    npformer.manual_seed, saved in checkpoints): the same masks on every device (F.dropout).
    torch.nn.Dropout; in eval mode, inside nn.inference_mode(), or with p=0, the input passes
    unchanged. ValueError unless 0 <= p <= 1."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = check_real(p, "p", "Dropout", at_least=0, at_most=1)

    def forward(self, input: Tensor) -> Tensor:
        """Any shape; dropped out in training mode, `input` itself in eval mode (training_active)."""
        return F.dropout(input, self.p, self.training_active)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ReLU(Module):
    """max(x, 0) elementwise (torch.nn.ReLU), any shape."""

    def forward(self, input: Tensor) -> Tensor:
        """relu(input), same shape."""
        return F.relu(input)


class GELU(Module):
    """GELU elementwise (torch.nn.GELU), any shape; approximate="none" (exact, x * Phi(x)) or
    "tanh" (GPT-2's form). ValueError for another `approximate`."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, input: Tensor) -> Tensor:
        """gelu(input), same shape."""
        return F.gelu(input, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class SiLU(Module):
    """x * sigmoid(x) elementwise (torch.nn.SiLU, swish), any shape."""

    def forward(self, input: Tensor) -> Tensor:
        """silu(input), same shape."""
        return F.silu(input)


class SwiGLU(Module):
    """The gated feed-forward of Llama, Qwen2 and Mistral: out = linear2(silu(linear1(x)) * linear3(x)),
    the product one fused op (F.swiglu). linear1 is the gate (in_features -> hidden_features; Meta's
    w1, Hugging Face's gate_proj), linear3 the up projection (w3, up_proj), linear2 the down
    projection (hidden_features -> out_features, default in_features; w2, down_proj), each an
    nn.Linear with `bias`. Input (..., in_features) -> (..., out_features). Raises TypeError /
    ValueError for sizes that are not integers >= 1."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None, bias: bool = True,
                 device: str | None = None, dtype: DType | None = None):
        super().__init__()
        self.in_features = check_int(in_features, "in_features", "SwiGLU", at_least=1)
        self.hidden_features = check_int(hidden_features, "hidden_features", "SwiGLU", at_least=1)
        out_features = self.in_features if out_features is None else out_features
        self.out_features = check_int(out_features, "out_features", "SwiGLU", at_least=1)
        bias = check_bool(bias, "bias", "SwiGLU")
        self.linear1 = Linear(self.in_features, self.hidden_features, bias, device, dtype)    # gate
        self.linear3 = Linear(self.in_features, self.hidden_features, bias, device, dtype)    # up
        self.linear2 = Linear(self.hidden_features, self.out_features, bias, device, dtype)   # down

    def forward(self, input: Tensor) -> Tensor:
        """input (..., in_features) -> (..., out_features). TypeError unless input is a Tensor,
        ValueError for another last dimension."""
        check_features(input, self.in_features, "SwiGLU")
        return self.linear2(F.swiglu(self.linear1(input), self.linear3(input)))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
                f"out_features={self.out_features}, bias={self.linear1.bias is not None}")
