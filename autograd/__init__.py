"""A small reverse-mode autodiff core: Tensor, Function, the tape and gradcheck.

This is npformer's own package, not the PyPI package named `autograd`.
"""
from . import backend, deferred, graphs, host_memory, random, testdevice, threads
from .backend import get_array_module
from .random import manual_seed
from .function import Function, detect_anomaly, enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from . import gradcheck
from .gradcheck import GradcheckError
from .tensor import Tensor, concatenate, stack, unbroadcast, where

host_memory.keep_freed_memory()  # once, at import: freed arrays' pages are reused (see host_memory)

__all__ = ["backend", "deferred", "graphs", "host_memory", "random", "testdevice", "threads", "get_array_module", "manual_seed", "Function", "detect_anomaly",
           "enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled", "GradcheckError", "gradcheck",
           "Tensor", "concatenate", "stack", "unbroadcast", "where"]
