"""npformer: a from-scratch Transformer engine in NumPy with hand-derived backprop.

Layers, left to right (nothing imports to its right): autograd -> npformer.runtime ->
npformer.functional -> npformer.nn -> npformer.models -> optim, decoding, training, checkpoints,
interop, plots, cuda (CUDA-graph training steps), recording (recorded CPU steps: npformer.recorded).
"""
__version__ = "0.1.0"  # the one place the version is written: setup.cfg reads it (version = attr: ...)

from autograd import Tensor, no_grad

from . import cuda, functional, models, nn, runtime  # runtime: plugs into the core at import (npformer.runtime)
from .recording import recorded
from .runtime.random import manual_seed
from .runtime.threads import get_num_threads, set_num_threads
from .checkpoint import load_checkpoint, load_model, save_checkpoint
from .models import load_pretrained, load_safetensors, save_pretrained, save_safetensors

__all__ = ["__version__", "Tensor", "manual_seed", "no_grad", "cuda", "functional", "nn", "models", "runtime",
           "save_checkpoint", "load_checkpoint", "load_model", "save_safetensors", "load_safetensors",
           "save_pretrained", "load_pretrained", "get_num_threads", "set_num_threads", "recorded"]
