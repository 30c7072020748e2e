"""`python -m npformer.exercises train FILE` (issue 44 item 2): the reversal model trained on the
learner's backward passes beside the engine's, same seed. A correct file learns as the engine
does (the curves never part, the same held-out accuracy); a planted bug in any one function
makes the curves part and the checker's verdict names it. Short runs."""
import pathlib
import threading

import numpy as np
import pytest

import npformer.functional as F
from autograd import Tensor
from npformer.exercises.__main__ import main
import npformer.exercises.train as train_module
from npformer.exercises.train import learner_backwards, parting, train_file

HERE = pathlib.Path(__file__).resolve().parent
SOLUTION = (HERE / "solution_backprop.py").read_text()

# one mistake a learner makes in each function (each changes what Adam does with the gradient:
# a constant factor on a whole parameter's gradient would not)
BUGS = {
    "softmax_backward": "def softmax_backward(y, dy):\n    return y * dy                   # no row-sum term\n",
    "log_softmax_backward": "def log_softmax_backward(y, dy):\n    return dy                   # no row-sum term\n",
    "cross_entropy_backward": ("_right_ce = cross_entropy_backward\n\n\ndef cross_entropy_backward(logits, target, dloss):\n"
                               "    z = np.exp(logits - logits.max(axis=-1, keepdims=True))\n"
                               "    return z / z.sum(axis=-1, keepdims=True) * dloss / len(logits)   # no one-hot\n"),
    "layer_norm_backward": ("_right_ln = layer_norm_backward\n\n\ndef layer_norm_backward(x, weight, dy, eps):\n"
                            "    dx, dw, db = _right_ln(x, weight, dy, eps)\n"
                            "    rstd = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + eps)\n"
                            "    return rstd * dy * weight, dw, db          # no mean terms\n"),
    "linear_backward": ("_right_linear = linear_backward\n\n\ndef linear_backward(x, weight, dy):\n"
                        "    dx, dw, db = _right_linear(x, weight, dy)\n    return -dx, dw, db           # sign\n"),
    "gelu_backward": ("def gelu_backward(x, dy):\n"
                      "    return dy * 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))   # no x pdf(x)\n"),
    "embedding_backward": ("def embedding_backward(ids, num_embeddings, dy):\n"
                           "    dweight = np.zeros((num_embeddings, dy.shape[-1]))\n"
                           "    dweight[ids.reshape(-1)] = dy.reshape(-1, dy.shape[-1])   # overwrites repeats\n"
                           "    return dweight\n"),
    "attention_backward": ("_right_attention = attention_backward\n\n\ndef attention_backward(q, k, v, mask, dout, scale):\n"
                           "    dq, dk, dv = _right_attention(q, k, v, mask, dout, scale)\n"
                           "    return dk.sum() * 0 + dq, dq.sum() * 0 + dk, -dv        # dv's sign\n"),
}


def learner_file(tmp_path, extra="", drop=()):
    text = SOLUTION
    for name in drop:                 # the function's definition removed: the file does not define it
        start = text.index(f"def {name}(")
        end = text.find("\ndef ", start + 1)
        text = text[:start] + (text[end + 1:] if end != -1 else "")
    path = tmp_path / "mine.py"
    path.write_text(text + extra)
    return path


def test_a_correct_file_learns_as_the_engine_does(tmp_path, capsys):
    report = train_file(learner_file(tmp_path), steps=60, out=str(tmp_path / "out"), heldout=100)
    out = capsys.readouterr().out
    assert report["parted"] is None and report["max_gap"] < 1e-4
    assert set(report["used"]) == {"softmax_backward", "log_softmax_backward", "cross_entropy_backward",
                                   "layer_norm_backward", "linear_backward", "gelu_backward", "embedding_backward",
                                   "attention_backward"}
    engine, yours = report["engine"], report["yours"]
    assert abs(engine.token_accuracy - yours.token_accuracy) < 0.02 and engine.token_accuracy > 0.15
    assert "the curves never part" in out and "e: the engine's backward passes, y: yours" in out
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("name, drop", [
    ("softmax_backward", ()), ("attention_backward", ()), ("linear_backward", ()), ("layer_norm_backward", ()),
    ("gelu_backward", ()), ("embedding_backward", ()), ("cross_entropy_backward", ()),
    ("log_softmax_backward", ("cross_entropy_backward",)),
])
def test_a_planted_bug_in_any_function_parts_the_curves(tmp_path, capsys, name, drop):
    path = learner_file(tmp_path, "\n\n" + BUGS[name], drop)
    assert main(["train", str(path), "--steps", "12", "--heldout", "20", "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert f"the checker's verdict: wrong: {name} (see the table above)" in out
    assert "the curves part at step " in out, out


def test_a_function_that_breaks_a_step_stops_its_run_with_the_reason(tmp_path, capsys):
    """A dweight of the transposed shape passes no step: the run stops there, the engine's goes on."""
    path = learner_file(tmp_path, "\n\n_right_linear = linear_backward\n\n\ndef linear_backward(x, weight, dy):\n"
                                  "    dx, dw, db = _right_linear(x, weight, dy)\n    return dx, dw.T, db\n")
    assert main(["train", str(path), "--steps", "5", "--heldout", "10", "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "your run stopped at step 1: ValueError: your linear_backward dweight returned shape (32, 20), the " \
           "model needs (20, 32)" in out
    assert "never part" not in out and "before it stopped" in out


def test_parting_names_the_first_step_and_the_gap():
    assert parting([3.0, 2.0, 1.0], [3.0, 2.001, 1.5]) == ((3, pytest.approx(0.5)), pytest.approx(0.5))
    assert parting([3.0, 2.0], [3.0, 2.0000001])[0] is None


def gelu_gradient():
    x = Tensor(np.linspace(-2, 2, 5), requires_grad=True)
    F.gelu(x).sum().backward()
    return np.asarray(x.grad)


def test_your_backward_replaces_the_engines_in_your_thread_only():
    engine = gelu_gradient()
    entered, done = threading.Event(), threading.Event()
    seen = {}

    def learner():
        with learner_backwards({"gelu_backward": lambda x, dy: np.zeros_like(x)}) as replaced:
            seen["replaced"] = replaced
            entered.set()
            done.wait(30)
            seen["inside"] = gelu_gradient()

    thread = threading.Thread(target=learner)
    thread.start()
    assert entered.wait(30)
    np.testing.assert_array_equal(gelu_gradient(), engine)       # this thread: the engine's, while it is open
    done.set()
    thread.join(30)
    assert seen["replaced"] == ["gelu", "linear"] and not seen["inside"].any()
    np.testing.assert_array_equal(gelu_gradient(), engine)
    assert F.gelu is train_module._ENGINE["gelu"]                      # the engine's own function is back
