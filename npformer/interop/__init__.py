"""npformer.interop: the same model, weights and numbers in PyTorch and Hugging Face transformers.

- `to_torch(module)` / `from_torch(torch_module)` (pytorch.py): torch.nn modules and npformer's
  models, whose torch twins are compositions of torch.nn modules (torch_modules.py,
  `torch_model_classes()`).
- `to_hf(model)` / `from_hf(hf_model)` (hf.py): GPT2LMHeadModel <-> CausalLM, BertModel <->
  BidirectionalEncoder, BertForSequenceClassification <-> EncoderClassifier, mapped by
  npformer.models.huggingface.
- `from_nanogpt(checkpoint)` / `to_nanogpt(model)` (nanogpt.py): nanoGPT's ckpt.pt checkpoints
  (state_dict + model_args) <-> CausalLM.
torch and transformers are test/dev dependencies, imported inside these functions only:
npformer itself never needs them.
"""
from .hf import from_hf, to_hf
from .nanogpt import from_nanogpt, nanogpt_config, to_nanogpt
from .pytorch import _torch, from_torch, to_torch
from .torch_modules import torch_model_classes

__all__ = ["to_torch", "from_torch", "to_hf", "from_hf", "from_nanogpt", "to_nanogpt", "nanogpt_config",
           "torch_model_classes"]
