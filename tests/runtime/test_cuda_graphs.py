"""npformer.cuda.graphed: a training step (forward, loss, backward, clipping, Adam) captured once and
replayed gives the numbers of the same steps run eagerly: new dropout masks at every replay (the
Philox offset advances on the device; every dropout site draws with Philox.draw), the
learning-rate schedule applied, the id checks reported.
On the test device the capture is emulated (npformer.runtime.testdevice.Capture: the step's operations
recorded, replayed on the same arrays, host transfers refused); on a GPU it is a CUDA graph."""
import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor, backend
from npformer import models, nn, optim
from npformer.runtime import graphs, random, testdevice

VOCAB, PAD = 23, 0


def batches(n, seed=0, batch=3, length=5):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        src, tgt_in, tgt_out = (rng.integers(1, VOCAB, (batch, length)) for _ in range(3))
        src[0, 3:] = tgt_out[1, 4:] = PAD                       # padding and ignored targets
        out.append((src, tgt_in, tgt_out))
    return out


def trainer(device, dropout=0.2, optimizer="AdamW", attention=None):
    """A fresh seeded model (dropout everywhere: embeddings, attention, feed-forward, residuals),
    optimizer and scheduler, and its training step."""
    npformer.manual_seed(0)
    model = models.Seq2SeqTransformer(VOCAB, VOCAB, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                      dim_feedforward=24, dropout=dropout, pad_idx=PAD).to(device)
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            module.backend = attention            # None: the default path of the device
    model.train()
    opt = getattr(optim, optimizer)(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = optim.WarmupCosineLR(opt, warmup_steps=3, total_steps=12)

    def step(src, tgt_in, tgt_out):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD,
                               label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss
    return model, opt, scheduler, step


def run(device, data, graph, attention=None):
    model, _, scheduler, step = trainer(device, attention=attention)
    if graph:
        step = npformer.cuda.graphed(step, device=device)
    losses = []
    for src, tgt_in, tgt_out in data:
        ids = [backend.to_device(a, device) for a in (src, tgt_in)]   # device ids, and host targets
        losses.append(step(*ids, tgt_out).item())
        scheduler.step()
    return losses, [p.numpy() for p in model.parameters()], random.dropout_stream().offset


@pytest.mark.parametrize("attention", [None, "memory_efficient"])
def test_graphed_steps_equal_eager_steps_on_the_test_device(attention):
    """Ten steps with dropout (embeddings, attention on either path, feed-forward, residuals), label
    smoothing, clipping, AdamW and a warmup-cosine schedule: the graphed run (1 eager warm-up, 1
    capture, replays) gives the eager run's losses and weights exactly, and the dropout stream
    ends at the same offset."""
    data = batches(10)
    eager_losses, eager_weights, eager_offset = run("test", data, graph=False, attention=attention)
    losses, weights, offset = run("test", data, graph=True, attention=attention)
    assert losses == eager_losses
    assert offset == eager_offset
    for a, b in zip(weights, eager_weights):
        np.testing.assert_array_equal(a, b)
    assert len(set(eager_losses)) == len(eager_losses)          # the steps learn: nothing repeats


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_each_replay_performs_the_next_adam_step_with_the_lr_set_before_it(optimizer):
    """A replay runs no Python: the step count and the learning rate that Adam's update reads come
    from the device, rewritten before each replay (npformer.runtime.graphs.replayed). Set by hand before
    every call (bias corrections of the early steps, an lr that changes every step, two groups),
    the graphed steps give the eager steps' weights exactly and count the same steps."""
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(4) for _ in range(6)]
    lrs = [0.1, 0.05, 0.3, 0.01, 0.2, 0.07]

    def steps(graph):
        w = Tensor(np.ones(4), requires_grad=True, device="test")
        b = Tensor(np.zeros(1), requires_grad=True, device="test")
        opt = getattr(optim, optimizer)([{"params": [w]}, {"params": [b]}], weight_decay=0.01)

        def step(x):
            loss = ((w * x).sum() + b * b).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss
        run_step = npformer.cuda.graphed(step, device="test") if graph else step
        for x, lr in zip(inputs, lrs):
            opt.param_groups[0]["lr"] = lr
            opt.param_groups[1]["lr"] = 2 * lr
            run_step(backend.to_device(x, "test"))
        return [w.numpy(), b.numpy()], [state["step"] for state in opt.state.values()]
    (eager_w, eager_b), eager_counts = steps(graph=False)
    (w, b), counts = steps(graph=True)
    assert counts == eager_counts == [6, 6]
    np.testing.assert_array_equal(w, eager_w)
    np.testing.assert_array_equal(b, eager_b)


def test_replayed_numbers_are_the_captured_ones_then_the_next_ones_before_each_replay():
    """graphs.replayed: None outside a capture; while capturing, device float64 arrays, several per
    block and more than a block's worth in all, holding the captured values at the first replay and
    next_values() (called in the order of the step) before each later one."""
    assert graphs.replayed("test", (1.0, 2.0), lambda: (3.0, 4.0)) is None
    calls = []

    def counter(k):
        def next_values():
            calls.append(k)
            return (10.0 * len(calls), k)
        return next_values
    capture = graphs.Capture("test")
    with graphs.capturing(capture):
        assert graphs.replayed("cuda", (1.0,), counter(-1)) is None          # a capture on another device
        arrays = [graphs.replayed("test", (float(k), -float(k)), counter(k)) for k in range(graphs.SCALARS_PER_BLOCK)]
    assert len(capture.scalar_blocks) == 2 and all(a.dtype == np.float64 and a.shape == (2,) for a in arrays)
    for replay in range(3):
        for hook in capture.hooks:
            hook(replay)
        values = [backend.as_numpy(a).tolist() for a in arrays]
        if replay == 0:
            assert values == [[k, -k] for k in range(len(arrays))] and not calls
        else:
            assert calls[-len(arrays):] == list(range(len(arrays)))
            assert values == [[10.0 * (len(calls) - len(arrays) + k + 1), k] for k in range(len(arrays))]
    with pytest.raises(ValueError, match=r"replayed: expected 1 to 1024 numbers, got 0"):
        capture.replayed_scalars((), lambda: ())


def test_a_capture_that_raised_is_captured_again_at_the_next_call():
    """The step raises while it is being captured (after its forward drew dropout masks): the error
    reaches the caller, and the next call captures the step again, instead of replaying the part of
    it recorded before the error (which returned None and skipped the update). The losses, weights
    and dropout offset are those of eager steps where the same call raised at the same point."""
    data = batches(5)

    def steps(graph):
        model, _, scheduler, step = trainer("test")
        calls = []

        def failing_once(src, tgt_in, tgt_out):
            calls.append(None)
            if len(calls) == 2:                                   # the capture (after one warm-up call)
                model(src, tgt_in)
                raise RuntimeError("transient")
            return step(src, tgt_in, tgt_out)
        run_step = npformer.cuda.graphed(failing_once, device="test") if graph else failing_once
        losses = []
        for src, tgt_in, tgt_out in data:
            try:
                losses.append(run_step(*[backend.to_device(a, "test") for a in (src, tgt_in)], tgt_out).item())
            except RuntimeError as error:
                assert str(error) == "transient"
                losses.append(None)
            scheduler.step()
        return losses, [p.numpy() for p in model.parameters()], random.dropout_stream().offset
    eager_losses, eager_weights, eager_offset = steps(graph=False)
    losses, weights, offset = steps(graph=True)
    assert losses == eager_losses and losses[1] is None and None not in losses[2:]
    assert offset == eager_offset
    for a, b in zip(weights, eager_weights):
        np.testing.assert_array_equal(a, b)


def test_each_replay_draws_new_dropout_masks():
    """Without the device-side offset the replays would repeat the capture's masks; with the same
    batch every step the losses still differ, like the eager ones."""
    model, _, _, step = trainer("test", dropout=0.5, optimizer="Adam")
    model.train()
    graphed = npformer.cuda.graphed(step, device="test")
    (src, tgt_in, tgt_out), = batches(1)
    offsets = []
    for _ in range(4):
        graphed(backend.to_device(src, "test"), tgt_in, tgt_out)
        offsets.append(random.dropout_stream().offset)
    steps = np.diff(offsets)
    assert (steps == steps[0]).all() and steps[0] > 0             # each replay reserves one step's values


def test_a_replay_reads_nothing_on_the_host_until_the_loss_is_read():
    _, _, _, step = trainer("test")
    graphed = npformer.cuda.graphed(step, device="test")
    data = [[backend.to_device(a, "test") for a in b] for b in batches(3)]
    graphed(*data[0])
    graphed(*data[1])                                             # the capture
    testdevice.transfers.clear()
    loss = graphed(*data[2])
    assert testdevice.transfers["device_to_host"] == 0, dict(testdevice.transfers)
    loss.item()
    assert testdevice.transfers["device_to_host"] >= 1


def test_out_of_range_device_ids_raise_when_the_loss_of_a_replay_is_read():
    _, _, _, step = trainer("test")
    graphed = npformer.cuda.graphed(step, device="test")
    data = [[backend.to_device(a, "test") for a in b] for b in batches(3)]
    for b in data[:2]:
        graphed(*b).item()
    src = backend.as_numpy(data[2][0])
    src[1, 1] = VOCAB + 4                                         # a bad id arrives on the device
    loss = graphed(backend.to_device(src, "test"), *data[2][1:])  # no error yet: nothing was read
    with pytest.raises(IndexError, match=rf"token ids must be in \[0, {VOCAB - 1}\].*max {VOCAB + 4}"):
        loss.item()


def test_replays_never_read_keep_one_replays_checks_pending():
    """Each replay makes the captured id checks pending again; they read the same device values (the
    latest replay's), so replays whose loss is never read must not pile them up: 200 unread replays
    held 1,600 pending checks, and reading the loss then made 3,000 device-to-host reads (a
    synchronisation each on a GPU) instead of a handful."""
    _, _, _, step = trainer("test")
    graphed = npformer.cuda.graphed(step, device="test")
    data = [backend.to_device(a, "test") for a in batches(1)[0]]
    graphed(*data).item()                       # the warm-up call
    graphed(*data).item()                       # the capture
    reads = []
    for replays in (2, 30):
        for _ in range(replays):
            loss = graphed(*data)
        testdevice.transfers.clear()
        loss.item()
        reads.append(testdevice.transfers["device_to_host"])
    assert reads[1] == reads[0] <= 20, reads


def test_a_host_offset_cannot_be_taken_while_capturing():
    """Philox.take inside a capture would bake one offset into the graph: refused, with the way out."""
    with graphs.capturing(graphs.Capture("test")):
        with pytest.raises(RuntimeError, match=r"Philox.take inside a graph capture.*Philox.draw\(n, device\)"):
            random.Philox(3).take(8)


def test_capture_refuses_host_reads_and_uncapturable_optimizers():
    _, _, _, step = trainer("test", optimizer="SGD")
    graphed = npformer.cuda.graphed(step, device="test")
    data = [[backend.to_device(a, "test") for a in b] for b in batches(2)]
    graphed(*data[0])
    with pytest.raises(RuntimeError, match="SGD.step.. cannot be captured"):
        graphed(*data[1])
    _, _, _, step = trainer("test")

    def reads_the_loss(*arrays):
        return float(step(*arrays))                               # a host read inside the step
    graphed = npformer.cuda.graphed(reads_the_loss, device="test")
    graphed(*data[0])
    with pytest.raises(testdevice.TransferDuringCapture, match="device-to-host transfers are disallowed"):
        graphed(*data[1])


def test_graphed_checks_its_arguments():
    with pytest.raises(ValueError, match="warmup must be an integer >= 1"):
        npformer.cuda.graphed(lambda: None, device="test", warmup=0)
    _, _, _, step = trainer("test")
    graphed = npformer.cuda.graphed(step, device="test")
    data = [[backend.to_device(a, "test") for a in b] for b in batches(3)]
    graphed(*data[0])
    graphed(*data[1])
    with pytest.raises(ValueError, match=r"argument 0 must have the captured shape \(3, 5\)"):
        graphed(data[2][0][:, :4], *data[2][1:])
    cpu_step = npformer.cuda.graphed(lambda x: x + 1, device="cpu")   # no graphs on the CPU: eager
    assert cpu_step(1) == 2


def test_twenty_replayed_steps_equal_twenty_eager_steps_on_a_gpu():
    if not backend.cuda_available():
        pytest.skip("cuda: CuPy or a GPU is not available on this machine")
    data = batches(20)
    eager_losses, eager_weights, eager_offset = run("cuda", data, graph=False)
    losses, weights, offset = run("cuda", data, graph=True)
    assert offset == eager_offset
    # the embedding backward adds with atomics (any order): equal up to float32 rounding
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-4)
    for a, b in zip(weights, eager_weights):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_manual_seed_between_replays_reseeds_the_replayed_masks():
    """manual_seed between two calls resets the dropout stream, which is reseeded when next used;
    a replay reserves its values without asking for the stream by name, and still takes them from
    the new seed at offset 0, as the eager step does (it used to go on with the old seed)."""
    data = batches(5)

    def steps(graph):
        _, _, _, step = trainer("test")
        run_step = npformer.cuda.graphed(step, device="test") if graph else step
        losses = []
        for i, (src, tgt_in, tgt_out) in enumerate(data):
            if i == 3:
                npformer.manual_seed(7)
            losses.append(run_step(*[backend.to_device(a, "test") for a in (src, tgt_in)], tgt_out).item())
        return losses, random.dropout_stream().state_dict()
    assert steps(graph=True) == steps(graph=False)
