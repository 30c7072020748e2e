"""Data-parallel training over MPI (mpi4py, imported only by `init()`), like torch.distributed:

    import npformer.distributed as dist
    dist.init()                                   # one rank of `python -m npformer.distributed.launch -n N script.py`
    ddp = dist.DistributedDataParallel(model)     # same weights everywhere, gradient all-reduce
    logits = ddp(src_shard, tgt_shard); loss = F.cross_entropy(...)
    opt.zero_grad(); loss.backward(); opt.step()  # .grad is the mean over ranks after backward

`scaled_loss(loss_sum, count)` gives the exact single-process loss when ranks hold different
numbers of valid tokens; `ZeroRedundancyOptimizer` splits the optimizer's state across ranks
(ZeRO-1); `npformer.training.Trainer` does all of this given a DistributedDataParallel.
Without `init()` a process is rank 0 of a world of 1 and everything here still works. The
launcher (npformer.distributed.launch) runs `mpiexec -n N python script.py` and also fails the job
when a rank was killed or called `os._exit`, which plain mpiexec may report as success.
See docs/distributed.md.
"""
from .comm import ProcessGroup, abort, barrier, group, init, is_initialized, rank, world_size
from .ddp import DistributedDataParallel, split_random_streams
from .loss import global_count, scaled_loss
from .zero import ZeroRedundancyOptimizer

__all__ = ["init", "is_initialized", "rank", "world_size", "barrier", "abort", "group", "ProcessGroup",
           "DistributedDataParallel", "ZeroRedundancyOptimizer", "global_count", "scaled_loss",
           "split_random_streams"]
