"""Scenarios of data-parallel training, run on every rank of an MPI job by
test_distributed.py (this is not a test module itself):

    mpiexec -n 2 python tests/distributed/distributed_worker.py OUT SCENARIO [SCENARIO ...]

Each scenario trains in float64 with DistributedDataParallel on this rank's share of every
batch and, in the same process, a reference in one process (no DDP) on the whole batches,
and reports how far apart they end. Every rank writes OUT/rank<r>.json: {scenario: {...}}.
The fault scenarios ("raise", "sys_exit", "sys_exit_zero", "os_exit", "thread_raises",
"different_models", "train_with_checkpoints") end the job early.
"""
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

import autograd  # noqa: E402
import npformer  # noqa: E402
import npformer.distributed as dist  # noqa: E402
import npformer.functional as F  # noqa: E402
from autograd import backend  # noqa: E402
from npformer import nn, optim  # noqa: E402
from npformer.data import PAD, RandomBatches, SequenceTask, shard  # noqa: E402
from npformer.models import CausalLM, Seq2SeqTransformer  # noqa: E402
from npformer.training import Seq2SeqTrainer, Trainer, causal_lm_loss  # noqa: E402

VOCAB, STEPS, BATCH = 12, 20, 8


def seq2seq(seed=0, device="cpu"):
    npformer.manual_seed(seed)
    model = Seq2SeqTransformer(VOCAB, VOCAB, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.0, max_len=16, pad_idx=PAD)
    return model.double().to(device)


def max_difference(a, b):
    """Largest |a - b| over the parameters of two models with the same architecture."""
    return max(float(np.abs(backend.as_numpy(p.data) - backend.as_numpy(q.data)).max())
               for p, q in zip(a.parameters(), b.parameters()))


def parameters_of(model):
    return {name: backend.as_numpy(p.data).tolist() for name, p in model.named_parameters()}


def batches(steps, batch=BATCH, length=5, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, VOCAB, (batch, length)), rng.integers(3, VOCAB, (batch, length))) for _ in range(steps)]


def step_mean_loss(model, optimizer, src, tgt):
    """The usage of the README: forward, mean cross-entropy, zero_grad, backward, step."""
    logits = model(src, tgt)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def raw_loop(make_optimizer, device="cpu"):
    """20 steps of the plain loop: DDP on B/world per rank vs one process on B."""
    group = dist.group()
    reference = seq2seq(device=device)
    model = seq2seq(device=device)
    ddp = dist.DistributedDataParallel(model)
    ref_opt, opt = make_optimizer(reference), make_optimizer(model)
    for src, tgt in batches(STEPS):
        mine = shard(len(src), group.rank, group.size)
        step_mean_loss(reference, ref_opt, src, tgt)
        step_mean_loss(ddp, opt, src[mine], tgt[mine])
    return {"max_difference": max_difference(model, reference), "buckets": len(ddp.buckets)}


def scenario_sgd():
    return raw_loop(lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9))


# Adam's worst case is the key projection's bias: its true gradient is 0 (softmax ignores a
# constant added to a row), so the computed one is rounding noise (~1e-17) that differs with the
# order of the sums; Adam turns it into updates of lr * noise / eps. lr 1e-3 keeps 20 of them
# far below 1e-10 (every other parameter agrees to ~1e-16).
def scenario_adam():
    return raw_loop(lambda m: optim.Adam(m.parameters(), lr=1e-3))


def scenario_test_device():
    """The host-staging path (device arrays copied through host buffers) on the "test" device."""
    return raw_loop(lambda m: optim.Adam(m.parameters(), lr=1e-3), device="test")


def task():
    return SequenceTask("reverse", vocab_size=VOCAB, min_len=2, max_len=7, seed=3, heldout_size=40)


def seq2seq_trainer(model, **options):
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    sched = optim.WarmupCosineLR(opt, warmup_steps=3, total_steps=STEPS)
    return Seq2SeqTrainer(model, opt, task(), scheduler=sched, batch_size=BATCH, label_smoothing=0.1,
                          clip_norm=0.5, progress=False, grad_norm_every=5, **options)


def scenario_trainer_padding():
    """Through the Trainer: variable lengths (padding, EOS), PAD ignored, label smoothing and
    clipping; ranks hold different numbers of valid tokens."""
    reference = seq2seq_trainer(seq2seq())
    trainer = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()))
    ref_result, result = reference.fit(STEPS), trainer.fit(STEPS)
    tokens = [int((task().batch(BATCH, r, 2).tgt_out != PAD).sum()) for r in range(2)]
    return {"max_difference": max_difference(trainer.module, reference.module),
            "loss_difference": float(np.abs(np.subtract(trainer.history["loss"], reference.history["loss"])).max()),
            "result": result, "reference_result": ref_result, "first_batch_tokens_per_rank": tokens}


def scenario_zero():
    """ZeRO-1 (shard_optimizer=True) against unsharded DDP: the same parameters, half the state."""
    plain = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()))
    sharded = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()), shard_optimizer=True)
    plain.fit(10)
    sharded.fit(10)
    full = sum(v.size for s in plain.optimizer.state.values() for v in s.values() if hasattr(v, "size"))
    return {"max_difference": max_difference(plain.module, sharded.module),
            "state_numel": sharded.optimizer.state_numel(), "unsharded_state_numel": full}


def lm_data(seed=5, n=64, length=9):
    """Token ids of varying lengths, PAD after each sequence (the targets at PAD are ignored)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (n, length))
    lengths = rng.integers(3, length + 1, n)
    ids[np.arange(length)[None, :] >= lengths[:, None]] = PAD
    return ids


def lm_trainer(model, rank, world_size):
    data = RandomBatches(lm_data(), batch_size=BATCH, seed=2, rank=rank, world_size=world_size)
    return Trainer(model, optim.Adam(model.parameters(), lr=1e-2), data, causal_lm_loss(ignore_index=PAD),
                   progress=False)


def scenario_lm_trainer():
    """The generic Trainer: a causal LM on padded batches sharded by RandomBatches."""
    def lm():
        npformer.manual_seed(0)
        return CausalLM(VOCAB, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, dropout=0.0, max_len=16,
                        pad_idx=PAD).double()
    group = dist.group()
    reference = lm_trainer(lm(), 0, 1)
    trainer = lm_trainer(dist.DistributedDataParallel(lm()), group.rank, group.size)
    reference.fit(10)
    trainer.fit(10)
    return {"max_difference": max_difference(trainer.module, reference.module)}


def scenario_no_sync():
    """Gradient accumulation: two micro-batches under no_sync, the third synchronises; the
    gradient equals one process's over the three whole batches."""
    group = dist.group()
    reference, model = seq2seq(), seq2seq()
    ddp = dist.DistributedDataParallel(model)
    for i, (src, tgt) in enumerate(batches(3)):
        mine = shard(len(src), group.rank, group.size)
        logits = reference(src, tgt)
        F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1)).backward()
        logits = ddp(src[mine], tgt[mine])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt[mine].reshape(-1))
        if i < 2:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    return {"max_difference": max(float(np.abs(p.grad - q.grad).max())
                                  for p, q in zip(model.parameters(), reference.parameters()))}


class TwoBranches(nn.Module):
    """Rank 0 uses branch a only, rank 1 both; `never` is used by no rank."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.never = nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x, use_b):
        out = self.a(x)
        return out + self.b(x) if use_b else out


def scenario_unused_parameters():
    group = dist.group()
    npformer.manual_seed(0)
    model = TwoBranches().double()
    ddp = dist.DistributedDataParallel(model)
    x = autograd.Tensor(np.full((4, 3), float(group.rank + 1)))
    (ddp(x, use_b=group.rank == 1) ** 2).sum().backward()
    expected = {}  # the mean over ranks of each rank's own gradient, computed here from scratch
    for r in range(group.size):
        local = TwoBranches().double()
        local.load_state_dict(model.state_dict())
        (local(autograd.Tensor(np.full((4, 3), float(r + 1))), use_b=r == 1) ** 2).sum().backward()
        for name, p in local.named_parameters():
            if p.grad is not None:
                expected[name] = expected.get(name, 0) + p.grad / group.size
    grads = dict(model.named_parameters())
    return {"max_difference": max(float(np.abs(grads[n].grad - g).max()) for n, g in expected.items()),
            "never_grad_is_none": grads["never.weight"].grad is None and grads["never.bias"].grad is None}


class FailingBackward(autograd.Function):
    """The identity, whose backward raises while `failing` is set."""
    failing = False

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if FailingBackward.failing:
            raise FloatingPointError("a failed backward")
        return grad


class FailsBetweenLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.last(FailingBackward.apply(self.first(x)))


def scenario_failed_backward():
    """Every rank's backward raises after the output layer's buckets started; the ranks catch
    it, and the next pass's gradients are again the mean over ranks."""
    group = dist.group()

    def model():
        npformer.manual_seed(0)
        return FailsBetweenLayers().double()
    ddp = dist.DistributedDataParallel(model(), bucket_cap_mb=1e-5)  # one bucket per parameter

    def data(rank):
        return autograd.Tensor(np.linspace(-1, 1, 6).reshape(2, 3) * (rank + 1))
    FailingBackward.failing = True
    try:
        (ddp(data(group.rank)) ** 2).sum().backward()
    except FloatingPointError:
        pass
    FailingBackward.failing = False
    ddp.zero_grad()
    (ddp(data(group.rank)) ** 2).sum().backward()
    expected = {}  # the mean over ranks of each rank's own gradient
    for r in range(group.size):
        local = model()
        (local(data(r)) ** 2).sum().backward()
        for name, p in local.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad / group.size
    return {"max_difference": max(float(np.abs(p.grad - expected[name]).max())
                                  for name, p in ddp.module.named_parameters())}


def scenario_unfrozen_after_wrapping():
    """Fine-tuning with gradual unfreezing: `never` (unused) and `b` frozen when wrapped, `b`
    unfrozen before a later step; its gradient is then averaged like the others'."""
    group = dist.group()

    def model():
        npformer.manual_seed(0)
        m = TwoBranches().double()
        for p in m.b.parameters():
            p.requires_grad = False
        return m
    ddp = dist.DistributedDataParallel(model())

    def data(rank):
        return autograd.Tensor(np.full((4, 3), float(rank + 1)))
    (ddp(data(group.rank), use_b=True) ** 2).sum().backward()
    for p in ddp.module.b.parameters():
        p.requires_grad = True
    ddp.zero_grad()
    (ddp(data(group.rank), use_b=True) ** 2).sum().backward()
    expected = {}  # the mean over ranks of each rank's own gradient
    for r in range(group.size):
        local = model()
        for p in local.b.parameters():
            p.requires_grad = True
        (local(data(r), use_b=True) ** 2).sum().backward()
        for name, p in local.named_parameters():
            if p.grad is not None:
                expected[name] = expected.get(name, 0) + p.grad / group.size
    grads = dict(ddp.module.named_parameters())
    return {"max_difference": max(float(np.abs(grads[n].grad - g).max()) for n, g in expected.items()),
            "b_grad_none": grads["b.weight"].grad is None}


def scenario_resume_across_world_sizes():
    """1 -> 2: a checkpoint saved by one process continues on 2 ranks; 2 -> 1: the 2-rank
    (ZeRO-1) run saves at step 5 (rank 0 writes OUT/two_ranks.npz) for the test to resume alone."""
    group = dist.group()
    out = sys.argv[1]
    single = seq2seq_trainer(seq2seq())
    single.fit(5)
    path = os.path.join(out, f"single_rank{group.rank}.npz")
    single.save(path)
    single.fit(10)
    resumed = seq2seq_trainer(dist.DistributedDataParallel(seq2seq(seed=7)), shard_optimizer=True)
    resumed.resume(path)
    resumed.fit(10)
    two = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()), shard_optimizer=True)
    two.fit(5)
    two.save(os.path.join(out, "two_ranks.npz"))
    two.fit(10)
    return {"one_to_two_max_difference": max_difference(resumed.module, single.module),
            "two_ranks_final": parameters_of(two.module)}


def scenario_collectives():
    """The communicator on arrays of any layout, against numpy: sum_ and broadcast_ in place on
    non-contiguous views (the entries outside the view untouched), 0-d, empty and integer
    arrays, on "cpu" and "test". Returns the names of the cases that came out wrong."""
    group = dist.group()
    wrong = []

    def check(name, got, expected):
        if not np.array_equal(backend.as_numpy(got), expected):
            wrong.append(name)

    def local(rank):
        return np.arange(12.0).reshape(3, 4) * (rank + 1)

    ranks = range(group.size)
    for device in ("cpu", "test"):
        whole = backend.to_device(local(group.rank), device)
        returned = group.sum_(whole[:, ::2])
        expected = local(group.rank)
        expected[:, ::2] = sum(local(r)[:, ::2] for r in ranks)
        check(f"{device} sum_ of a strided view", whole, expected)
        check(f"{device} sum_ returns the summed view", returned, expected[:, ::2])
        check(f"{device} sum_ of 0-d", group.sum_(backend.to_device(np.array(group.rank + 1.0), device)),
              np.array(sum(r + 1.0 for r in ranks)))
        check(f"{device} sum_ of an empty array", group.sum_(backend.to_device(np.zeros((0, 3)), device)),
              np.zeros((0, 3)))
        check(f"{device} sum_ of int64", group.sum_(backend.to_device(np.array([group.rank, 7]), device)),
              np.array([sum(ranks), 7 * group.size]))
        whole = backend.to_device(local(group.rank), device)
        group.broadcast_(whole[::2, 1:])
        expected = local(group.rank)
        expected[::2, 1:] = local(0)[::2, 1:]
        check(f"{device} broadcast_ of a strided view", whole, expected)
        check(f"{device} broadcast_ of 0-d", group.broadcast_(backend.to_device(np.array(group.rank + 1.0), device)),
              np.array(1.0))
    return {"wrong": wrong}


# -- faults: these end the job ------------------------------------------------------------------
def scenario_raise():
    """Rank 1 raises during training while rank 0 waits in the next collective."""
    group = dist.group()
    trainer = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()))
    trainer.fit(3)
    if group.rank == 1:
        raise ValueError("a deliberate failure on rank 1")
    trainer.fit(1000)


def leave_after_three_steps(leave):
    """Rank 1 calls `leave()` after 3 training steps while rank 0 trains on for 1000."""
    trainer = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()))
    trainer.fit(3)
    if dist.rank() == 1:
        leave()
    trainer.fit(1000)


def scenario_sys_exit():
    leave_after_three_steps(lambda: sys.exit(3))


def scenario_sys_exit_zero():
    leave_after_three_steps(lambda: sys.exit(0))


def scenario_os_exit():
    leave_after_three_steps(lambda: os._exit(0))


def scenario_thread_raises():
    """Every rank trains in a thread; rank 1's raises after 3 steps and its main thread ends normally."""
    def fail():
        raise ValueError("a deliberate failure in a thread")
    thread = threading.Thread(target=leave_after_three_steps, args=(fail,), name="trainer")
    thread.start()
    thread.join()
    sys.exit(0)


def scenario_uneven_end():
    """Rank 0 works alone for 2 s after the last collective; rank 1 reaches the end first."""
    seq2seq_trainer(dist.DistributedDataParallel(seq2seq())).fit(3)
    if dist.rank() == 0:
        time.sleep(2)
    return {}


def scenario_different_models():
    """Rank 1's model has a wider feed-forward layer: wrapping it names the first difference."""
    npformer.manual_seed(0)
    model = Seq2SeqTransformer(VOCAB, VOCAB, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32 if dist.rank() == 0 else 48, dropout=0.0, max_len=16, pad_idx=PAD)
    dist.DistributedDataParallel(model)


def scenario_train_with_checkpoints():
    """Trains for a long time with a checkpoint every 2 steps; each rank writes its pid."""
    group = dist.group()
    out = sys.argv[1]
    with open(os.path.join(out, f"pid{group.rank}"), "w") as f:
        f.write(str(os.getpid()))
    trainer = seq2seq_trainer(dist.DistributedDataParallel(seq2seq()))
    trainer.fit(100000, checkpoint_path=os.path.join(out, "checkpoint.npz"), checkpoint_every=2)


def main():
    out, names = sys.argv[1], sys.argv[2:]
    group = dist.init()
    results = {}
    for name in names:
        start = time.perf_counter()
        results[name] = globals()[f"scenario_{name}"]()
        results[name]["seconds"] = time.perf_counter() - start
    with open(os.path.join(out, f"rank{group.rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
