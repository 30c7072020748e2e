"""Exact loss scaling across ranks.

With padding or `ignore_index`, ranks hold different numbers of valid tokens n_r. The
single-process loss of the whole batch is sum_r S_r / N (S_r: rank r's summed loss,
N = sum_r n_r). Averaging each rank's own mean S_r / n_r over ranks is not that (short
shards would weigh more). Each rank instead backpropagates S_r * R / N (R ranks): DDP's mean
over ranks of its gradients is then (1/R) sum_r R dS_r / N = d(sum_r S_r / N), exactly.
"""
from __future__ import annotations

from autograd import Tensor
from autograd.checks import check_real

from . import comm


def global_count(count: float, group: comm.ProcessGroup | None = None) -> float:
    """The sum over ranks of `count` (e.g. this rank's number of valid tokens); collective.
    TypeError / ValueError for a count that is not a finite real number."""
    count = check_real(count, "count", "global_count")
    group = comm.group() if group is None else group
    total = group.sum([count])[0]
    return int(total) if float(total).is_integer() else total


def scaled_loss(loss_sum: Tensor, count: float, group: comm.ProcessGroup | None = None) -> Tensor:
    """The loss to call backward on: `loss_sum * world_size / global_count(count)`.

    loss_sum: this rank's loss summed over its `count` items (e.g.
    F.cross_entropy(..., reduction="sum") and the number of targets != ignore_index).
    After DDP averages the gradients over ranks they equal the single-process gradient of
    (sum of every rank's loss_sum) / (sum of every rank's count); the mean of the returned
    values over ranks is that loss. Collective (one small all-reduce). TypeError for a loss_sum
    that is not a Tensor or a count that is not a real number, ValueError for a negative or
    infinite count and when the counts add up to 0."""
    if not isinstance(loss_sum, Tensor):
        raise TypeError(f"scaled_loss: loss_sum must be a Tensor (this rank's summed loss), got "
                        f"{type(loss_sum).__name__}")
    count = check_real(count, "count", "scaled_loss", at_least=0)
    group = comm.group() if group is None else group
    total = global_count(count, group)
    if not total > 0:
        raise ValueError(f"count: the ranks' counts add up to {total}; there is nothing to average over")
    return loss_sum * (group.size / total)
