"""Parameter groups for weight decay, as nanoGPT's `configure_optimizers` and GPT-2 train them."""
from __future__ import annotations

from typing import Any

from autograd.checks import check_real


def weight_decay_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups of `model`'s trainable parameters for AdamW (or any optimizer of
    npformer.optim): [{"params": matrices, "weight_decay": weight_decay}, {"params": the rest,
    "weight_decay": 0.0}], as nanoGPT's configure_optimizers: every parameter with ndim >= 2
    (linear weights, embeddings) decays; biases and norms' weights (1-D) do not. A tied weight
    (CausalLM(tie_weights=True): the embedding is the output layer) is one parameter, listed
    once; parameters with requires_grad=False are left out; an empty group is left out.

        optimizer = npformer.optim.AdamW(weight_decay_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95))

    The name says what the groups split by (and keeps clear of Optimizer.param_groups, the
    groups an optimizer holds). TypeError for a model without named_parameters, TypeError /
    ValueError for a weight_decay that is not a real number >= 0."""
    weight_decay = check_real(weight_decay, "weight_decay", "weight_decay_groups", at_least=0)
    if not callable(getattr(model, "named_parameters", None)):
        raise TypeError(f"weight_decay_groups: expected a module with named_parameters (an npformer nn.Module), "
                        f"got {type(model).__name__}")
    trainable = [p for _, p in model.named_parameters() if getattr(p, "requires_grad", True)]  # each once
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
