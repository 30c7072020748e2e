"""What the test files share: the registry's three checks as parametrised tests (`op_tests`),
comparisons with torch and between two implementations for tests written by hand, module
helpers, the settings of the property-based tests, and a deliberately wrong backward.
Example counts are bounded so that property tests run in seconds (set
NPFORMER_HYPOTHESIS_EXAMPLES to search longer)."""
import functools
import json
import os

import numpy as np
import pytest
from hypothesis import settings, strategies as st

import autograd
from autograd import Function, Tensor, backend
from autograd.gradcheck import vjp
from npformer import interop, opcases
from npformer.models import huggingface
from npformer.safetensors_file import write_safetensors

from tolerances import host, scaled

F64 = dict(atol=1e-10, rtol=0.0)
F32 = dict(atol=1e-5, rtol=1e-4)


def op_tests(family):
    """The registry's tests of one op family (npformer.opcases; or of a list of cases):
    gradcheck on every device, torch in float64 (and float32 where the case allows) on every
    device, and the twin on every device. A test file binds them:
    `test_gradcheck, ... = op_tests("softmax")`."""
    cases = opcases.cases(family) if isinstance(family, str) else list(family)

    def parametrize(selected, ids=None):
        return pytest.mark.parametrize("case", selected, ids=ids or [c.name for c in selected])

    @parametrize([c for c in cases if c.finite_differences])
    def test_gradcheck(case, device):
        assert opcases.gradcheck_case(case, np.random.default_rng(1), device)

    with_torch = [(c, dtype) for c in cases if c.torch for dtype in ("float64", "float32")
                  if dtype == "float64" or c.float32]

    @parametrize(with_torch, [f"{c.name}-{dtype}" for c, dtype in with_torch])
    def test_matches_torch(case, device, torch):
        case, dtype = case
        comparison = opcases.compare_with_torch(case, torch, np.random.default_rng(2), device, dtype)
        assert comparison.passed, comparison

    @parametrize([c for c in cases if c.twin])
    def test_matches_composite_twin(case, device):
        comparison = opcases.compare_with_twin(case, np.random.default_rng(4), device)
        assert comparison.passed, comparison

    return test_gradcheck, test_matches_torch, test_matches_composite_twin


def double_backward_tests(family):
    """The second derivatives of one op family's registry cases: `autograd.gradgradcheck` (float64,
    random grad_outputs, every input and parameter) on every device where the case allows finite
    differences, and the HVP against torch's double backward for every case with a torch reference.
    A test file binds them:
    `test_gradgradcheck, test_double_backward_matches_torch = double_backward_tests("softmax")`."""
    cases = opcases.cases(family)
    checked = [c for c in cases if c.finite_differences]

    @pytest.mark.parametrize("case", checked, ids=[c.name for c in checked])
    def test_gradgradcheck(case, device):
        assert opcases.gradgradcheck_case(case, np.random.default_rng(5), device)

    with_torch = [c for c in cases if c.torch]

    @pytest.mark.parametrize("case", with_torch, ids=[c.name for c in with_torch])
    def test_double_backward_matches_torch(case, torch):
        assert_double_backward_matches_torch(case, torch, np.random.default_rng(6))

    return test_gradgradcheck, test_double_backward_matches_torch


def assert_double_backward_matches_torch(ours, torch, rng, torch_fn=None, arrays=None,
                                         tolerance=opcases.TOLERANCE["torch", "float64"]):
    """The second derivative of `ours` against torch's double backward, in float64
    (opcases.compare_hvp: the HVP d/dx <d/dx <f(x), g>, u> and the first derivative for random g
    and u, over every input and every parameter of a module case, attention on torch's math backend).

    ours: an OpCase (opcases.compare_hvp_with_torch), or a function of Tensors with
    `torch_fn(torch, *leaves)` the same function in torch and `arrays` its float64 inputs.
    tolerance: per array, max |ours - torch| <= tolerance * max(1, max |torch|)."""
    if isinstance(ours, opcases.OpCase):
        comparison = opcases.compare_hvp_with_torch(ours, torch, rng)
    else:
        leaves = [torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True) for a in arrays]
        comparison = opcases.compare_hvp(ours, [leaf(a) for a in arrays], torch, functools.partial(torch_fn, torch),
                                         leaves, [f"input {i}" for i in range(len(arrays))], rng, tolerance)
    assert comparison.passed, comparison


def case_hvp(instance, upstream, directions):
    """d/dx <d/dx <f(x), g>, u> of a registry case's instance, for every input and parameter x:
    the second derivative contracted with the upstream gradients g (one per output) and the
    directions u (one per x), host float64 arrays (zeros where a gradient does not depend on x)."""
    xs = instance.tensors
    on_device = lambda a, like: Tensor(backend.to_device(a, like.device))  # noqa: E731
    result = instance(*xs)
    outs = [o for o in (result if isinstance(result, (tuple, list)) else [result]) if o is not None]
    return opcases.hvp(instance, xs, [on_device(g, o) for g, o in zip(upstream, outs)],
                       [on_device(u, x) for u, x in zip(directions, xs)], autograd.grad)[1]


def forward_mode_tests(family, tangents=None):
    """Forward mode on the registry's cases of one op family: `autograd.gradcheck` with
    check_forward_ad=True (float64, every device) on each case finite differences can check,
    `assert_jvp_matches_torch` on each case with a torch reference, and float32 tangents against
    float64 ones (every device). Each moves every input of an op case, and a module case's inputs
    (its parameters stay constants: the op cases move them). tangents: None, or case -> what
    `assert_jvp_matches_torch` takes as tangents (None for that case). A test file binds them:
    `test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32 =
    forward_mode_tests("relu")`."""
    cases = opcases.cases(family)
    checked = [c for c in cases if c.finite_differences]
    with_torch = [c for c in cases if c.torch]

    def parametrize(selected):
        return pytest.mark.parametrize("case", selected, ids=[c.name for c in selected])

    @parametrize(checked)
    def test_forward_mode_gradcheck(case, device):
        assert opcases.forward_mode_case(case, np.random.default_rng(1), device)

    @parametrize(with_torch)
    def test_jvp_matches_torch(case, torch):
        assert_jvp_matches_torch(case, torch, np.random.default_rng(2), None if tangents is None else tangents(case))

    @parametrize(cases)
    def test_forward_mode_in_float32(case, device):
        """The rules keep float32 (the engine refuses a tangent of another dtype) and round like it."""
        runs = []
        for dtype in ("float64", "float32"):
            rng = np.random.default_rng(5)
            instance = opcases.instantiate(case, rng, device, dtype)
            directions = [rng.standard_normal(a.shape).astype(dtype) for a in instance.arrays]
            runs.append(opcases.case_jvp(instance, [backend.to_device(u, device) for u in directions]))
        (_, exact), (outs, rounded) = runs
        assert all(str(o.dtype) == "float32" for o in outs)
        labels = [f"tangent of output {i}" for i in range(len(outs))]
        comparison = opcases.compare(rounded, [backend.as_numpy(t) for t in exact], labels,
                                     opcases.TOLERANCE["torch", "float32"])
        assert comparison.passed, comparison

    return test_forward_mode_gradcheck, test_jvp_matches_torch, test_forward_mode_in_float32


def assert_jvp_matches_torch(case, torch, rng, tangents=None):
    """Forward mode of an op case against `torch.func.jvp` of its torch reference, in float64
    (opcases.compare_jvp_with_torch: every output and its tangent to the registry's tolerance).
    tangents: None, or a function of the drawn tangents (one array per input) returning the ones to use."""
    comparison = opcases.compare_jvp_with_torch(case, torch, rng, tangents=tangents)
    assert comparison.passed, f"{case.name}: {comparison}"


def leaf(array, device="cpu", dtype=np.float64):
    return Tensor(np.array(array, dtype=dtype), requires_grad=True, device=device)


def compare_with_torch(torch, ours_fn, torch_fn, arrays, rng, atol=1e-10, rtol=1e-10, device="cpu",
                       dtype=np.float64, torch_dtype=None, scale=None):
    """Run both on the same inputs, backward with one random upstream gradient; compare the
    output and the gradient of every input (and that ours keeps the dtype). torch_dtype=float64
    runs torch in float64 on our float32 inputs (where torch's float32 kernel is the less exact).
    atol is set at unit scale: it is multiplied by `scale`, by default max(1, magnitude) of every
    input (tolerances.scaled), and for the gradients also by that of the upstream gradient."""
    ours_in = [leaf(a, device, dtype) for a in arrays]
    theirs_in = [torch.tensor(np.asarray(a, dtype).astype(torch_dtype or dtype), requires_grad=True) for a in arrays]
    (out,), (g,), grads = vjp(ours_fn, ours_in, seed=int(rng.integers(2**31)))
    ref = torch_fn(*theirs_in)
    assert out.dtype == dtype
    atol = scaled(atol, *arrays) if scale is None else atol * scale
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol)
    ref.backward(torch.tensor(backend.as_numpy(g).astype(torch_dtype or dtype)))
    for i, (a, b) in enumerate(zip(grads, theirs_in)):
        assert a.dtype == dtype
        np.testing.assert_allclose(backend.as_numpy(a), b.grad.numpy(), atol=scaled(atol, g), rtol=rtol,
                                   err_msg=f"gradient of input {i}")


def compare_runs(fn_a, fn_b, arrays, rng, device="cpu", atol=1e-12):
    """Run two implementations on separate float64 leaves holding `arrays`, backpropagate the same
    random upstream gradients through both, and compare every output and input gradient (atol,
    rtol: set at unit scale, atol times the magnitudes of the inputs and upstream gradients)."""
    outs_a, upstream, grads_a = vjp(fn_a, [leaf(a, device) for a in arrays], seed=int(rng.integers(2**31)))
    outs_b, _, grads_b = vjp(fn_b, [leaf(a, device) for a in arrays], upstream)
    atol, rtol = scaled(atol, *arrays, *upstream), atol
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert a.device == device and a.dtype == np.float64
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=atol, rtol=rtol, err_msg=f"output {i}")
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        np.testing.assert_allclose(backend.as_numpy(a), backend.as_numpy(b), atol=atol, rtol=rtol,
                                   err_msg=f"gradient of input {i}")
    return outs_a


def assert_torch_parity(torch, ours, ours_fn, torch_fn, arrays, *, atol, rtol=0.0, device="cpu", seed=0):
    """Compare `ours` with `interop.to_torch(ours)` forward and backward.

    arrays: float input arrays (dtype of the model), given as leaf Tensors (on `device`) to
    ours_fn(module, *tensors) and as torch leaves to torch_fn(torch_module, *tensors); the
    functions return one output or a tuple (None entries are skipped). Backward uses random
    upstream gradients; compared: every output, every input gradient and the gradient of
    every parameter (matched by name). atol is set at unit scale: it grows with the magnitudes
    of the inputs and parameters (and, for gradients, of the upstream gradients).
    """
    theirs = interop.to_torch(ours)
    ours.zero_grad()
    ours.to(device)
    ours_in = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    theirs_in = [torch.tensor(a, requires_grad=True) for a in arrays]
    results = []

    def run(*xs):  # keeps the raw result: the None entries are compared with torch's
        results.append(ours_fn(ours, *xs))
        return results[-1]

    outs, upstream, _ = vjp(run, ours_in, seed=seed)
    refs = torch_fn(theirs, *theirs_in)
    atol = scaled(atol, *arrays, *ours.parameters())
    everything = results[0] if isinstance(results[0], tuple) else (results[0],)
    refs = refs if isinstance(refs, tuple) else (refs,)
    assert len(everything) == len(refs)
    for i, (o, r) in enumerate(zip(everything, refs)):
        assert (o is None) == (r is None), f"output {i}: one side returned None"
    refs = [r for r in refs if r is not None]
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.device == device and o.dtype == arrays[0].dtype
        got, want = o.numpy(), r.detach().numpy()
        assert got.shape == want.shape, f"output {i}: shape {got.shape} vs torch {want.shape}"
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"output {i}")
    sum((r * torch.tensor(backend.as_numpy(g))).sum() for r, g in zip(refs, upstream)).backward()
    atol = scaled(atol, *upstream)
    for i, (a, b) in enumerate(zip(ours_in, theirs_in)):  # an unused input has no gradient on either side
        assert (a.grad is None) == (b.grad is None), f"gradient of input {i}: present on one side only"
        if a.grad is not None:
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), atol=atol, rtol=rtol,
                                       err_msg=f"gradient of input {i}")
    named = dict(theirs.named_parameters())
    ours_named = dict(ours.named_parameters())
    assert set(ours_named) == set(named)
    for name, p in ours_named.items():
        want = named[name].grad
        want = np.zeros(p.shape) if want is None else want.numpy()
        got = np.zeros(p.shape) if p.grad is None else p.grad.numpy()
        assert p.grad is None or p.grad.device == device
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"gradient of parameter {name}")
    return everything


def gradcheck_module(module, fn, arrays, device="cpu", **options):
    """autograd.gradcheck of fn(module, *inputs) over every input array and every parameter (float64)."""
    module.double().to(device)
    inputs = [Tensor(a, requires_grad=True, device=device) for a in arrays]
    params = list(module.parameters())
    count = len(inputs)
    return autograd.gradcheck(lambda *xs: fn(module, *xs[:count]), inputs + params, **options)


class WrongSoftmax(Function):
    """A softmax whose backward centres dy by its plain mean instead of its y-weighted mean:
    dx = y * (dy - mean(dy)) instead of y * (dy - sum(dy * y)). Its gradient of out.sum() is zero
    like the right one, so only a random upstream gradient can tell them apart."""

    @staticmethod
    def forward(ctx, x):
        xp = backend.get_array_module(x)
        e = xp.exp(x - x.max(axis=-1, keepdims=True))
        y = e / e.sum(axis=-1, keepdims=True)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return y * (grad - grad.mean(axis=-1, keepdims=True))


def assert_clear_error(call, error, words):
    """call() raises `error` whose message contains every one of `words`."""
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


# -- property-based tests (hypothesis) ---------------------------------------------------------------
HYPOTHESIS = settings(max_examples=int(os.environ.get("NPFORMER_HYPOTHESIS_EXAMPLES", 20)), deadline=None)
DTYPES = st.sampled_from([np.float64, np.float32])


def tolerance(dtype):
    """Against torch in property tests: float64 to 1e-10, float32 to 1e-5 (absolute) and 1e-4 (relative)."""
    return {"atol": 1e-10, "rtol": 1e-10} if dtype == np.float64 else {"atol": 1e-5, "rtol": 1e-4}


def child_exit_code(pid, seconds, hung):
    """The exit code of the forked child `pid`; killed, and the test failed with `hung`, when it
    has not exited within `seconds` (a fork that inherited a held lock hangs)."""
    import os
    import signal
    import time
    deadline = time.monotonic() + seconds
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(hung)
    return os.waitstatus_to_exitcode(done[1])


# -- shared by several test files ---------------------------------------------------------------
def outputs_and_grads(fn, arrays):
    """fn's outputs and the gradient of every input for a fixed random upstream gradient."""
    outs, _, grads = vjp(fn, [Tensor(a.copy(), requires_grad=True) for a in arrays])
    return [o.data for o in outs] + grads


def assert_same_with_threads(threads, fn, arrays):
    threads(1)
    serial = outputs_and_grads(fn, arrays)
    for n in (2, 3, 4):   # 4: linear's backward gives dx and dW two threads each
        threads(n)
        parallel = outputs_and_grads(fn, arrays)
        for a, b in zip(serial, parallel):
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


def to_torch_kwargs(torch, kwargs):
    return {k: torch.tensor(v) for k, v in kwargs.items()}


PAD = 0


def padded_batch(rng, vocab, lengths, width):
    """(B, width) ids in [1, vocab) right-padded with PAD to the given lengths."""
    ids = rng.integers(1, vocab, size=(len(lengths), width))
    for row, n in enumerate(lengths):
        ids[row, n:] = PAD
    return ids


def gpt2_config(transformers, **options):
    settings = dict(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=4, bos_token_id=None,
                    eos_token_id=None)
    return transformers.GPT2Config(**{**settings, **options})


def randomised(torch, model, dtype):
    """`model` in `dtype` and eval mode with every parameter moved off its initial value (biases
    are zero and LayerNorm weights one at init: a swapped or dropped one would go unnoticed)."""
    torch.manual_seed(0)
    model = model.to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


GPT2 = dict(activation="gelu_tanh", tie_weights=True, attention_dropout=0.1, activation_dropout=0.0)


def gpt2_download(folder, ours):
    """A folder laid out like a GPT-2 download: config.json as published, and model.safetensors
    with unprefixed names, no lm_head (tied) and the causal-mask buffers h.{i}.attn.bias."""
    c = ours.config
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": c["max_len"], "n_embd": c["d_model"],
        "n_head": c["nhead"], "n_layer": c["num_layers"], "n_positions": c["max_len"], "resid_pdrop": 0.1,
        "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
        "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": c["vocab_size"],
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}}))
    tensors = huggingface.hf_state_dict(ours, prefixed=False)
    n = c["max_len"]
    for i in range(c["num_layers"]):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((n, n), dtype="float32"))[None, None]
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    return folder
