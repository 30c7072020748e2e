"""autograd.backward_steps and print_backward: the backward pass one node at a time, the engine's
own (the same .grad bit for bit), what each step holds, and where each op's formula is."""
import inspect
import io
import re
import sys

import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Function, Tensor, hooks
from autograd.backward_steps import formula_location
from autograd.function import backward_order
from npformer import models


def tiny_seq2seq():
    model = models.Seq2SeqTransformer(7, 7, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                      dim_feedforward=16, dropout=0.0).to(dtype=np.float64)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(0, 7, (2, 4)), rng.integers(0, 7, (2, 3))
    return model, lambda: F.cross_entropy(model(src, tgt).reshape(-1, 7), tgt.reshape(-1))


def tiny_causal_lm():
    model = models.CausalLM(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=8, dropout=0.0,
                            positional="rope", norm="rmsnorm").to(dtype=np.float64)
    ids = np.random.default_rng(1).integers(0, 11, (2, 5))
    return model, lambda: F.cross_entropy(model(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1))


def reference_grads(model, make_loss):
    model.zero_grad()
    make_loss().backward()
    grads = {name: p.grad.data.copy() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("build", [tiny_seq2seq, tiny_causal_lm])
def test_the_steps_give_backwards_grad_bit_for_bit_and_every_node_a_formula(build):
    model, make_loss = build()
    expected = reference_grads(model, make_loss)
    steps = list(autograd.backward_steps(make_loss(), names=model))
    got = {name: p.grad.data for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and len(got) > 10
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    for step in steps:  # npformer's ops point to their folder's formulas, the primitives to ops.py
        folder = step.op.__module__.split(".")[2] if step.op.__module__.startswith("npformer.") else None
        where = f"npformer/functional/{folder}/" if folder else "autograd/ops.py"
        assert step.formula_path.replace("\\", "/").startswith(where), (step.name, step.formula_path)
    names = {i.name for step in steps for i in step.inputs if i.leaf}
    assert names == set(expected)  # every parameter with a gradient named where its gradient goes


def test_the_printout_lists_every_node_once_in_order_with_the_gradients_norms():
    model, make_loss = tiny_seq2seq()
    loss = make_loss()
    order = backward_order([loss.creator])
    out = io.StringIO()
    steps = autograd.print_backward(loss, names=model, file=out)
    text = out.getvalue()
    headers = re.findall(r"^#(\d+) (\w+)  (\S+):(\d+) ", text, re.M)
    assert [int(i) for i, *_ in headers] == list(range(len(order)))
    assert [name for _, name, *_ in headers] == [type(node).__qualname__ for node in order]
    assert len({id(node) for node in order}) == len(order) == len(steps)
    assert text.splitlines()[-1] == f"{len(order)} nodes"
    assert repr(steps[2]) == f"<BackwardStep #2 of {len(order)}: {type(order[2]).__qualname__}>"
    norms = [float(x) for x in re.findall(r"\|g\| = (\S+)", text)]
    expected = []
    for step in steps:  # the norms printed, in order: each output's arriving, then each input's leaving
        for t in step.outputs + step.inputs:
            if t.grad is not None:
                expected.append(float(f"{np.sqrt(np.sum(np.square(t.grad))):.6g}"))
    assert norms == expected and len(norms) > 3 * len(steps)
    for (_, _, path, line), step in zip(headers, steps):
        assert (path, int(line)) == (step.formula_path, step.formula_line)


def test_each_step_holds_the_gradient_arriving_as_the_sum_of_those_sent_to_it():
    model, make_loss = tiny_seq2seq()
    steps = list(autograd.backward_steps(make_loss(), names=model))
    sent = {}
    for step in steps:
        for j, out in enumerate(step.outputs):
            parts = sent.get((step.index, j))
            if step.index == 0:
                np.testing.assert_array_equal(out.grad, np.ones(()))
            elif parts is None:
                np.testing.assert_array_equal(out.grad, np.zeros(out.shape))  # an output that did not reach the loss
            else:  # summed in the order the pass ran: the engine's own sums
                total = parts[0]
                for p in parts[1:]:
                    total = total + p
                np.testing.assert_array_equal(out.grad, total)
            assert out.grad.shape == out.shape and out.dtype == np.float64
        for i in step.inputs:
            assert i.shape == i.tensor.shape and i.dtype == i.tensor.dtype
            if i.grad is not None:
                assert i.grad.shape == i.shape and i.grad_norm == pytest.approx(np.linalg.norm(i.grad), rel=1e-12)
            if i.to_step is not None:
                assert i.to_step > step.index and steps[i.to_step].op is i.to_op
                sent.setdefault((i.to_step, i.tensor.output_index), []).append(i.grad)
    uses = {}
    for step in steps:
        for i in step.inputs:
            if i.leaf:
                uses.setdefault(i.name, []).append(i.grad)
    for name, p in model.named_parameters():  # a parameter used once: its .grad is the gradient that left
        if len(uses.get(name, ())) == 1:
            np.testing.assert_array_equal(p.grad.data, uses[name][0])


def small_graph():
    w = Tensor(np.array([[1.0, 2.0], [3.0, -1.0]]), requires_grad=True)
    x = Tensor(np.array([0.5, -2.0]))
    h = (w @ x).exp()
    return w, x, (h * w.sum()).sum()


def test_stopping_early_leaves_the_graph_as_a_failed_backward_does():
    w, x, loss = small_graph()
    for step in autograd.backward_steps(loss, retain_graph=True):
        if step.index == 1:
            break
    nodes = backward_order([loss.creator])
    assert all(g is None for node in nodes for g in node.output_grads)  # no partial sums left
    w.grad = None
    loss.backward()  # the retained graph runs again, as if never stepped
    w2, _, loss2 = small_graph()
    loss2.backward()
    np.testing.assert_array_equal(w.grad.data, w2.grad.data)
    w, x, loss = small_graph()
    steps = autograd.backward_steps(loss)
    next(steps)
    steps.close()  # without retain_graph: the node run is freed, the rest cleared, and backward refuses
    with pytest.raises(RuntimeError, match="already freed"):
        loss.backward()
    with pytest.raises(RuntimeError, match="already freed"):
        autograd.backward_steps(loss)  # said when called, before any step


def test_an_error_in_a_node_is_the_engines_and_the_caller_keeps_its_grad_mode():
    w, x, loss = small_graph()
    w.data[0, 0] = 5.0  # changed in place after MatMul saved it
    w.bump_version()
    steps = autograd.backward_steps(loss)
    with pytest.raises(RuntimeError) as stepped:
        for _ in steps:
            assert autograd.is_grad_enabled()  # the pass's no_grad is only around each node
    w2, x2, loss2 = small_graph()
    w2.data[0, 0] = 5.0
    w2.bump_version()
    with pytest.raises(RuntimeError) as backward:
        loss2.backward()
    assert str(stepped.value) == str(backward.value)


def test_post_accumulate_grad_hooks_and_callbacks_run_as_in_backward():
    def run(step_through):
        w, x, loss = small_graph()
        seen = []
        w.register_post_accumulate_grad_hook(
            lambda t: (seen.append(("hook", t.grad.data.copy(), autograd.is_grad_enabled())),
                       hooks.queue_callback(lambda: seen.append("done"))))
        if step_through:
            for step in autograd.backward_steps(loss):
                seen.append(step.index)
        else:
            loss.backward()
        return seen
    stepped, plain = run(True), run(False)
    hooked = [k for k, s in enumerate(stepped) if isinstance(s, tuple)]
    assert len(hooked) == 1 and stepped[-1] == "done" and len(plain) == 2 and plain[1] == "done"
    np.testing.assert_array_equal(stepped[hooked[0]][1], plain[0][1])  # once, with the whole gradient
    assert stepped[hooked[0]][2] is plain[0][2] is False  # in the pass's grad mode (off), as in backward()
    w, x, loss = small_graph()
    last_use = max(k for k, node in enumerate(backward_order([loss.creator])) if any(t is w for t in node.inputs))
    assert stepped[hooked[0] + 1] == last_use  # run by the step of w's last use, before it is handed over


def test_a_leaf_loss_takes_its_gradient_and_has_no_steps():
    x = Tensor(np.array(2.0), requires_grad=True)
    assert list(autograd.backward_steps(x, np.array(3.0))) == []
    assert x.grad.item() == 3.0


@pytest.mark.parametrize("call, error, message", [
    (lambda: autograd.backward_steps(np.ones(3)), TypeError, "loss must be a Tensor, got ndarray"),
    (lambda: autograd.backward_steps(Tensor(np.ones(()))), RuntimeError, "does not require grad"),
    (lambda: autograd.backward_steps(small_graph()[2], np.ones(2)), ValueError,
     r"backward_steps\(grad\): expected shape \(\), got \(2,\)"),
    (lambda: autograd.backward_steps(small_graph()[2], names=[1]), TypeError, "names must be a model"),
    (lambda: autograd.backward_steps(small_graph()[2], retain_graph=1), TypeError, "retain_graph must be a bool"),
])
def test_bad_arguments_raise_when_called(call, error, message):
    with pytest.raises(error, match=message):
        call()


class Cube(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return 3 * x ** 2 * dy


def test_formula_locations_point_at_the_def_of_the_formula():
    path, line, name = formula_location(Cube)  # a Function of one's own: its backward
    assert name == "Cube.backward" and path.endswith("test_backward_steps.py")
    assert open(inspect.getsourcefile(Cube)).read().splitlines()[line - 1].strip().startswith("def backward")
    path, line, name = formula_location(autograd.ops.Add)
    assert path.replace("\\", "/") == "autograd/ops.py" and name == "Add.backward"
    with pytest.raises(TypeError, match="op must be a Function class"):
        formula_location(len)
    for op in _op_folder_functions():  # a formula of its own folder, at its def line
        path, line, name = formula_location(op)
        folder = op.__module__.split(".")[2]
        assert path.replace("\\", "/").startswith(f"npformer/functional/{folder}/"), (op, path)
        assert open(path).read().splitlines()[line - 1].startswith(f"def {name}("), (op, path, line)


def _op_folder_functions():
    """Every Function class defined in an op folder of npformer.functional (imported with it)."""
    found = []
    for name, module in list(sys.modules.items()):
        folder = name.split(".")[2] if name.startswith("npformer.functional.") and name.count(".") >= 2 else None
        if folder in F.OPS:
            found += [cls for cls in vars(module).values()
                      if isinstance(cls, type) and issubclass(cls, Function) and cls.__module__ == name]
    return found


def test_every_function_of_the_op_folders_names_its_formula():
    functions = _op_folder_functions()
    assert {op.__module__.split(".")[2] for op in functions} == set(F.OPS)
    for op in functions:  # set in the class itself, beside its backward (not inherited, not elsewhere)
        assert "backward_formula" in vars(op), f"{op.__module__}.{op.__name__} has no backward_formula"
