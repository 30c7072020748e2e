"""`DistributedDataParallel`: the gradient all-reduce as part of backward.

Every rank holds the same model and runs it on its own shard of the batch. When the last
contribution to a parameter's gradient has been added (the tape's post-accumulate-grad hook),
the gradient is final: it goes into its bucket, a persistent flat array of several parameters'
gradients (one device and dtype each), and the parameter's `.grad` becomes a view into it.
As soon as every gradient of a bucket is final, one non-blocking all-reduce (MPI Iallreduce)
sums the bucket over ranks while backward goes on with the layers below; buckets start in
one fixed order on every rank (reverse registration order: the output layers' gradients are
final first). When backward ends (a callback queued on the tape), the remaining buckets start,
every bucket is waited for and divided by the number of ranks: each `.grad` then holds the
mean over ranks. See docs/distributed.md.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from autograd import Tensor, backend
from autograd.checks import check_bool, check_real
from autograd.function import queue_callback
from npformer.runtime import random
from npformer.runtime.random import manual_seed

from ..nn import Module
from . import comm


class _Bucket:
    """The gradients of some parameters (one device and dtype) in one flat array:

        flat = [grad of p0 (flattened) | grad of p1 | ... | one 'used' flag per parameter]

    The flags say whether a rank produced a gradient for each parameter; summed with the
    gradients in the same message, they tell which parameters no rank used (their .grad stays
    None, as in one process)."""

    def __init__(self, params, transport):
        self.params, self.transport, self.device = params, transport, params[0].device
        sizes = [p.size for p in params]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.flat = params[0].xp.zeros(offsets[-1] + len(params), dtype=params[0].dtype)
        self.views = [self.flat[offsets[i]:offsets[i + 1]].reshape(p.shape) for i, p in enumerate(params)]
        self.used = self.flat[offsets[-1]:]
        self.staging = transport.staging_buffer(self.flat) if transport.staged else None
        self.final = 0  # parameters whose gradient is final in the running backward pass
        self.request = None

    def complete(self):
        """Whether every gradient of the bucket is final in the running backward pass."""
        return self.final == len(self.params)

    def start(self):
        """Move every gradient into the flat array (a no-op for those already viewing it) and
        begin the sum over ranks."""
        used = np.ones(len(self.params), dtype=self.flat.dtype)  # on the host: one transfer below
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if p.grad is None:  # no gradient on this rank: it adds zeros
                view[...] = 0
                used[i] = 0
            elif p.grad.data is not view:
                if p.grad.dtype != view.dtype or p.grad.device != self.device:
                    raise RuntimeError(f"DistributedDataParallel: a parameter of shape {p.shape} is now {p.dtype} on "
                                       f"'{p.device}' but was {view.dtype} on '{self.device}' when wrapped (its "
                                       "gradient would be cast); cast or move the model first, then wrap it")
                view[...] = p.grad.data
                p.grad = Tensor(view)
        self.used[...] = backend.to_device(used, backend.device_of(self.flat))
        self.request = self.transport.start_sum(self.flat, self.staging)

    def finish(self, world_size):
        """Wait for the sum, divide by the number of ranks, point .grad at the mean."""
        self.request.wait()
        self.request = None
        self.flat /= world_size
        used = backend.as_numpy(self.used) > 0  # one small read per bucket
        for p, view, any_rank_used in zip(self.params, self.views, used):
            p.grad = Tensor(view) if any_rank_used else None
        self.final = 0


class DistributedDataParallel(Module):
    """Data parallelism like torch.nn.parallel.DistributedDataParallel.

    At construction the parameters and buffers of rank 0 are copied to every rank (the same
    starting point) and, with per_rank_random, each rank's global random generators (dropout)
    are reseeded with one seed drawn on rank 0 and the rank (independent masks per rank).
    `ddp(*inputs)` runs `ddp.module`; when `loss.backward()` returns, the `.grad` of every
    parameter holds the mean over ranks (all-reduces overlap with the rest of backward).

    module: the model, already on its device and in its dtype (move it before wrapping; backward
        raises RuntimeError for a parameter cast or moved since).
    bucket_cap_mb: gradients per all-reduce message (MB); smaller buckets start earlier.
    group: the process group (default: `init()`'s world; a single process is a world of one).

    Every rank must run backward the same number of times, with `no_sync()` at the same places;
    a rank whose loss reaches no parameter at all in a pass never joins that pass's all-reduce.
    A parameter unfrozen (requires_grad set) or added after wrapping joins the buckets at the
    next `ddp(...)`, with rank 0's values (every rank must make the same change before it).
    A backward pass that raised (on every rank alike) is abandoned at the next `ddp(...)`: its
    all-reduces are completed, its gradients are partial (zero_grad before the next backward).
    Raises TypeError for a module that is not an npformer Module, a bucket_cap_mb that is not a
    number or a per_rank_random that is not a bool, ValueError for bucket_cap_mb <= 0 (inf: one
    bucket per device and dtype) and, on every rank, for ranks whose models differ (the first
    difference: `check_same_model`), RuntimeError in an MPI job whose `init()` was not called.
    """

    def __init__(self, module: Module, bucket_cap_mb: float = 25.0, group: comm.ProcessGroup | None = None,
                 per_rank_random: bool = True):
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(f"module: expected an npformer.nn.Module, got {type(module).__name__}")
        bucket_cap_mb = check_real(bucket_cap_mb, "bucket_cap_mb", "DistributedDataParallel", above=0, finite=False)
        per_rank_random = check_bool(per_rank_random, "per_rank_random", "DistributedDataParallel")
        group = comm.group() if group is None else group
        if group is comm.LOCAL and comm.launched_by_mpi():
            raise RuntimeError("DistributedDataParallel: this process is one rank of an MPI job but "
                               "npformer.distributed.init() was not called; call it first")
        self.module = module
        self.group = group
        check_same_model(module, group)
        for t in list(module.parameters()) + list(module.buffers()):
            group.broadcast_(t.data)
            t.bump_version()
        if per_rank_random and group.size > 1:
            split_random_streams(group)
        self._bucket_cap_mb, self._hooks = bucket_cap_mb, []
        weakref.finalize(self, _remove_hooks, self._hooks)  # a wrapper let go of leaves the model as it was
        self.buckets = self._make_buckets()
        self._sync, self._pass_open, self._next_bucket = True, False, 0
        self.timings = {"start": 0.0, "wait": 0.0, "passes": 0}  # seconds spent starting / finishing all-reduces

    def _make_buckets(self):
        """Parameters that require grad, last registered first, cut into buckets of at most
        bucket_cap_mb per (device, dtype) (a bigger parameter gets a bucket of its own)."""
        cap = self._bucket_cap_mb * 2 ** 20
        filling = {}  # (device, dtype) -> [parameters, bytes] of the bucket being filled
        members = []
        for p in [p for p in self.module.parameters() if p.requires_grad][::-1]:
            current = filling.get((p.device, p.dtype))
            if current is None or (current[0] and current[1] + p.data.nbytes > cap):
                current = filling[(p.device, p.dtype)] = [[], 0]
                members.append(current[0])
            current[0].append(p)
            current[1] += p.data.nbytes
        buckets = [_Bucket(params, self.group.transport(params[0].device)) for params in members]
        ddp = weakref.ref(self)  # the hooks hold the wrapper weakly (the model must not keep it and its buckets alive)
        for index, bucket in enumerate(buckets):
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, index=index: ddp()._gradient_final(index)))
        self._bucketed = {id(p) for bucket in buckets for p in bucket.params}
        return buckets

    def _rebucket(self):
        """New buckets for the parameters that require grad now, after some was unfrozen or
        added since the buckets were made (its gradient would not be averaged otherwise); the
        parameters new to the buckets start from rank 0's values, as at construction."""
        for p in self.module.parameters():
            if p.requires_grad and id(p) not in self._bucketed:
                self.group.broadcast_(p.data)
                p.bump_version()
        _remove_hooks(self._hooks)
        self.buckets = self._make_buckets()

    def forward(self, *args, **kwargs) -> Any:
        """`self.module(*args, **kwargs)`: the wrapped model's output, unchanged."""
        if self._pass_open:  # the last backward raised before its end, which never came
            self._abandon_pass()
        if any(p.requires_grad and id(p) not in self._bucketed for p in self.module.parameters()):
            self._rebucket()
        return self.module(*args, **kwargs)

    def _abandon_pass(self):
        """Complete the all-reduces a failed backward pass started (ranks whose pass failed alike
        started the same ones) and forget that pass, so that the next one synchronises again."""
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.request = None
            bucket.final = 0
        self._pass_open = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate local gradients (no communication); the
        first backward after it all-reduces the accumulated sums (gradient accumulation)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- during backward -----------------------------------------------------------------
    def _gradient_final(self, index):
        if not self._sync:
            return
        if not self._pass_open:
            self._pass_open, self._next_bucket = True, 0
            queue_callback(self._end_of_backward)
        self.buckets[index].final += 1
        self._start_ready_buckets()

    def _start_ready_buckets(self):
        """Start, in bucket order, every bucket whose gradients are all final (the same order on
        every rank, whatever order this rank's gradients became final in)."""
        start = time.perf_counter()
        buckets = self.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].complete():
            buckets[self._next_bucket].start()
            self._next_bucket += 1
        for bucket in buckets[:self._next_bucket]:  # let MPI move the messages in flight along
            if bucket.request is not None:
                bucket.request.test()
        self.timings["start"] += time.perf_counter() - start

    def _end_of_backward(self):
        start = time.perf_counter()
        for bucket in self.buckets[self._next_bucket:]:  # some parameter got no gradient in this pass
            bucket.start()
        for bucket in self.buckets:
            bucket.finish(self.group.size)
        self._pass_open = False
        self.timings["wait"] += time.perf_counter() - start
        self.timings["passes"] += 1

    def extra_repr(self) -> str:
        return f"ranks={self.group.size}, buckets={len(self.buckets)}"


def _remove_hooks(handles):
    """Unregister the parameters' hooks of a wrapper (`handles`, emptied)."""
    for handle in handles:
        handle.remove()
    handles.clear()


def model_signature(module: Module) -> list[tuple]:
    """What must be the same on every rank: (kind, name, shape, dtype, requires_grad) of each
    parameter and buffer, in registration order (the order of the broadcasts and the buckets)."""
    return ([("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()]
            + [("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in module.named_buffers()])


def check_same_model(module: Module, group: comm.ProcessGroup) -> None:
    """Raise ValueError on every rank unless every rank's `module` has the same parameters and
    buffers (names, shapes, dtypes, requires_grad); the message names the first difference and
    the ranks. Collective: one all-gather of a 16-byte digest, and of the signatures when they differ."""
    signature = model_signature(module)
    digests = group.all_gather_object(hashlib.sha256(repr(signature).encode()).hexdigest()[:32])
    if len(set(digests)) > 1:
        raise ValueError("DistributedDataParallel expects the same model on every rank: "
                         + first_difference(group.all_gather_object(signature)))


def first_difference(signatures: list[list[tuple]]) -> str:
    """The first difference between rank 0's `model_signature` and another rank's, in words
    ('' when all are the same)."""
    fields = ("shape", "dtype", "requires_grad")  # after (kind, name)
    reference = signatures[0]
    for rank, signature in enumerate(signatures[1:], start=1):
        for i, (mine, theirs) in enumerate(zip(reference, signature)):
            if mine[:2] != theirs[:2]:
                return (f"their parameters and buffers part at number {i}: {mine[0]} {mine[1]!r} on rank 0, "
                        f"{theirs[0]} {theirs[1]!r} on rank {rank}")
            if mine != theirs:
                at = next(k for k in range(len(fields)) if mine[2 + k] != theirs[2 + k])
                return (f"{mine[0]} {mine[1]!r}: {fields[at]} {mine[2 + at]!r} on rank 0, "
                        f"{theirs[2 + at]!r} on rank {rank}")
        if len(reference) != len(signature):
            longer, shorter = (0, rank) if len(reference) > len(signature) else (rank, 0)
            kind, name = signatures[longer][min(len(reference), len(signature))][:2]
            return (f"rank {shorter} has {min(len(reference), len(signature))} parameters and buffers, rank {longer} "
                    f"{max(len(reference), len(signature))}; the first one missing on rank {shorter}: {kind} {name!r}")
    return ""


def split_random_streams(group: comm.ProcessGroup) -> None:
    """Give each rank its own stream of the global random generators (dropout): reseed them
    with one number drawn on rank 0 combined with the rank. Collective."""
    base = group.broadcast_object(int(random.global_rng("cpu").integers(2 ** 62)) if group.rank == 0 else None)
    manual_seed(int(np.random.SeedSequence([base, group.rank]).generate_state(1)[0]))
