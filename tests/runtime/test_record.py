"""npformer.runtime.record: what a recorded step keeps (ops, recomputed calls, draws) and how a
replay runs it again; the backward of a recorded graph, the engine's pass in an order worked out once."""
import numpy as np
import pytest

import npformer
from autograd import Tensor, hooks
from npformer.runtime import random, record


def test_recomputed_outside_a_recording_is_the_call_itself():
    calls = []
    assert record.recomputed(lambda a, b: calls.append((a, b)) or a + b, 2, 3) == 5 and calls == [(2, 3)]
    assert record.current() is None and not hooks.op_applied


def test_a_replay_runs_the_ops_again_on_the_values_of_the_moment():
    """x (a fixed input array) * w through a recomputed mask: a replay after x and w changed in
    place gives the eager values, its graph's backward (record.Backward) the eager gradient, and
    the ops inside the recomputed call are its own (not recorded twice)."""
    w = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    x = np.array([0.5, -1.0, 2.0])
    recorder = record.Recorder()
    with recorder:
        keep = record.recomputed(lambda a: (Tensor(a) > 0).data.astype(np.float64), x)
        loss = (w * x * keep).sum()
    assert [type(e).__name__ for e in recorder.events] == ["_Raw", "_Op", "_Op", "_Op"]
    recorder.check({id(x)}, [w])
    backward = record.Backward.of(loss)
    x[:] = [-2.0, 4.0, 1.0]
    w.data *= 10
    recorder.replay()
    backward.run()
    assert loss.item() == 40 * 2.0 * 1 + 30 * 1.0
    np.testing.assert_array_equal(w.grad.data, [0.0, 4.0, 1.0])
    assert not hooks.op_applied


def test_a_recomputed_call_whose_shape_changes_is_an_error_at_replay():
    x = np.ones(3)
    size = [3]
    recorder = record.Recorder()
    with recorder:
        record.recomputed(lambda a: np.ones(size[0]), x)
    size[0] = 4
    with pytest.raises(RuntimeError, match=r"gave an array \(4,\) float64 where it gave an array \(3,\) float64 "
                                           r"when recorded"):
        recorder.replay()


def test_each_replay_reserves_a_draws_values_at_the_streams_offset_then():
    """A dropout's (seed, offset) options move with the stream, the seed of the moment included."""
    npformer.manual_seed(1)
    x = Tensor(np.ones(64, dtype=np.float32), requires_grad=True)
    recorder = record.Recorder()
    with recorder:
        y = npformer.functional.dropout(x, 0.5)
    recorder.check({id(x.data)}, [x])
    first = y.data.copy()
    recorder.replay()
    stream = random.dropout_stream()
    assert stream.offset == 128 and not np.array_equal(y.data, first)
    npformer.manual_seed(1)
    recorder.replay()
    np.testing.assert_array_equal(y.data, first)                  # reseeded: the recorded call's mask again


def test_a_recorded_backward_is_the_engines_pass_hooks_and_retained_gradients_included():
    """record.Backward runs autograd's own pass in an order worked out once: a retained gradient
    and a post-accumulate-grad hook (registered after the recording too) work as in the engine."""
    w = Tensor(np.ones(3), requires_grad=True)
    h = w * 2.0
    h.retain_grad()
    backward = record.Backward.of((h * h).sum())
    seen = []
    w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.data.copy()))
    backward.run()
    np.testing.assert_array_equal(h.grad.data, [4.0, 4.0, 4.0])
    np.testing.assert_array_equal(w.grad.data, [8.0, 8.0, 8.0])
    assert len(seen) == 1 and np.array_equal(seen[0], [8.0, 8.0, 8.0])


def test_recording_twice_in_one_thread_is_an_error():
    with record.Recorder():
        with pytest.raises(RuntimeError, match="a step is already being recorded in this thread"):
            record.Recorder().__enter__()
    assert not hooks.op_applied
