"""`ZeroRedundancyOptimizer`: ZeRO stage 1, the optimizer's state split across ranks.

After DDP's all-reduce every rank holds the same mean gradients; with plain data parallelism
every rank would then run the same update and hold the whole optimizer state (Adam: two
arrays per parameter). Here each parameter has one owner rank: only the owner keeps its
state and updates it; then one all-gather per (device, dtype) copies every updated parameter
to every rank. The update is the wrapped optimizer's own arithmetic, so the parameters are
bit for bit those of unsharded training, and each rank keeps about 1/N of the state.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from autograd import Tensor
from autograd.checks import check_int

from ..optim import Optimizer
from . import comm


class ZeroRedundancyOptimizer:
    """Wraps an npformer optimizer (SGD, Adam, AdamW) built over all the model's parameters.

    Parameters are given owners largest first, each to the rank owning the fewest entries so
    far (torch's ZeroRedundancyOptimizer does the same). `param_groups` are the wrapped
    optimizer's own, so an lr scheduler built on it keeps working. `step`, `state_dict` and
    `consolidate_state_dict` are collectives: every rank calls them in the same order.
    group: the process group (default: `init()`'s world). TypeError for another kind of optimizer.
    """

    def __init__(self, optimizer: Optimizer, group: comm.ProcessGroup | None = None):
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "_update"):
            raise TypeError(f"optimizer: expected an npformer optimizer (SGD, Adam, AdamW), got "
                            f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.group = comm.group() if group is None else group
        self.param_groups = optimizer.param_groups
        params = optimizer.parameters()
        self.owner, loads = {}, [0] * self.group.size
        for p in sorted(params, key=lambda p: -p.size):  # stable: ties keep the groups' order
            rank = loads.index(min(loads))
            self.owner[id(p)] = rank
            loads[rank] += p.size
        self._drop_foreign_state()
        self._gathers = self._make_gathers(params)
        self._consolidated = None

    def _make_gathers(self, params):
        """Per (device, dtype): a flat array holding rank 0's parameters, then rank 1's, ..."""
        by_key = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        gathers = []
        for members in by_key.values():
            members = sorted(members, key=lambda p: self.owner[id(p)])  # stable
            counts = [sum(p.size for p in members if self.owner[id(p)] == r) for r in range(self.group.size)]
            offsets = np.concatenate([[0], np.cumsum([p.size for p in members])]).tolist()
            flat = members[0].xp.empty(offsets[-1], dtype=members[0].dtype)
            views = [flat[offsets[i]:offsets[i + 1]].reshape(p.shape) for i, p in enumerate(members)]
            transport = self.group.transport(members[0].device)
            staging = transport.staging_buffer(flat) if transport.staged else None
            gathers.append((flat, counts, list(zip(members, views)), transport, staging))
        return gathers

    def _drop_foreign_state(self):
        self.optimizer.state = {k: v for k, v in self.optimizer.state.items()
                                if self.owner.get(k, self.group.rank) == self.group.rank}

    def parameters(self) -> list[Tensor]:
        """Every parameter (of every rank's share): the wrapped optimizer's."""
        return self.optimizer.parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad: every gradient to None (or zeros)."""
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        """Update the parameters this rank owns (those with a gradient), then share them all."""
        rank, state = self.group.rank, self.optimizer.state
        self._consolidated = None  # out of date from now on
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and self.owner[id(p)] == rank:
                    self.optimizer._update(p, p.grad.data, group, state.setdefault(id(p), {}))
        for flat, counts, members, transport, staging in self._gathers:
            for p, view in members:
                if self.owner[id(p)] == rank:
                    view[...] = p.data
            transport.allgatherv(flat, counts, staging)
            for p, view in members:
                if self.owner[id(p)] != rank:
                    p.data[...] = view
                p.bump_version()  # updated here or by its owner

    # -- state dicts ----------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather every rank's share of the state on rank `to`, whose `state_dict()`
        then returns the whole state (the layout of the unsharded optimizer's). TypeError /
        ValueError for a `to` that is not a rank of the group."""
        to = check_int(to, "to", "ZeroRedundancyOptimizer.consolidate_state_dict", at_least=0,
                       at_most=self.group.size - 1)
        own = self.optimizer.state_dict()
        shares = self.group.gather_object(own["state"], root=to)
        if self.group.rank == to:
            merged = {}
            for share in shares:
                merged.update(share)
            own["state"] = dict(sorted(merged.items()))
            self._consolidated = own
        else:
            self._consolidated = None

    def state_dict(self) -> dict[str, Any]:
        """The whole state, on the rank that `consolidate_state_dict` gathered it on (call that
        first, on every rank); it loads into the unsharded optimizer too, on any number of ranks.
        RuntimeError elsewhere or before consolidating."""
        if self._consolidated is None:
            raise RuntimeError("ZeroRedundancyOptimizer.state_dict: call consolidate_state_dict() on every "
                               "rank first; the whole state is then on the rank it was gathered to")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (from any number of ranks, sharded or not) and keep this rank's share.
        Checked first as the wrapped optimizer's (ValueError or TypeError); a failed load changes
        nothing. A state consolidated before is forgotten (consolidate again to save)."""
        self.prepare_load_state_dict(state_dict)()

    def prepare_load_state_dict(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """Check `state_dict` as load_state_dict does, changing nothing; returns a function
        that loads it (it cannot fail)."""
        load = self.optimizer.prepare_load_state_dict(state_dict)

        def apply():
            load()
            self._drop_foreign_state()
            self._consolidated = None  # gathered before the load: out of date
        return apply

    def state_numel(self) -> int:
        """Entries of the state arrays this rank holds (about 1/N of the unsharded optimizer's)."""
        return sum(v.size for s in self.optimizer.state.values() for v in s.values() if hasattr(v, "size"))

    def __repr__(self):
        return f"ZeroRedundancyOptimizer({self.optimizer!r}, rank {self.group.rank} of {self.group.size})"
