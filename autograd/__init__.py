"""A small reverse-mode autodiff core: Tensor, the primitive ops, Function and the tape, the grad
modes, gradcheck, the backend switch and the argument checks (README.md, "Reading the core").

This is npformer's own package, not the PyPI package named `autograd`. It imports nothing but
itself and the standard library (and numpy, CuPy where installed, in the backend switch), and
importing it changes nothing in the process: code that runs beside it (npformer's runtime) plugs
in through `autograd.hooks` and `backend.register_device`.
"""
from . import backend, hooks
from .backend import get_array_module
from .function import Function, raw_computation
from .tensor import Tensor, concatenate, stack, where
from .create_graph import grad
from .backward_steps import backward_steps, print_backward
from . import forward_ad, functional
from . import gradcheck  # the module, callable as the function (autograd.gradcheck(fn, inputs))
from .gradcheck import GradcheckError, gradgradcheck
from .modes import detect_anomaly, enable_grad, is_anomaly_enabled, is_grad_enabled, no_grad, set_grad_enabled
from .ops import unbroadcast

__all__ = ["backend", "hooks", "get_array_module", "Function", "raw_computation", "detect_anomaly", "enable_grad",
           "is_anomaly_enabled", "is_grad_enabled", "no_grad", "set_grad_enabled", "GradcheckError", "gradcheck", "gradgradcheck", "Tensor", "concatenate",
           "grad", "backward_steps", "print_backward", "stack", "unbroadcast", "where", "forward_ad", "functional"]
