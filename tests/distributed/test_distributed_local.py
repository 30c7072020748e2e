"""The pieces of data parallelism that run in one process: the tape's post-accumulate-grad hook
and end-of-backward callback, DistributedDataParallel in a world of one (buckets, views, dtypes),
exact loss scaling, and sharded data (data.shard, SequenceTask.batch, RandomBatches).
The launcher's command line and a rank's side of it. The real multi-rank runs are in
test_distributed.py."""
import contextlib
import os
import sys
import tempfile
import weakref

import numpy as np
import pytest

import autograd
import npformer
import npformer.distributed as dist
from npformer.distributed import comm, launch, reports
from npformer.distributed.launch import run, split_command
import npformer.functional as F
from autograd import Tensor
from autograd.function import queue_callback
from npformer import nn, optim
from npformer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from npformer.data import PAD, RandomBatches, SequenceTask, shard
from npformer.models import Seq2SeqTransformer

from distributed_worker import FailingBackward, FailsBetweenLayers  # the 2-rank scenario's model


# -- the tape's hooks ------------------------------------------------------------------------------
def test_post_accumulate_grad_hook_fires_once_when_the_gradient_is_final(rng):
    w, x = Tensor(rng.normal(size=3), requires_grad=True), Tensor(rng.normal(size=3), requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
    y = (w * x).sum() + (w * w).sum() + w.sum()  # three contributions to w's gradient
    y.backward()
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], w.grad)
    np.testing.assert_allclose(w.grad, x.data + 2 * w.data + 1, rtol=1e-6)


def test_the_hook_of_a_late_layer_fires_before_earlier_layers_have_gradients(rng):
    first = Tensor(rng.normal(size=(3, 3)), requires_grad=True)
    last = Tensor(rng.normal(size=(3, 3)), requires_grad=True)
    grads_when_last_final = []
    last.register_post_accumulate_grad_hook(lambda t: grads_when_last_final.append(first.grad))
    x = Tensor(rng.normal(size=(2, 3)))
    ((x @ first).tanh() @ last).sum().backward()
    assert grads_when_last_final == [None]  # room to start communicating `last` while backward goes on
    assert first.grad is not None


def test_queue_callback_runs_once_after_every_hook_and_only_inside_backward(rng):
    w = Tensor(rng.normal(size=3), requires_grad=True)
    events = []

    def hook(t):
        events.append("hook")
        queue_callback(lambda: events.append(("end", t.grad is not None)))
    handle = w.register_post_accumulate_grad_hook(hook)
    (w * w).sum().backward()
    assert events == ["hook", ("end", True)]
    handle.remove()
    (w * w).sum().backward()
    assert events == ["hook", ("end", True)]  # removed: nothing more
    with pytest.raises(RuntimeError, match="no backward pass is running"):
        queue_callback(lambda: None)


def test_hooks_and_callbacks_run_with_grad_mode_off_like_torchs(torch):
    """torch's engine runs a backward pass (without create_graph), its hooks and its callbacks with
    grad mode off: an op in a hook (an optimizer step in backward, a norm) records no graph; grad
    mode is back on after backward."""
    def seen_in_backward(lib, tensor, callback):
        w, seen = tensor(np.ones(3), requires_grad=True), []

        def hook(t):
            seen.append((lib.is_grad_enabled(), (t * 2.0).requires_grad))
            callback(lambda: seen.append(lib.is_grad_enabled()))
        w.register_post_accumulate_grad_hook(hook)
        (w * w).sum().backward()
        return seen + [lib.is_grad_enabled()]
    expected = [(False, False), False, True]
    assert seen_in_backward(torch, torch.tensor, torch.autograd.Variable._execution_engine.queue_callback) == expected
    assert seen_in_backward(autograd, Tensor, queue_callback) == expected


def test_hooks_on_leaves_only_and_not_for_leaves_without_gradient(rng):
    w = Tensor(rng.normal(size=3), requires_grad=True)
    with pytest.raises(RuntimeError, match="only leaves"):
        (w * 2).register_post_accumulate_grad_hook(lambda t: None)
    with pytest.raises(TypeError, match="hook: expected a callable"):
        w.register_post_accumulate_grad_hook(3)
    unused, fired = Tensor(rng.normal(size=3), requires_grad=True), []
    unused.register_post_accumulate_grad_hook(fired.append)
    w.register_post_accumulate_grad_hook(fired.append)
    w.backward(np.ones(3, dtype=w.dtype))  # backward straight from a leaf fires its hook too
    assert fired == [w] and unused.grad is None


# -- DDP in a world of one -------------------------------------------------------------------------------
def model():
    npformer.manual_seed(0)
    return Seq2SeqTransformer(12, 12, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                              dim_feedforward=32, dropout=0.0, pad_idx=PAD).double()


def loss_of(m, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    src, tgt = rng.integers(3, 12, (4, 5)), rng.integers(3, 12, (4, 5))
    return F.cross_entropy(m(src, tgt).reshape(-1, 12), tgt.reshape(-1))


def test_ddp_of_one_process_changes_no_gradient_and_grads_are_bucket_views():
    plain, wrapped = model(), model()
    ddp = dist.DistributedDataParallel(wrapped, bucket_cap_mb=0.01)
    loss_of(plain).backward()
    loss_of(ddp).backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)
    assert len(ddp.buckets) > 1 and ddp.timings["passes"] == 1
    views = {id(v) for b in ddp.buckets for v in b.views}
    assert all(id(p.grad.data) in views for p in wrapped.parameters())
    # the buckets hold the parameters last registered first (the output layers' gradients are final first)
    order = [p for b in ddp.buckets for p in b.params]
    assert order == list(wrapped.parameters())[::-1]
    assert all(b.flat.nbytes <= 0.01 * 2 ** 20 + 8 * len(b.params) or len(b.params) == 1 for b in ddp.buckets)
    assert "ranks=1" in repr(ddp) and ddp.module is wrapped


def test_a_ddp_wrapper_let_go_of_is_freed_and_leaves_the_model_as_it_was(no_gc):
    """As torch's (whose reducer removes its hooks when it goes): the model's parameters' hooks do
    not keep the wrapper and its buckets alive, and no longer run once it is gone."""
    wrapped = model()
    ddp = dist.DistributedDataParallel(wrapped, bucket_cap_mb=0.01)
    loss_of(ddp).backward()
    gone = weakref.ref(ddp)
    del ddp
    assert gone() is None                           # by reference counting alone
    assert all(not p._post_accumulate_grad_hooks for p in wrapped.parameters())
    wrapped.zero_grad()
    loss_of(wrapped).backward()                     # the bare model's gradients are its own again
    plain = model()
    loss_of(plain).backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)


class Mixed(nn.Module):
    """A float32 layer, then a float64 one."""

    def __init__(self):
        super().__init__()
        self.low, self.high = nn.Linear(3, 4), nn.Linear(4, 2).double()

    def forward(self, x):
        return self.high(self.low(x).to(dtype="float64"))


def test_ddp_buckets_keep_dtypes_apart_and_accumulate_across_backwards():
    npformer.manual_seed(0)
    m, once = Mixed(), Mixed()
    once.load_state_dict(m.state_dict())
    ddp = dist.DistributedDataParallel(m)
    assert sorted(str(b.flat.dtype) for b in ddp.buckets) == ["float32", "float64"]
    x = Tensor(np.ones((2, 3), dtype=np.float32))
    for _ in range(2):  # no zero_grad: the second backward adds to the first, in the bucket views
        ddp(x).sum().backward()
    once(x).sum().backward()
    for p, q in zip(m.parameters(), once.parameters()):
        np.testing.assert_allclose(p.grad, 2 * q.grad, rtol=1e-6)


@pytest.mark.parametrize("change", ["double", "test device"])
def test_ddp_refuses_a_model_cast_or_moved_after_wrapping(change):
    npformer.manual_seed(0)
    m = nn.Linear(3, 2)
    ddp = dist.DistributedDataParallel(m)
    ddp.double() if change == "double" else ddp.to("test")  # the buckets stay float32 on the CPU
    x = Tensor(np.ones((2, 3), dtype=m.weight.dtype)).to(m.weight.device)
    with pytest.raises(RuntimeError, match="when wrapped .* cast or move the model first, then wrap it"):
        ddp(x).sum().backward()


def test_ddp_buckets_parameters_unfrozen_or_added_after_wrapping():
    npformer.manual_seed(0)
    m = ThreeBranches().double()
    for p in m.b.parameters():
        p.requires_grad = False
    ddp = dist.DistributedDataParallel(m)
    x = Tensor(np.ones((2, 3)))
    ddp(x, True).sum().backward()
    for p in m.b.parameters():
        p.requires_grad = True
    m.extra = nn.Linear(3, 2).double()  # unused: in a bucket, its .grad stays None
    ddp.zero_grad()
    ddp(x, True).sum().backward()
    bucketed = [p for b in ddp.buckets for p in b.params]
    views = {id(v) for b in ddp.buckets for v in b.views}
    for p in list(m.b.parameters()) + list(m.extra.parameters()):
        assert any(p is q for q in bucketed)
    assert all(id(p.grad.data) in views for p in m.b.parameters()) and m.extra.weight.grad is None
    assert sum(len(p._post_accumulate_grad_hooks) for p in m.parameters()) == len(bucketed)  # no stale hooks


def test_ddp_synchronises_again_after_a_backward_that_raised(monkeypatch):
    npformer.manual_seed(0)
    m, plain = FailsBetweenLayers().double(), FailsBetweenLayers().double()
    plain.load_state_dict(m.state_dict())
    ddp = dist.DistributedDataParallel(m, bucket_cap_mb=1e-5)  # one bucket per parameter
    x = Tensor(np.linspace(-1, 1, 6).reshape(2, 3))
    monkeypatch.setattr(FailingBackward, "failing", True)
    with pytest.raises(FloatingPointError):  # after the last layer's buckets started
        ddp(x).sum().backward()
    monkeypatch.setattr(FailingBackward, "failing", False)
    for p in m.parameters():
        p.grad = None
    ddp(x).sum().backward()
    plain(x).sum().backward()
    assert ddp.timings["passes"] == 1  # this pass was all-reduced (with several ranks: averaged)
    views = {id(v) for b in ddp.buckets for v in b.views}
    for p, q in zip(m.parameters(), plain.parameters()):
        assert id(p.grad.data) in views
        np.testing.assert_array_equal(p.grad, q.grad)


class ThreeBranches(nn.Module):
    """`a` always used, `b` when asked, `never` never; `frozen` does not require grad."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.never, self.frozen = (nn.Linear(3, 2) for _ in range(4))

    def forward(self, x, use_b):
        out = self.a(x) + self.frozen(x)
        return out + self.b(x) if use_b else out


@pytest.fixture
def torch_world_of_one(torch, tmp_path):
    """torch.distributed initialised in this process: gloo, rank 0 of 1."""
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                                         world_size=1)
    try:
        yield torch
    finally:
        torch.distributed.destroy_process_group()


def test_ddp_gradients_match_torch_ddp_with_unused_parameters_no_sync_and_accumulation(torch_world_of_one):
    """A world of one against torch's DistributedDataParallel (gloo, find_unused_parameters):
    the same .grad (None where torch has None) after a pass with a branch unused, after a
    no_sync pass using it followed by a synchronised one without it, and without zero_grad."""
    torch = torch_world_of_one
    npformer.manual_seed(0)
    class TorchThreeBranches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.never, self.frozen = (torch.nn.Linear(3, 2) for _ in range(4))
        forward = ThreeBranches.forward

    ours, theirs = ThreeBranches().double(), TorchThreeBranches().double()
    with torch.no_grad():
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            q.copy_(torch.from_numpy(p.data))
    ours.frozen.weight.requires_grad = ours.frozen.bias.requires_grad = False
    theirs.frozen.requires_grad_(False)
    ddp = dist.DistributedDataParallel(ours)
    reference = torch.nn.parallel.DistributedDataParallel(theirs, find_unused_parameters=True)
    xs = np.random.default_rng(0).normal(size=(3, 4, 3))

    def backward(use_b, x, sync=True):
        for model, tensor in ((ddp, Tensor(x)), (reference, torch.from_numpy(x))):
            with contextlib.nullcontext() if sync else model.no_sync():
                (model(tensor, use_b) ** 2).sum().backward()

    def compare():
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                np.testing.assert_allclose(p.grad, q.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)
    backward(False, xs[0])
    compare()
    backward(True, xs[1], sync=False)
    backward(False, xs[2])
    compare()


def test_ddp_refuses_a_rank_of_an_mpi_job_without_init(monkeypatch):
    monkeypatch.setattr(comm, "_world", None)  # as before init()
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"init\(\) was not called"):
        dist.DistributedDataParallel(model())
    with pytest.raises(TypeError, match="module: expected an npformer.nn.Module"):
        dist.DistributedDataParallel(lambda x: x)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        dist.DistributedDataParallel(model(), bucket_cap_mb=0)


def test_the_first_difference_between_ranks_models_is_named():
    """What DistributedDataParallel says when ranks' models differ (the 2-rank job is in
    test_distributed.py): the first differing entry of the first rank that differs from rank 0."""
    from npformer.distributed.ddp import first_difference, model_signature
    reference = model_signature(model())
    assert reference[0] == ("parameter", "src_embed.weight", (12, 16), "float64", True)
    assert reference[-1] == ("buffer", "positional.pe", (5000, 16), "float64", False)

    def changed(i, **fields):
        kind, name, shape, dtype, grad = reference[i]
        entry = dict(kind=kind, name=name, shape=shape, dtype=dtype, requires_grad=grad) | fields
        return reference[:i] + [tuple(entry.values())] + reference[i + 1:]
    name = repr(reference[2][1])
    assert first_difference([reference, reference]) == ""
    assert first_difference([reference, reference, changed(2, shape=(7,))]) == \
        f"parameter {name}: shape {reference[2][2]!r} on rank 0, (7,) on rank 2"
    assert first_difference([reference, changed(2, dtype="float32")]) == \
        f"parameter {name}: dtype 'float64' on rank 0, 'float32' on rank 1"
    assert first_difference([reference, changed(2, requires_grad=False)]) == \
        f"parameter {name}: requires_grad True on rank 0, False on rank 1"
    assert first_difference([reference, changed(2, name="other")]) == \
        f"their parameters and buffers part at number 2: parameter {name} on rank 0, parameter 'other' on rank 1"
    assert first_difference([reference, reference[:-1]]) == \
        (f"rank 1 has {len(reference) - 1} parameters and buffers, rank 0 {len(reference)}; the first one missing "
         "on rank 1: buffer 'positional.pe'")
    assert first_difference([reference[:-1], reference]).startswith(f"rank 0 has {len(reference) - 1} parameters")
    dist.DistributedDataParallel(model())  # a world of one has one model: nothing to compare


@pytest.mark.parametrize("call, error, message", [
    (lambda: dist.DistributedDataParallel(model(), bucket_cap_mb="25"), TypeError,
     "bucket_cap_mb must be a real number > 0, got '25' of type str"),
    (lambda: dist.DistributedDataParallel(model(), bucket_cap_mb=float("nan")), ValueError, "bucket_cap_mb"),
    (lambda: dist.DistributedDataParallel(model(), per_rank_random="no"), TypeError,
     "per_rank_random must be True or False, got 'no'"),
    (lambda: dist.init(cuda_aware=1), TypeError, "init: cuda_aware must be True or False"),
    (lambda: dist.global_count("3"), TypeError, "global_count: count must be a finite real number, got '3'"),
    (lambda: dist.global_count(None), TypeError, "count must be a finite real number, got None"),
    (lambda: dist.scaled_loss(Tensor(np.array(6.0)), True), TypeError, r"count must be .* \(a bool, not a number\)"),
    (lambda: dist.scaled_loss(Tensor(np.array(6.0)), float("inf")), ValueError, "count must be a finite"),
    (lambda: dist.scaled_loss(Tensor(np.array(6.0)), [3]), TypeError, "count must be"),
    (lambda: dist.scaled_loss(6.0, 3), TypeError, "loss_sum must be a Tensor .* got float"),
    (lambda: dist.ZeroRedundancyOptimizer(optim.SGD(model().parameters())).consolidate_state_dict(to=1),
     ValueError, r"to must be an integer in \[0, 0\], got 1"),
])
def test_arguments_are_checked(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_arguments_of_any_real_type_are_taken():
    m = model()
    ddp = dist.DistributedDataParallel(m, bucket_cap_mb=np.float32(0.01), per_rank_random=np.bool_(False))
    assert len(ddp.buckets) > 1 and dist.DistributedDataParallel(model(), bucket_cap_mb=float("inf")).buckets
    assert dist.global_count(np.int64(7)) == 7 and dist.global_count(2.5) == 2.5
    assert dist.scaled_loss(Tensor(np.array(6.0)), np.int32(3)).item() == 2.0


def test_one_process_is_rank_0_of_1():
    assert (dist.rank(), dist.world_size()) == (0, 1)  # initialised or not (the README's example calls init)
    dist.barrier()
    assert dist.global_count(7) == 7


def test_scaled_loss_is_the_mean_in_one_process():
    total = Tensor(np.array(12.0), requires_grad=True)
    loss = dist.scaled_loss(total, 4)
    assert loss.item() == 3.0
    loss.backward()
    assert total.grad.item() == 0.25
    with pytest.raises(ValueError, match="nothing to average"):
        dist.scaled_loss(total, 0)


# -- ZeRO-1 in a world of one ---------------------------------------------------------------------------
def test_zero_steps_like_its_optimizer_and_a_load_forgets_the_consolidated_state():
    plain, sharded = model(), model()
    reference = optim.Adam(plain.parameters(), lr=1e-2)
    zero = dist.ZeroRedundancyOptimizer(optim.Adam(sharded.parameters(), lr=1e-2))
    for seed in range(3):
        for m, opt in ((plain, reference), (sharded, zero)):
            opt.zero_grad()
            loss_of(m, seed).backward()
            opt.step()
    for p, q in zip(plain.parameters(), sharded.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    zero.consolidate_state_dict()
    expected, gathered = reference.state_dict(), zero.state_dict()
    assert gathered["param_groups"] == expected["param_groups"] and gathered["state"].keys() == expected["state"].keys()
    for i, entries in expected["state"].items():
        for name, value in entries.items():
            np.testing.assert_array_equal(gathered["state"][i][name], value)
    zero.load_state_dict(optim.Adam(model().parameters(), lr=0.5).state_dict())  # no state yet, another lr
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(\)"):
        zero.state_dict()  # not the state gathered before the load
    zero.consolidate_state_dict()
    assert zero.state_dict()["state"] == {} and zero.state_dict()["param_groups"][0]["lr"] == 0.5


def test_a_checkpoint_whose_optimizer_state_does_not_fit_a_zero_optimizer_is_refused_whole(tmp_path):
    saved = model()
    sgd = optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    loss_of(saved).backward()
    sgd.step()
    path = save_checkpoint(tmp_path / "sgd.npz", saved, sgd)
    target = model()
    zero = dist.ZeroRedundancyOptimizer(optim.Adam(target.parameters()))
    with pytest.raises(CheckpointError, match="sgd.npz: optimizer state"):
        load_checkpoint(path, target, zero, restore_rng=False)
    for p, q in zip(target.parameters(), model().parameters()):
        np.testing.assert_array_equal(p.data, q.data)  # the model was not loaded either


# -- sharded data ----------------------------------------------------------------------------------------
def test_shard_splits_a_batch_into_contiguous_near_equal_shares():
    shares = [shard(10, r, 3) for r in range(3)]
    assert [list(range(10))[s] for s in shares] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size=2"):
        shard(4, 2, 2)
    with pytest.raises(ValueError, match="at least one item per rank"):
        shard(1, 0, 2)
    with pytest.raises(TypeError, match="shard: world_size must be an integer >= 1, got 2.0"):
        shard(4, 0, 2.0)


def test_sequence_task_shards_are_the_global_batch():
    def task():
        return SequenceTask("reverse", vocab_size=12, min_len=2, max_len=6, seed=4, heldout_size=20)
    whole = task().batch(8)
    a, b = task().batch(8, 0, 2), task().batch(8, 1, 2)
    assert len(a) == len(b) == 4
    rows = [list(r[r != PAD]) for r in whole.src]
    assert rows == [list(r[r != PAD]) for r in a.src] + [list(r[r != PAD]) for r in b.src]
    assert whole.n_tokens == a.n_tokens + b.n_tokens


def test_random_batches_shard_epochs_and_resume():
    x, y = np.arange(20).reshape(10, 2), np.arange(10)
    whole = RandomBatches(x, y, batch_size=4, seed=1, rank=0, world_size=1)
    halves = [RandomBatches(x, y, batch_size=4, seed=1, rank=r, world_size=2) for r in range(2)]
    seen = []
    for _ in range(5):  # 2 full batches per epoch of 10 (the partial one is dropped), then a new order
        bx, by = next(whole)
        parts = [next(h) for h in halves]
        np.testing.assert_array_equal(by, np.concatenate([p[1] for p in parts]))
        np.testing.assert_array_equal(bx, x[by])
        seen.append(by)
    assert len(set(np.concatenate(seen[:2]).tolist())) == 8  # within an epoch, no example twice
    state = whole.state_dict()
    after = [next(whole)[1] for _ in range(3)]
    resumed = RandomBatches(x, y, batch_size=4, seed=99, rank=0, world_size=1)
    resumed.load_state_dict(state)
    np.testing.assert_array_equal(np.concatenate(after), np.concatenate([next(resumed)[1] for _ in range(3)]))
    single = RandomBatches(y, batch_size=2, seed=0)
    assert next(single).shape == (2,)
    with pytest.raises(ValueError, match="at most the 10 examples"):
        RandomBatches(x, batch_size=11)
    with pytest.raises(ValueError, match="same number of rows"):
        RandomBatches(x, y[:5], batch_size=2)


def test_init_without_mpi4py(monkeypatch):
    monkeypatch.setattr(comm, "_world", None)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if not installed
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert dist.init() is comm.LOCAL and dist.is_initialized()  # started alone: rank 0 of 1 without MPI
    monkeypatch.setattr(comm, "_world", None)
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(ImportError, match=r"pip install -e '.\[mpi\]'"):
        dist.init()


# -- the launcher's command line and the ranks' side of it (its jobs: test_distributed.py) ---------
def test_the_launcher_gives_mpiexec_everything_before_the_script():
    assert split_command(["-n", "2", "-hosts", "a,b", "train.py", "--steps", "3", "x.py"]) == \
        (["-n", "2", "-hosts", "a,b"], ["train.py", "--steps", "3", "x.py"])


@pytest.mark.parametrize("argv", [[], ["-n", "2"], ["-n", "2", "-m", "train"]])
def test_the_launcher_without_a_script_prints_its_usage(capsys, argv):
    assert run(argv) == 2
    assert "usage: python -m npformer.distributed.launch -n N" in capsys.readouterr().err


def test_a_rank_that_cannot_reach_the_launcher_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv(reports.SOCKET_VARIABLE, str(tmp_path / "ranks"))  # no launcher listens there
    with pytest.raises(RuntimeError, match=r"rank 3 on .* cannot reach npformer.distributed.launch's socket .*"
                                           r"NPFORMER_LAUNCH_SOCKET.*start a job across machines with mpiexec"):
        reports.start(3)
    assert reports.SOCKET_VARIABLE not in os.environ  # not passed on to the processes this one starts


def test_without_the_launcher_a_rank_reports_nothing(monkeypatch):
    monkeypatch.delenv(reports.SOCKET_VARIABLE, raising=False)
    reports.start(0)
    assert reports._link is None
    reports.finish()  # nothing to tell: no error


def test_the_launcher_in_a_folder_too_deep_for_a_socket_says_so(monkeypatch, tmp_path, capsys):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(launch, "find_mpiexec", lambda: "mpiexec")  # never started
    assert run(["-n", "1", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "cannot make its socket" in err and "set TMPDIR to a shorter folder" in err
    assert list(deep.iterdir()) == []  # its folder removed
