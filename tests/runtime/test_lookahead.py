"""npformer.runtime.lookahead: the dropout masks of the next forward pass are drawn in the pool, and a step
gives the same numbers to the bit with and without it, when the prediction holds and when it
fails; npformer.runtime.threads.run_tasks runs a task the pool has not started in the caller; a process
forked while a mask is drawn ahead neither hangs nor draws another mask."""
import os
import threading
import time
import weakref

import numpy as np
import pytest

import npformer
from npformer.runtime import lookahead, random
from npformer.runtime import threads as _threads
from npformer import functional as F
from npformer import models, optim
from npformer.functional.activation import dropout_threshold

from helpers import child_exit_code

WAIT = 30  # seconds before a missed event (or a hung child) fails the test instead of hanging it


@pytest.fixture
def two_threads(monkeypatch):
    saved = _threads.get_num_threads()
    _threads.set_num_threads(2)
    monkeypatch.setattr(lookahead, "_local", lookahead._Local())   # a fresh pass history
    yield
    _threads.set_num_threads(saved)


def train(steps, batches, lookahead_on, monkeypatch, before_step=lambda step, model: None):
    """Losses and final parameters of a small CausalLM trained on `batches` (cycled), dropout 0.3;
    before_step(step, model) runs before each step's forward pass."""
    monkeypatch.setenv("NPFORMER_LOOKAHEAD", "1" if lookahead_on else "0")
    monkeypatch.setattr(lookahead, "_local", lookahead._Local())
    npformer.manual_seed(3)
    model = models.CausalLM(vocab_size=11, d_model=16, nhead=2, num_layers=2, dim_feedforward=32,
                            dropout=0.3, max_len=12).train()
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        before_step(step, model)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 11), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.data.copy() for p in model.parameters()]


def test_training_is_the_same_to_the_bit_with_and_without_lookahead(two_threads, monkeypatch):
    rng = np.random.default_rng(0)
    same = [rng.integers(0, 11, (4, 9))]
    # the batch shape changes every other step: the predictions fail there and draw their own
    changing = [rng.integers(0, 11, (4, 9)), rng.integers(0, 11, (3, 12)), rng.integers(0, 11, (4, 9))]
    for batches in (same, changing):
        on = train(5, batches, True, monkeypatch)
        off = train(5, batches, False, monkeypatch)
        assert on[0] == off[0]
        for a, b in zip(on[1], off[1]):
            np.testing.assert_array_equal(a, b)


def test_one_thread_draws_a_pass_of_small_masks_together_to_the_same_bits(monkeypatch):
    """Without a pool the predicted pass's small masks are drawn together by its first request (one
    draw of the stream for them all): the same losses and weights as drawing each as asked."""
    saved = _threads.get_num_threads()
    _threads.set_num_threads(1)
    joint_draws = []
    draw_together = random._Joint.draw_together

    def counted(requests):
        joint_draws.append(len(requests))
        return draw_together(requests)
    monkeypatch.setattr(random._Joint, "draw_together", staticmethod(counted))
    try:
        batches = [np.random.default_rng(0).integers(0, 11, (4, 9))]
        on = train(3, batches, True, monkeypatch)
        assert joint_draws and min(joint_draws) > 1        # the second and third passes: in one draw
        assert len(joint_draws) == 2
        joint_draws.clear()
        off = train(3, batches, False, monkeypatch)
        assert not joint_draws
    finally:
        _threads.set_num_threads(saved)
    assert on[0] == off[0]
    for a, b in zip(on[1], off[1]):
        np.testing.assert_array_equal(a, b)


def test_small_masks_of_one_stream_are_grouped_up_to_the_group_size():
    small, big = lookahead.SMALL_MASK, lookahead.SMALL_MASK + 1

    class Joint:
        def __init__(self, stream, n):
            self.stream, self.n = stream, n

    def request(stream, n, joint=True):
        return ("key", 0, None, Joint(stream, n) if joint else None)
    requests = [request(1, 10), request(1, small), request(1, big), request(1, 5), request(2, 5),
                request(2, 5, joint=False)] + [request(2, small)] * (lookahead.GROUP_VALUES // small + 1)
    sizes = [[None if r[3] is None else r[3].n for r in group] for group in lookahead._groups(requests)]
    assert sizes[:5] == [[10, small], [None], [5], [5], [None]]     # a big mask, another stream, no joint: apart
    assert sizes[5] == [small] * (lookahead.GROUP_VALUES // small) and sizes[6] == [small]


def test_thread_counts_changed_and_passes_that_failed_between_steps_change_no_number(two_threads, monkeypatch):
    """set_num_threads 1 -> 2 -> 3 between steps (the predictions in flight in a pool that is
    replaced), and forward passes that raise after drawing masks (no backward: their requests stay
    in the pass being recorded): the losses and weights of a run with none of it, to the bit."""
    batches = [np.random.default_rng(0).integers(0, 11, (4, 9))]

    def failures(step, model):
        if step in (2, 3, 5):                              # a bad shape in the second layer, after some masks
            layer = model.encoder.layers[1]
            layer.forward_masked = lambda x, mask, *rest: F.linear(x, npformer.Tensor(np.ones((32, 15))))
            try:
                with pytest.raises(ValueError, match="linear"):
                    model(batches[0][:, :-1])
            finally:
                del layer.forward_masked

    def threads_and_failures(step, model):
        _threads.set_num_threads((1, 2, 3)[step % 3])
        failures(step, model)
    changed = train(7, batches, True, monkeypatch, threads_and_failures)
    _threads.set_num_threads(1)
    alone = train(7, batches, False, monkeypatch, failures)
    assert changed[0] == alone[0]
    for a, b in zip(changed[1], alone[1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("on", [True, False])
def test_a_forward_without_backward_then_a_reseed_changes_no_number(two_threads, monkeypatch, on):
    """After three steps, an evaluation forward in training mode (masks drawn, no backward), then
    manual_seed: the next pass's requests start below the unfinished pass's first, so they begin
    a new pass (they once joined it at negative offsets, and the pass after predicted masks below
    offset 0: an OverflowError). The training is that of the same reseed without the forward."""
    batches = [np.random.default_rng(0).integers(0, 11, (4, 9))]

    def reseed(step, model):
        if step == 3:
            npformer.manual_seed(3)
    alone = train(5, batches, on, monkeypatch, reseed)

    def forward_then_reseed(step, model):
        if step == 3:
            model(batches[0][:, :-1])                      # no backward: the pass stays open
        reseed(step, model)
    reseeded = train(5, batches, on, monkeypatch, forward_then_reseed)
    assert reseeded[0] == alone[0]
    for a, b in zip(reseeded[1], alone[1]):
        np.testing.assert_array_equal(a, b)


def test_second_pass_is_drawn_ahead_and_a_mismatch_drops_the_predictions(two_threads):
    seed, threshold = 7, 6554
    drawn = []

    def request(n, offset):
        def draw(at):
            drawn.append((threading.current_thread() is threading.main_thread(), n, at))
            return random._at_least_now(seed, at, n, threshold)
        mask = lookahead.take(("test", n), offset, draw)
        return (draw(offset), False) if mask is None else (mask, True)

    sizes = [100, 37, 256]
    offset = 0
    for _ in sizes:                                 # pass 1: nothing predicted
        assert request(_, offset)[1] is False
        offset += 256
    lookahead.end_pass()
    start = 10_000 * 8                              # pass 2 starts elsewhere in the stream
    mask, ahead = request(100, start)
    assert not ahead                                # the first request of a pass draws its own
    deadline = time.monotonic() + 10                # (the pool's threads take the two draws: not a race
    while sum(not main for main, _, _ in drawn) < 2 and time.monotonic() < deadline:   # with the requests)
        time.sleep(0.001)
    for n, relative in ((37, 256), (256, 512)):
        mask, ahead = request(n, start + relative)
        assert ahead
        np.testing.assert_array_equal(mask, random._at_least_now(seed, start + relative, n, threshold))
    assert any(not main for main, _, _ in drawn)    # drawn in the pool
    lookahead.end_pass()
    request(100, 0)
    assert request(38, 256)[1] is False             # not the predicted size: predictions dropped
    assert request(256, 512)[1] is False
    lookahead.end_pass()
    request(100, 0)
    assert request(38, 264)[1] is False             # the predicted mask, but elsewhere in the stream


def test_lookahead_off_with_one_thread_or_by_the_environment(monkeypatch):
    saved = _threads.get_num_threads()
    try:
        _threads.set_num_threads(1)
        assert not lookahead.enabled()
        _threads.set_num_threads(2)
        assert lookahead.enabled()
        monkeypatch.setenv("NPFORMER_LOOKAHEAD", "0")
        assert not lookahead.enabled()
        monkeypatch.setenv("NPFORMER_LOOKAHEAD", "off")
        with pytest.raises(ValueError, match="NPFORMER_LOOKAHEAD must be '0' or '1', got 'off'"):
            lookahead.enabled()
    finally:
        _threads.set_num_threads(saved)


def test_another_thread_setting_one_thread_while_a_pass_is_predicted(two_threads, monkeypatch):
    """npformer.set_num_threads(1) from another thread lands between the check that there is a pool
    and the draws ahead (forced here): the pass draws its own masks, the same ones, no error."""
    enabled = lookahead.enabled

    def then_one_thread():
        on = enabled()
        _threads.set_num_threads(1)                 # as another thread would, right then
        return on
    monkeypatch.setattr(lookahead, "enabled", then_one_thread)
    x = npformer.Tensor(np.arange(1.0, 65.0), requires_grad=True)

    def step():
        stream = random.Philox(4)
        masks = [F.dropout(x, p, generator=stream) for p in (0.3, 0.5, 0.2)]
        sum(masks).sum().backward()
        return [m.numpy() for m in masks]
    expected = step()                               # recorded (no prediction yet)
    for _ in range(2):
        for got, want in zip(step(), expected):
            np.testing.assert_array_equal(got, want)
        _threads.set_num_threads(2)


def test_run_tasks_does_not_wait_for_a_busy_pool(two_threads):
    release = threading.Event()
    busy = _threads.submit(release.wait, 30)        # the pool's one thread is taken
    where = []

    def task(start, stop):
        where.append(threading.current_thread() is threading.main_thread())
        return start + stop
    assert _threads.run_tasks([(task, 0, 1), (task, 2, 3)]) == [1, 5]
    assert where == [True, True]                    # the second task ran here, not after `busy`
    assert not busy.done()
    release.set()
    busy.result()


def test_a_child_forked_while_a_mask_is_drawn_ahead_draws_it_itself(two_threads, monkeypatch):
    """os.fork (multiprocessing's "fork" start method, DataLoader-like workers) in the middle of a
    forward pass, while the pool draws that pass's next mask: the pool's threads are not in the
    child, so the child must not wait for that draw; it draws the mask itself, the same bits, and
    its own pool runs blocks."""
    started, release = threading.Event(), threading.Event()
    draw_now = random._at_least_now

    def held_in_the_pool(*args):                    # the draw ahead is running in the pool at the fork
        if threading.current_thread() is not threading.main_thread():
            started.set()
            release.wait(WAIT)
        return draw_now(*args)
    monkeypatch.setattr(random, "_at_least_now", held_in_the_pool)
    monkeypatch.setattr(lookahead, "SMALL_MASK", 0)  # these masks are small: drawn alone, ahead in the pool
    x = npformer.Tensor(np.arange(1.0, 101.0), requires_grad=True)
    stream = random.Philox(11)
    first = F.dropout(x, 0.3, generator=stream)
    (first.sum() + F.dropout(x, 0.5, generator=stream).sum()).backward()    # the pass to predict from
    F.dropout(x, 0.3, generator=stream)             # the next pass: the 0.5 mask is drawn ahead
    assert started.wait(WAIT), "the mask was not drawn ahead"
    offset = stream.offset
    expected = x.numpy() * (random.bits16(11, offset, 100) >= dropout_threshold(0.5)) / 0.5
    pid = os.fork()
    if pid == 0:                                    # the child: never returns into pytest
        code = 1
        try:
            same = np.array_equal(F.dropout(x, 0.5, generator=stream).numpy(), expected)
            pooled = _threads.run_blocks(lambda a, b: b - a, [(0, 3), (3, 10)]) == [3, 7]
            code = 0 if same and pooled else 3
        finally:
            os._exit(code)
    release.set()
    np.testing.assert_array_equal(F.dropout(x, 0.5, generator=stream).numpy(), expected)
    code = child_exit_code(pid, WAIT, "the forked child hung on the parent's draw ahead")
    assert code == 0, "the child drew another mask or its pool failed"


def test_a_forward_stopped_by_an_exception_keeps_no_mask_drawn_ahead(two_threads, monkeypatch):
    """A forward pass that raises (here in its second layer, after the first layer's masks) leaves no
    mask drawn ahead for the rest of it in memory: they would stay until the thread's next mask or
    backward, for good in a thread that only runs inference afterwards."""
    drawn_in_pool = []
    for name in ("_at_least_now", "_at_least_in_runs_now"):
        def recording(*args, draw=getattr(random, name)):
            mask = draw(*args)
            if threading.current_thread() is not threading.main_thread():
                drawn_in_pool.append(weakref.ref(mask))
            return mask
        monkeypatch.setattr(random, name, recording)
    monkeypatch.setattr(lookahead, "SMALL_MASK", 0)  # these masks are small: drawn alone, ahead in the pool
    npformer.manual_seed(0)
    model = models.CausalLM(vocab_size=11, d_model=16, nhead=2, num_layers=2, dim_feedforward=32,
                            dropout=0.3, max_len=12).train()
    ids = np.random.default_rng(0).integers(0, 11, (4, 9))
    model(ids).sum().backward()                     # a complete pass: the next one is predicted

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(model.encoder.layers[1], "forward_masked", interrupted)
    mask_of = lookahead._Drawn.mask

    def waiting(drawn, index):
        """The caller waits for the pool's draw instead of taking an unstarted one over (which it
        does when the pool thread is slow to start: then no mask was drawn in the pool, and the test
        proved nothing), so the first layer's masks are drawn in the pool."""
        if drawn.masks is None and drawn.task is not None:
            drawn.task.result(timeout=WAIT)
        return mask_of(drawn, index)
    monkeypatch.setattr(lookahead._Drawn, "mask", waiting)
    try:
        model(ids)
    except KeyboardInterrupt:
        pass
    _threads.submit(lambda: None).result(timeout=WAIT)  # the pool's worker is done with the draws before it
    assert drawn_in_pool
    assert all(mask() is None for mask in drawn_in_pool)
