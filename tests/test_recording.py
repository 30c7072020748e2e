"""npformer.recorded (npformer/recording.py): a loss function's forward and backward recorded once and replayed give the
numbers of the same steps run eagerly, bit for bit (dropout draws new masks, padding masks and
ignored targets follow the batch, the optimizer and its schedule run outside), a call that
differs from every recording in shape, mode or parameters records anew (an eager step), up to
max_recordings, and past them runs eagerly."""
import threading
import time

import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor, hooks, raw_computation
from npformer import models, nn, optim
from npformer.runtime import random

VOCAB, PAD = 23, 0


def batches(n, seed=0, batch=3, length=5):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src, tgt_in, tgt_out = (rng.integers(1, VOCAB, (batch, length)) for _ in range(3))
        src[i % batch, 1 + i % (length - 1):] = PAD                  # padding that moves from batch to batch
        tgt_out[(i + 1) % batch, length - 1 - i % 2:] = PAD            # ignored targets
        out.append((src, tgt_in, tgt_out))
    return out


def trainer(kind="seq2seq", attention=None, dropout=0.2):
    """A fresh seeded model with dropout everywhere, AdamW, a warmup-cosine schedule, and its loss."""
    npformer.manual_seed(0)
    if kind == "seq2seq":
        model = models.Seq2SeqTransformer(VOCAB, VOCAB, d_model=16, nhead=2, num_encoder_layers=1,
                                          num_decoder_layers=1, dim_feedforward=24, dropout=dropout, pad_idx=PAD)

        def loss_fn(src, tgt_in, tgt_out):
            return F.cross_entropy(model(src, tgt_in).reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD,
                                   label_smoothing=0.1)
    else:
        model = models.CausalLM(VOCAB, d_model=16, nhead=2, num_layers=2, dim_feedforward=24, dropout=dropout,
                                max_len=16)

        def loss_fn(src, tgt_in, tgt_out):
            return F.cross_entropy(model(tgt_in).reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD)
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            module.backend = attention
    model.train()
    opt = optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = optim.WarmupCosineLR(opt, warmup_steps=3, total_steps=30)
    return model, opt, scheduler, loss_fn


def run(data, record, max_recordings=8, **kwargs):
    model, opt, scheduler, loss_fn = trainer(**kwargs)
    step = npformer.recorded(loss_fn, model, max_recordings=max_recordings) if record else None
    losses = []
    for batch in data:
        opt.zero_grad()
        if record:
            loss = step(*batch)
        else:
            loss = loss_fn(*batch)
            loss.backward()
        optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, [p.numpy().copy() for p in model.parameters()], random.dropout_stream().offset, step


@pytest.mark.parametrize("kind, attention", [("seq2seq", None), ("seq2seq", "memory_efficient"), ("causal", None)])
def test_twenty_recorded_steps_equal_twenty_eager_steps(kind, attention):
    """20 steps (1 eager, 1 recorded, 18 replayed) with dropout on embeddings, attention (either
    path), feed-forward and residuals, padding that moves, ignored targets, label smoothing,
    clipping, AdamW and a schedule: the eager run's losses, weights and dropout offset, exactly."""
    data = batches(20)
    eager_losses, eager_weights, eager_offset = run(data, False, kind=kind, attention=attention)[:3]
    losses, weights, offset, step = run(data, True, kind=kind, attention=attention)
    assert (step.eager_calls, step.replays) == (2, 18)
    assert losses == eager_losses and len(set(losses)) == len(losses)
    assert offset == eager_offset
    for a, b in zip(weights, eager_weights):
        np.testing.assert_array_equal(a, b)
    assert not hooks.op_applied                                    # the core's hook is gone once recorded


@pytest.mark.parametrize("max_recordings, counts", [(8, (4, 14)), (2, (8, 10))])
def test_batches_of_several_shapes_replay_each_recording(max_recordings, counts):
    """Batches of three shapes in turn (the first call a warmup): each shape is recorded at its
    first call after it and replayed at the next ones (max_recordings 8); with max_recordings 2
    the shape that finds no room runs eagerly at every call while the two recorded replay. The
    eager run's losses and weights, exactly."""
    shapes = zip(batches(6, length=5), batches(6, seed=1, length=7), batches(6, seed=2, batch=4, length=5))
    data = [batch for three in shapes for batch in three]
    eager_losses, eager_weights = run(data, False)[:2]
    losses, weights, _, step = run(data, True, max_recordings=max_recordings)
    assert (step.eager_calls, step.replays) == counts and len(step.recordings) == min(3, max_recordings)
    assert losses == eager_losses
    for a, b in zip(weights, eager_weights):
        np.testing.assert_array_equal(a, b)


def test_a_module_setting_that_cannot_be_hashed_still_replays():
    """A signature holds each module's plain tuples as they are, a tuple of lists included: it is
    compared, never hashed, so such a module's steps record and replay."""
    model = nn.Linear(2, 2)
    model.sizes = ([1, 2], 3)
    step = npformer.recorded(lambda x: model(Tensor(x)).sum(), model, warmup=0)
    for _ in range(3):
        step(np.ones((3, 2), dtype=np.float32))
    assert (step.eager_calls, step.replays) == (1, 2)


def test_a_call_unlike_the_recorded_one_runs_eagerly_and_the_next_like_it_replays():
    """After the recording: another batch shape, eval mode, a frozen parameter, another attention
    path and grad mode off each run eagerly (the numbers of an eager step); restored, replays go on."""
    model, opt, _, loss_fn = trainer()
    step = npformer.recorded(loss_fn, model)
    data = batches(3)
    for batch in data:
        opt.zero_grad()
        step(*batch)
    assert (step.eager_calls, step.replays) == (2, 1)
    attention = next(m for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    first = next(model.parameters())
    changes = [(lambda: None, lambda: None, batches(1, length=7)[0]),
               (model.eval, model.train, data[0]),
               (lambda: first.requires_grad_(False), lambda: first.requires_grad_(True), data[0]),
               (lambda: setattr(attention, "backend", "memory_efficient"), lambda: setattr(attention, "backend", None),
                data[0])]
    for change, restore, batch in changes:
        change()
        opt.zero_grad()
        eager = step.eager_calls
        step(*batch)
        assert step.eager_calls == eager + 1
        restore()
        replays = step.replays
        opt.zero_grad()
        step(*data[1])
        assert step.replays == replays + 1
    with npformer.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        step(*data[1])                                          # eagerly, as loss.backward() under no_grad


def test_ids_out_of_range_in_a_replayed_step_raise_the_eager_error():
    model, opt, _, loss_fn = trainer()
    step = npformer.recorded(loss_fn, model)
    data = batches(3)
    for batch in data[:2]:
        step(*batch)
    src, tgt_in, tgt_out = data[2]
    src[1, 0] = VOCAB
    with pytest.raises(IndexError, match=r"src token ids must be in \[0, 22\].*got min 0 and max 23"):
        step(src, tgt_in, tgt_out)


def test_an_array_computed_outside_the_ops_or_a_stray_draw_is_refused_when_recording():
    """A replay would reuse the first values of an array the step made without ops, or of a mask
    drawn outside an op's options: recording raises, naming the op and the argument."""
    model = nn.Linear(4, 4)
    w = model.weight

    def made_outside(x):
        return (w * Tensor(x * 2.0)).sum()                      # x * 2.0: numpy, not an op
    step = npformer.recorded(made_outside, model, warmup=0)
    with pytest.raises(RuntimeError, match=r"argument 1 of autograd.ops.Mul is an array \(4,\) float32 computed "
                                           r"outside the recorded ops"):
        step(np.arange(4.0, dtype=np.float32))

    def stray_draw(x):
        random.dropout_stream().draw(16, "cpu")
        return (w * x).sum()
    step = npformer.recorded(stray_draw, model, warmup=0)
    with pytest.raises(RuntimeError, match="16 random values were drawn outside an op's options"):
        step(np.arange(4.0, dtype=np.float32))


def test_inputs_or_a_model_off_the_cpu_run_eagerly():
    from autograd import backend
    w = Tensor(np.ones(4), requires_grad=True, device="test")
    step = npformer.recorded(lambda x: (w * x).sum(), nn.Linear(2, 2), warmup=0)
    for _ in range(2):
        step(backend.to_device(np.arange(4.0), "test"))
    assert (step.eager_calls, step.replays) == (2, 0)
    model = nn.Linear(4, 1).to("test")                       # host inputs, parameters on a device
    step = npformer.recorded(lambda x: model(Tensor(x, device="test")).sum(), model, warmup=0)
    for _ in range(2):
        step(np.ones((2, 4), dtype=np.float32))
    assert (step.eager_calls, step.replays) == (2, 0)


def test_bad_arguments_are_errors():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="recorded: fn must be callable, got int"):
        npformer.recorded(3, model)
    with pytest.raises(TypeError, match="recorded: model must be an npformer.nn.Module .*got list"):
        npformer.recorded(lambda: None, [])
    with pytest.raises(ValueError, match=r"recorded: warmup must be an integer >= 0, got -1"):
        npformer.recorded(lambda: None, model, warmup=-1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"recorded: max_recordings must be an integer >= 1, got {bad!r}"):
            npformer.recorded(lambda: None, model, max_recordings=bad)
    with pytest.raises(TypeError, match=r"recorded: state must be None or a function \(\) -> the Python values fn "
                                        r"reads, got int"):
        npformer.recorded(lambda: None, model, state=3)
    step = npformer.recorded(lambda x: model(Tensor(x)), model, warmup=0)
    with pytest.raises(TypeError, match=r"recorded: fn must return a scalar loss Tensor that requires grad \(or a "
                                        r"tuple that starts with one\), got Tensor \(3, 2\)"):
        step(np.ones((3, 2), dtype=np.float32))


# -- the state a step reads (issue 46): a change gives the eager numbers, by a new recording or an eager step
class _Stateful(nn.Module):
    """A Linear whose output goes through module state that is no parameter or buffer: a Tensor, a
    raw array, a list of numbers and a numpy scalar."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.shift = Tensor(np.full(3, 0.5, np.float32))
        self.offset = np.zeros(3, np.float32)
        self.scales = [1.0, 2.0]
        self.temperature = np.float32(1.0)

    def forward(self, x):
        h = (self.linear(Tensor(x)) + self.shift + self.offset) * self.scales[1]
        return h / self.temperature


def _stateful_losses(record, change=None, at=4, steps=10, fn=None, warn=None):
    """Losses of `steps` SGD steps of a fresh _Stateful (recorded or eager), `change(model)` run
    before step `at` (1-based; or each step of a tuple); `fn(model, x)` the loss (default: the mean square of the output)."""
    npformer.manual_seed(0)
    model = _Stateful()
    opt = optim.SGD(model.parameters(), lr=0.01)
    loss_fn = fn or (lambda m, x: (m(x) * m(x)).mean())
    step = npformer.recorded(lambda x: loss_fn(model, x), model) if record else None
    rng = np.random.default_rng(1)
    losses = []
    for i in range(1, steps + 1):
        x = rng.standard_normal((4, 3)).astype(np.float32)
        if change is not None and i in (at if isinstance(at, tuple) else (at,)):
            change(model)
        opt.zero_grad()
        if record:
            loss = step(x)
        else:
            loss = loss_fn(model, x)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, step


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "shift", Tensor(np.full(3, -3.0, np.float32))),
    lambda m: setattr(m, "offset", np.ones(3, np.float32)),
    lambda m: m.scales.__setitem__(1, 5.0),
    lambda m: setattr(m, "temperature", np.float32(0.25)),
    lambda m: m.shift.data.__setitem__(0, 7.0),                          # in place: read anew by replays
], ids=["tensor attribute", "array attribute", "list element", "numpy scalar", "tensor in place"])
def test_a_module_attribute_changed_between_replays_gives_the_eager_losses(change):
    """Step 4 of a recorded run changes a module's non-parameter Tensor, raw array, one element of
    a list or a numpy scalar: the losses of the eager run, every step (the signature covers them)."""
    eager = _stateful_losses(False, change)[0]
    losses, step = _stateful_losses(True, change)
    assert losses == eager and losses != _stateful_losses(False)[0]
    assert step.replays >= 5


def test_a_hook_registered_after_the_recording_runs_at_every_replay():
    """A parameter's post-accumulate-grad hook registered at step 4 runs at steps 4 to 10, as eagerly."""
    for record in (False, True):
        calls = []

        def change(model):
            model.linear.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.sum()))
        losses, step = _stateful_losses(record, change)
        assert len(calls) == 7
        if record:
            assert step.replays >= 6


def test_a_forward_wrapped_on_a_module_after_the_recording_runs_at_every_step():
    """A module's forward wrapped on the instance (a hook without register_forward_hook). Wrapped
    at step 4 of a recorded run, it runs at steps 4 to 10 as eagerly (those steps run eagerly, with
    a warning naming the module), with the eager losses."""
    runs = []
    for record in (False, True):
        calls = []

        def change(model):
            inner = model.linear.forward

            def hooked(x):
                calls.append(x.shape)
                return inner(x)
            model.linear.forward = hooked
        if record:
            with pytest.warns(RuntimeWarning, match=r"recorded step: a Linear's forward is replaced on the instance "
                                                    r"\(a hook that a replay would not run\).*runs eagerly"):
                runs.append(_stateful_losses(True, change)[0])
        else:
            runs.append(_stateful_losses(False, change)[0])
        assert len(calls) == 14                                   # twice a step (the loss calls the model twice)
    assert runs[0] == runs[1]


def test_module_hooks_registered_on_a_recorded_model_see_every_step_and_replays_resume_once_removed():
    """Module hooks registered at step 4 (forward hook, full backward hook) and removed at step 8:
    steps 4 to 7 run eagerly, the hooks see each one's output and gradients as an eager run's do,
    and later steps replay the recording made before; the losses are the eager ones."""
    runs, seen_by_run = [], []
    for record in (False, True):
        seen, handles = [], []

        def change(model):
            if not handles:
                handles.append(model.linear.register_forward_hook(lambda m, a, out: seen.append(out.numpy().copy())))
                handles.append(model.linear.register_full_backward_hook(
                    lambda m, gi, go: seen.append(go[0].numpy().copy())))
            else:
                for handle in handles:
                    handle.remove()
        losses, step = _stateful_losses(record, change, at=(4, 8))
        runs.append(losses)
        seen_by_run.append(seen)
        assert len(seen) == 4 * 2 * 2  # steps 4-7, the model called twice a step: an output and a grad_output each
        if record:
            assert step.replays == 4 and step.eager_reason is None  # steps 3, 8, 9, 10: the recording of step 2
    assert runs[0] == runs[1]
    for a, b in zip(*seen_by_run):
        np.testing.assert_array_equal(a, b)


def test_a_parameters_tensor_hook_runs_at_every_replay_and_one_registered_in_fn_makes_the_step_eager():
    """A hook on a parameter (a leaf) registered at step 4 runs at steps 4 to 10, replays included,
    and its replacement (the gradient halved) changes the losses as eagerly; a hook that fn
    registers on a tensor it makes is Python a replay would not run: eager from then on."""
    runs = []
    for record in (False, True):
        calls = []

        def change(model):
            model.linear.weight.register_hook(lambda g: calls.append(g.numpy().copy()) or g * 0.5)
        losses, step = _stateful_losses(record, change)
        assert len(calls) == 7
        runs.append((losses, calls))
        if record:
            assert step.replays >= 6
    assert runs[0][0] == runs[1][0] and all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))

    calls = []

    def fn(model, x):
        out = model(x)
        out.register_hook(lambda g: calls.append(g))
        return (out * out).mean()
    with pytest.warns(RuntimeWarning, match=r"recorded step: it registered a hook on a tensor it made "
                                            r"\(Tensor.register_hook\).*runs eagerly"):
        losses, step = _stateful_losses(True, fn=fn)
    assert len(calls) == 10 and step.replays == 0 and losses == _stateful_losses(False, fn=fn)[0]


def _hook_point_losses(record, steps=5, in_step=False):
    """Losses of `steps` training steps of a CausalLM with dropout (recorded, warmup 1, or eager),
    with a forward hook on a hook point counting its calls and a backward one counting theirs:
    added once before training (model.add_hook), or by the step itself (run_with_hooks)."""
    model, opt, scheduler, loss_fn = trainer("causal")
    calls = []
    name = "encoder.layers.1.self_attn.hook_pattern"

    def count(x, hook):
        calls.append((hook.name, x.shape))

    if in_step:
        def step_fn(src, tgt_in, tgt_out):
            logits = model.run_with_hooks(tgt_in, fwd_hooks=[(name, count)], bwd_hooks=[(name, count)])
            return F.cross_entropy(logits.reshape(-1, VOCAB), tgt_out.reshape(-1), ignore_index=PAD)
    else:
        model.add_hook(name, count)
        model.add_hook(name, count, dir="bwd")
        step_fn = loss_fn
    step = npformer.recorded(step_fn, model) if record else None
    losses = []
    for batch in batches(steps):
        opt.zero_grad()
        if record:
            loss = step(*batch)
        else:
            loss = step_fn(*batch)
            loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, calls, step


def test_a_hook_point_hook_on_a_recorded_model_runs_at_every_step():
    """A hook point's forward and backward hooks (model.add_hook) on a recorded CausalLM: every
    one of 5 steps runs eagerly, so the hooks run 5 times each (not once, at the recording), with
    the eager run's losses; a step that adds hooks itself (run_with_hooks) runs eagerly from its
    recording on, with a warning naming the hook point, and the eager losses."""
    eager, eager_calls, _ = _hook_point_losses(False)
    losses, calls, step = _hook_point_losses(True)
    assert len(calls) == len(eager_calls) == 2 * 5 and calls == eager_calls
    assert losses == eager and step.replays == 0 and step.eager_reason is None
    eager, eager_calls, _ = _hook_point_losses(False, in_step=True)
    with pytest.warns(RuntimeWarning, match=r"recorded step: it registered a hook on the hook point "
                                            r"'encoder.layers.1.self_attn.hook_pattern'.*runs eagerly"):
        losses, calls, step = _hook_point_losses(True, in_step=True)
    assert len(calls) == 2 * 5 and calls == eager_calls and losses == eager and step.replays == 0


def test_a_module_hook_that_the_step_registers_and_removes_makes_it_eager():
    """A forward hook that the step registers on a module and removes before it returns (nothing
    registered between calls): the recording sees the registration, so the step runs eagerly from
    then on and the hook sees every step."""
    calls = []

    def fn(model, x):
        handle = model.linear.register_forward_hook(lambda m, args, out: calls.append(out.shape))
        out = model(x)
        handle.remove()
        return (out * out).mean()
    with pytest.warns(RuntimeWarning, match=r"recorded step: it registered a hook on a Linear \(module hooks\)"):
        losses, step = _stateful_losses(True, fn=fn)
    assert len(calls) == 10 and step.replays == 0 and losses == _stateful_losses(False, fn=fn)[0]


def _pause(x):
    """x * 2 after a millisecond's sleep (another thread runs meanwhile): a computation each replay repeats."""
    time.sleep(0.001)
    return x * 2


def test_one_recorded_step_called_from_two_threads_gives_the_eager_losses():
    """Two threads calling one recorded step at once (no optimizer step: each batch's loss is the
    same whenever it runs; a recomputed call that sleeps lets the other thread run mid-replay):
    every loss is the eager one of its batch."""
    npformer.manual_seed(0)
    model = _Stateful()

    def loss_fn(x):
        return (model(x) * Tensor(raw_computation(_pause, x))).mean()
    step = npformer.recorded(loss_fn, model)
    rng = np.random.default_rng(2)
    data = [rng.standard_normal((8, 3)).astype(np.float32) for _ in range(40)]
    eager = [loss_fn(x).item() for x in data]
    step(data[0])
    step(data[1])                                                 # recorded
    got = {}

    def work(indices):
        for i in indices:
            got[i] = step(data[i]).item()
    threads = [threading.Thread(target=work, args=(range(k, 40, 2),)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(40)] == eager
    assert step.replays == 40


def test_python_values_the_loss_function_reads_are_in_the_signature():
    """A loss function whose label smoothing follows a counter it increments (a replay would not):
    each call that would record is an eager step, the 8th (max_recordings) warns, eager from then
    on; one whose label smoothing is a module global changed at step 4: a new recording. The eager
    losses either way."""
    target = np.array([0, 1, 2, 1])
    counter = [0]

    def smoothed(model, x):
        counter[0] += 1
        return F.cross_entropy(model(x), target, label_smoothing=min(counter[0], 6) / 10)
    counter[0] = 0
    eager = _stateful_losses(False, fn=smoothed)[0]
    counter[0] = 0
    with pytest.warns(RuntimeWarning, match=r"recorded step: running it changed a value fn reads .*runs eagerly"):
        losses, step = _stateful_losses(True, fn=smoothed)
    assert losses == eager and step.replays == 0
    global _SMOOTHING
    runs = []
    for record in (False, True):
        _SMOOTHING = 0.0
        runs.append(_stateful_losses(record, lambda m: globals().update(_SMOOTHING=0.3),
                                     fn=lambda m, x: F.cross_entropy(m(x), target, label_smoothing=_SMOOTHING)))
    assert runs[0][0] == runs[1][0] and runs[1][1].replays == 7


_SMOOTHING = 0.0


@pytest.mark.parametrize("read", ["item", "float", "numpy"])
def test_a_host_read_inside_the_step_warns_naming_the_line_and_runs_eagerly(read):
    """A step that reads a value on the host (a branch on the data) cannot be replayed: the call
    that would record warns, naming the line that read, and every step runs eagerly."""
    reads = {"item": lambda t: t.item(), "float": float, "numpy": lambda t: t.numpy().sum()}[read]

    def branching(model, x):
        loss = (model(x) * model(x)).mean()
        return loss * 2 if reads(loss) > 0.6 else loss            # the line named
    eager = _stateful_losses(False, fn=branching)[0]
    with pytest.warns(RuntimeWarning, match=r"recorded step: it read a value on the host at .*test_recording.py:\d+ "
                                            r"\(in (branching|<lambda>)\).*runs eagerly"):
        losses, step = _stateful_losses(True, fn=branching)
    assert losses == eager and step.replays == 0 and step.eager_calls == 10


def test_a_fortran_ordered_first_batch_records_the_readme_loss():
    """README's loss (tgt.reshape(-1)) on a Fortran-ordered first batch records (the step's inputs are
    kept C-ordered) and replays batches of either order with the eager losses."""
    losses = []
    for record in (False, True):
        npformer.manual_seed(0)
        model = models.Seq2SeqTransformer(20, 20, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.1, pad_idx=0)
        opt = optim.Adam(model.parameters(), lr=1e-3)

        def loss_fn(src, tgt_in, tgt):
            return F.cross_entropy(model(src, tgt_in).reshape(-1, 20), tgt.reshape(-1), label_smoothing=0.1)
        step = npformer.recorded(loss_fn, model)
        rng = np.random.default_rng(0)
        run = []
        for i in range(5):
            src = rng.integers(3, 20, size=(8, 6))
            tgt = src[:, ::-1]
            tgt_in = np.concatenate([np.ones((8, 1), int), tgt[:, :-1]], axis=1)
            batch = [np.asfortranarray(a) if i % 2 == 1 else np.ascontiguousarray(a) for a in (src, tgt_in, tgt)]
            opt.zero_grad()
            if record:
                loss = step(*batch)
            else:
                loss = loss_fn(*batch)
                loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == losses[1] and step.replays == 3


class _Counter:
    calls = 0


_calls = _Counter()   # a module global named as an attribute the step below reads


def test_only_the_globals_a_function_loads_are_in_its_signature():
    """`holder._calls` in fn's code is an attribute, not the global `_calls` (whose count changes
    before every call here): the signature leaves that global out, and the step replays."""
    model = nn.Linear(2, 2)
    holder = _Counter()
    holder._calls = 2.0
    step = npformer.recorded(lambda x: (model(Tensor(x)) * holder._calls).sum(), model)
    for _ in range(5):
        _calls.calls += 1
        step(np.ones((3, 2), dtype=np.float32))
    assert (step.eager_calls, step.replays) == (2, 3)


def test_a_cache_the_first_forward_builds_records_at_the_next_call():
    """Rotary tables built by the first forward (warmup=0: during the recording call) change the
    state the signature covers once: that call is an eager step, the next one records, the later
    ones replay (it raised before), with the eager losses."""
    runs = []
    for record in (False, True):
        npformer.manual_seed(0)
        model = models.CausalLM(VOCAB, d_model=16, nhead=2, num_layers=1, dim_feedforward=24, max_len=16,
                                positional="rope").train()

        def loss_fn(x, y):
            return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        step = npformer.recorded(loss_fn, model, warmup=0)
        rng = np.random.default_rng(0)
        losses = []
        for _ in range(5):
            x, y = rng.integers(0, VOCAB, (2, 2, 8))
            if record:
                losses.append(step(x, y).item())
            else:
                loss = loss_fn(x, y)
                loss.backward()
                losses.append(loss.item())
        runs.append(losses)
    assert runs[0] == runs[1] and (step.eager_calls, step.replays) == (2, 3) and step.eager_reason is None


def _argmax_rows(x):
    return np.argmax(x, axis=1)


def test_what_a_call_returns_is_not_rewritten_by_the_next_call():
    """fn returns the loss, a Tensor and a recomputed array: what a replay returned keeps its values
    after the next replay (another thread's call included), the eager values of its batch."""
    npformer.manual_seed(0)
    model = _Stateful()

    def loss_fn(x):
        out = model(x)
        return (out * out).mean(), out.sum(axis=1), raw_computation(_argmax_rows, x)
    step = npformer.recorded(loss_fn, model)
    rng = np.random.default_rng(3)
    data = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(4)]
    eager = [[np.asarray(v.data if isinstance(v, Tensor) else v).copy() for v in loss_fn(x)] for x in data]
    returned = [step(x) for x in data]
    assert (step.eager_calls, step.replays) == (2, 2)
    for got, want in zip(returned, eager):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.data if isinstance(a, Tensor) else a, b)
