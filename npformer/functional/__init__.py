"""npformer.functional (imported as F): ops with hand-derived backward passes, mirroring
torch.nn.functional. Each op family is one folder, `npformer/functional/<op>/`:

- `math.py`: the formulas, forward, backward, double backward and JVP side by side, on the array
  module `xp` they are given (numpy, CuPy): the file to read; it imports nothing of the engine;
- `__init__.py`: the binding: each formula the reference of a kernel table
  (`npformer.runtime.kernels`), the `autograd.Function`s, the public ops (its `__all__`);
- `cpu.py`, `cuda.py`: faster implementations registered in those tables beside the reference
  (row blocks on threads, hand-written CUDA kernels), each tested against it;
- `cases.py`: its registry cases (npformer.opcases: inputs and edge cases, torch references);
- `twin.py`: its composite twin, the same math from autograd primitives (a test reference);
- `derivation.md`: its section of docs/backprop.md, with a check that runs.

Adding an op is one folder and its name in OPS below.
"""
import importlib as _importlib

# the op folders, in the order a Transformer meets them (and docs/backprop.md derives them)
OPS = ("linear", "activation", "silu", "dropout_add", "softmax", "cross_entropy", "layer_norm", "rms_norm", "embedding",
       "attention", "rotary")

__all__ = []
for _folder in OPS:  # each folder's public ops: F.softmax, F.layer_norm, ...
    _module = _importlib.import_module(f"{__name__}.{_folder}")
    globals().update({name: getattr(_module, name) for name in _module.__all__})
    __all__ += _module.__all__
__all__ = sorted(__all__)

from . import adam  # noqa: E402,F401  (the optimizer's kernel table, a folder beside the ops')
