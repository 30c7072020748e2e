"""Module hooks (`register_forward_pre_hook`, `register_forward_hook`, `register_full_backward_pre_hook`,
`register_full_backward_hook`) and tensor hooks on a two-layer Transformer, against the same model
in torch (npformer.interop.to_torch), float64: what every hook sees, in torch's order, equal to
1e-12; replacements change the gradients as torch's do; handles remove hooks; create_graph and
forward mode; the errors."""
import copy
import warnings

import numpy as np
import pytest

import autograd
from autograd import Tensor
from autograd import forward_ad as fwAD
from npformer import interop, nn
from npformer.nn import module_hooks
from npformer.opcases.modules import randomize_vectors

B, S, T, D, H, FF = 2, 5, 4, 8, 2, 12
# the modules that torch calls as modules (all but out_proj, whose weights torch's MultiheadAttention
# uses directly, and the ModuleLists; npformer runs the hooks of the layers and attention modules around
# their forward_masked, and those of linear1 and the dropouts by running them as modules: docs/hooks.md)
WATCHED = ["encoder", "decoder", "encoder.norm", "decoder.norm"] + [
    f"{stack}.layers.{i}{name}" for stack in ("encoder", "decoder") for i in range(2)
    for name in ("", ".self_attn", ".norm1", ".norm2", ".linear1", ".dropout", ".linear2", ".dropout1", ".dropout2")
    + ((".multihead_attn", ".norm3", ".dropout3") if stack == "decoder" else ())]


def twins(torch, seed=0):
    rng = np.random.default_rng(seed)
    ours = randomize_vectors(nn.Transformer(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=2,
                                            dim_feedforward=FF, dropout=0.0), rng).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
        theirs = interop.to_torch(ours)
    inputs = [rng.standard_normal((B, S, D)), rng.standard_normal((B, T, D))]
    upstream = rng.standard_normal((B, T, D))
    return ours, theirs, inputs, upstream


def array(t):
    if t is None:
        return None
    return t.detach().numpy().copy() if not isinstance(t, Tensor) else t.numpy().copy()


def tensors(lib, torch, values, requires_grad=False):
    if lib == "torch":
        return [torch.tensor(v, requires_grad=requires_grad) for v in values]
    return [Tensor(v, requires_grad=requires_grad) for v in values]


def watch(lib, torch, model, seen, replace=None):
    """Hooks of every kind on the WATCHED modules, recording into `seen` {key: array}; a tensor hook
    on each one's output (an intermediate activation) and on two parameters. replace: {key: fn}
    returning what the hook of that key returns."""
    replace = replace or {}
    modules = dict(model.named_modules())
    handles = []
    for name in WATCHED:
        m = modules[name]

        def pre(module, args, name=name):
            seen[f"{name} forward pre args[0]"] = array(args[0])

        def forward(module, args, output, name=name):
            seen[f"{name} args"] = [array(a) for a in args]
            first = output[0] if isinstance(output, tuple) else output  # attention: (attn_output, None)
            if isinstance(output, tuple):
                seen[f"{name} output[1:]"] = list(output[1:])
            seen[f"{name} output"] = array(first)
            first.register_hook(lambda g: seen.__setitem__(f"{name} output's gradient", array(g)))
            return replace.get(f"{name} output", lambda o: None)(output)

        def backward_pre(module, grad_output, name=name):
            seen[f"{name} grad_output"] = [array(g) for g in grad_output]
            return replace.get(f"{name} grad_output", lambda g: None)(grad_output)

        def backward(module, grad_input, grad_output, name=name):
            seen[f"{name} grad_input"] = [array(g) for g in grad_input]
            seen[f"{name} grad_output seen by the full backward hook"] = [array(g) for g in grad_output]
            return replace.get(f"{name} grad_input", lambda g: None)(grad_input)

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(forward),
                    m.register_full_backward_pre_hook(backward_pre), m.register_full_backward_hook(backward)]
    params = dict(model.named_parameters())
    for name in ("encoder.layers.0.linear1.weight", "decoder.layers.1.linear2.bias", "decoder.norm.weight"):
        def on_param(g, name=name):
            seen[f"{name} gradient"] = array(g)
            return replace.get(f"{name} gradient", lambda g: None)(g)
        handles.append(params[name].register_hook(on_param))
    return handles


def run(lib, torch, model, inputs, upstream, replace=None):
    seen = {}
    watch(lib, torch, model, seen, replace)
    src, tgt = tensors(lib, torch, inputs, requires_grad=True)
    out = model(src, tgt)
    out.backward(tensors(lib, torch, [upstream])[0])
    seen["src.grad"], seen["tgt.grad"] = array(src.grad), array(tgt.grad)
    for name, p in model.named_parameters():
        seen[f"{name}.grad"] = array(p.grad)
    return seen


def assert_same(theirs, ours):
    assert sorted(theirs) == sorted(ours), set(theirs) ^ set(ours)
    for key in theirs:
        a, b = theirs[key], ours[key]
        for x, y in zip(a, b) if isinstance(a, list) else [(a, b)]:
            assert (x is None) == (y is None), key
            if x is not None:
                np.testing.assert_allclose(y, x, rtol=1e-12, atol=1e-14 * max(1.0, np.abs(x).max()), err_msg=key)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_every_hook_on_a_two_layer_transformer_sees_what_torchs_sees(torch, mode):
    """Every hook on every module that torch calls (the layers, self_attn, multihead_attn, linear1,
    the dropouts (p=0), the norms, linear2, the stacks): the same args (a layer's (src,) or (tgt,
    memory), attention's (query, key, value)), outputs ((attn_output, None) for attention),
    grad_output and grad_input as torch's, in training and eval mode."""
    ours, theirs, inputs, upstream = twins(torch)
    if mode == "eval":
        ours.eval(), theirs.eval()
    expected, got = run("torch", torch, theirs, inputs, upstream), run("ours", torch, ours, inputs, upstream)
    assert len(got) > 350
    assert_same(expected, got)
    assert got["encoder.layers.1.self_attn output[1:]"] == [None] and len(got["decoder.layers.0 args"]) == 2
    assert [len(got[f"decoder.layers.0.{name} grad_input"]) for name in ("self_attn", "multihead_attn")] == [3, 3]


def plain_run(model, inputs, upstream, hooked=(), backward=True):
    """(output, src.grad, tgt.grad, every parameter's grad) of `model` with a forward pre-hook and
    a forward hook (and, with backward, a backward pre-hook and a full backward hook) that return
    None on each module named in `hooked`."""
    modules = dict(model.named_modules())
    for name in hooked:
        modules[name].register_forward_pre_hook(lambda m, args: None)
        modules[name].register_forward_hook(lambda m, args, output: None)
        if backward:
            modules[name].register_full_backward_pre_hook(lambda m, grad_output: None)
            modules[name].register_full_backward_hook(lambda m, grad_input, grad_output: None)
    src, tgt = (Tensor(v, requires_grad=True) for v in inputs)
    out = model(src, tgt)
    out.backward(Tensor(upstream))
    return [out.numpy(), src.grad.numpy(), tgt.grad.numpy()] + [p.grad.numpy() for p in model.parameters()]


def test_hooks_that_return_none_change_no_output_or_gradient_bit_for_bit(torch):
    """Hooks of every kind that return None, on each module in turn and on all at once (the fused
    linear1 and dropout-add then run unfused, the layers and attention through their hooks): the
    output and every gradient exactly those of the model without hooks. The exception, as torch's:
    backward hooks on an attention module make its query, key and value three Tensors (grad_input
    has one gradient each), so self-attention projects them apart instead of in one packed product,
    and cross-attention its key and value: the same numbers to rounding."""
    ours, _, inputs, upstream = twins(torch)
    plain = plain_run(copy.deepcopy(ours), inputs, upstream)
    attention = [name for name in WATCHED if name.endswith("attn")]
    for hooked, backward in [([name], True) for name in WATCHED if name not in attention] + \
            [(attention, False), ([name for name in WATCHED if name not in attention], True)]:
        got = plain_run(copy.deepcopy(ours), inputs, upstream, hooked, backward)
        for a, b in zip(plain, got):
            np.testing.assert_array_equal(b, a, err_msg=str(hooked))
    got = plain_run(copy.deepcopy(ours), inputs, upstream, WATCHED)
    for a, b in zip(plain, got):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-15)


def _fired(model, call):
    """{module name: the hook kinds that did not run} after `call()` with a forward hook and a full
    backward hook on every module of `model` (modules whose hooks all ran are left out)."""
    fired = {name: set() for name, _ in model.named_modules()}
    for name, m in model.named_modules():
        m.register_forward_hook(lambda module, args, output, name=name: fired[name].add("forward"))
        m.register_full_backward_hook(lambda module, grad_input, grad_output, name=name: fired[name].add("backward"))
    call()
    return {name: {"forward", "backward"} - kinds for name, kinds in fired.items() if kinds != {"forward", "backward"}}


def test_every_module_of_every_model_runs_its_hooks():
    """A forward hook and a full backward hook on every submodule of a two-layer nn.Transformer, a
    Seq2SeqTransformer (untied and tied generator), CausalLMs (GPT-style, tied; Llama-style: RMSNorm,
    SwiGLU, RoPE, grouped-query), a BERT-style BidirectionalEncoder and an EncoderClassifier, in
    training mode with dropout: one forward and backward pass runs every one of them, except the
    ModuleLists of layers, which nothing calls (as torch's; docs/hooks.md)."""
    from npformer import models
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 20, (2, 6))
    small = dict(d_model=8, nhead=2, dim_feedforward=12, dropout=0.1)
    transformer = nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **small)
    src = Tensor(rng.standard_normal((2, 5, 8)).astype(np.float32), requires_grad=True)
    tgt = Tensor(rng.standard_normal((2, 4, 8)).astype(np.float32))
    cases = [(transformer, lambda: transformer(src, tgt).sum().backward())]
    for tie in (False, True):
        seq2seq = models.Seq2SeqTransformer(20, 20, num_encoder_layers=2, num_decoder_layers=2, tie_weights=tie,
                                            positional="learned", **small)
        cases.append((seq2seq, lambda m=seq2seq: m(ids, ids).sum().backward()))
    for options in (dict(tie_weights=True), dict(activation="swiglu", positional="rope", norm="rmsnorm",
                                                 num_kv_heads=1, bias=False)):
        causal = models.CausalLM(20, num_layers=2, max_len=16, **small, **options)
        cases.append((causal, lambda m=causal: m(ids).sum().backward()))
    bert = models.BidirectionalEncoder(20, num_layers=2, pooler=True, type_vocab_size=2, embed_norm=True,
                                       pooling="first", **small)
    classifier = models.EncoderClassifier(20, 3, num_layers=2, pooler=True, positional="sinusoidal",
                                          classifier_dropout=0.1, **small)
    cases += [(bert, lambda: sum(x.sum() for x in bert(ids)).backward()),
              (classifier, lambda: classifier(ids).sum().backward())]
    for model, call in cases:
        model.train()
        missing = _fired(model, call)
        assert missing == {name: {"forward", "backward"} for name, m in model.named_modules()
                           if isinstance(m, nn.ModuleList)}, type(model).__name__
        assert len(list(model.modules())) > 25


def test_the_models_with_hooks_that_return_none_train_bit_for_bit_as_without():
    """A CausalLM (untied lm_head), a BERT-style classifier and a Seq2SeqTransformer in training
    mode with dropout, the same seed: with forward pre-hooks and forward hooks on every module but
    the Seq2SeqTransformer's transformer (a hooked one embeds tgt before the encoder runs, so the
    dropout masks come in another order: docs/hooks.md), and backward hooks on those but the
    attention modules (see the test above), the logits and every gradient are those without hooks,
    bit for bit: the dropout of a hooked residual dropout module draws what the fused dropout-add draws."""
    import npformer
    from npformer import models
    ids = np.random.default_rng(0).integers(1, 20, (2, 7))
    small = dict(d_model=8, nhead=2, dim_feedforward=12, dropout=0.2)
    builders = [lambda: models.CausalLM(20, num_layers=2, max_len=16, **small),
                lambda: models.EncoderClassifier(20, 3, num_layers=2, pooler=True, classifier_dropout=0.2, **small),
                lambda: models.Seq2SeqTransformer(20, 20, num_encoder_layers=2, num_decoder_layers=2, **small)]
    for build in builders:
        runs = []
        for hooked in (False, True):
            npformer.manual_seed(0)
            model = build().train()
            for name, m in model.named_modules() if hooked else ():
                if name == "transformer":
                    continue
                m.register_forward_pre_hook(lambda module, args: None)
                m.register_forward_hook(lambda module, args, output: None)
                if not isinstance(m, nn.MultiheadAttention):
                    m.register_full_backward_pre_hook(lambda module, grad_output: None)
                    m.register_full_backward_hook(lambda module, grad_input, grad_output: None)
            logits = model(ids, ids) if isinstance(model, models.Seq2SeqTransformer) else model(ids)
            (logits * logits).sum().backward()
            runs.append([logits.numpy()] + [p.grad.numpy() for p in model.parameters()])
        for a, b in zip(*runs):
            np.testing.assert_array_equal(b, a)


def _decoding_hooks(model, hooked, call):
    """(what `call(model)` returns, {module name: [(args, output)] of its forward hooks}) with a
    forward hook on every module of `model` when `hooked`."""
    seen = {}
    for name, m in model.named_modules() if hooked else ():
        m.register_forward_hook(lambda module, args, output, name=name: seen.setdefault(name, []).append((args, output)))
    return call(model), seen


def test_in_cached_decoding_the_layers_and_attention_run_their_hooks():
    """decode_step of a CausalLM (RoPE; a prompt, then one token at a time) and of a
    Seq2SeqTransformer (a beam-search reorder between steps) with a forward hook on every module:
    the logits are those without hooks, bit for bit, and every module runs its hooks but the
    models themselves and the nn.Transformer (decode_step is not their forward) and the
    ModuleLists; a layer's hooks see the new positions (x,), or (x, memory) in the decoder, with the
    memory's rows that the cache keeps; attention's (query, key, value), output (attn_output, None)."""
    import npformer
    from npformer import models
    ids = np.random.default_rng(0).integers(1, 20, (2, 5))
    small = dict(d_model=8, nhead=2, dim_feedforward=12, dropout=0.1)

    def causal_steps(model):
        cache = model.init_cache()
        return [model.decode_step(ids, cache).numpy()] + [model.decode_step(ids[:, t:t + 1], cache).numpy()
                                                          for t in range(2)]

    def seq2seq_steps(model):
        memory = model.encode(ids)
        cache = model.init_cache(memory)
        first = model.decode_step(ids[:, 0], cache).numpy()
        cache.reorder(np.array([1, 1]))
        return [first, model.decode_step(ids[:, 1], cache).numpy(), memory.numpy()]

    for build, steps, stacks in [
            (lambda: models.CausalLM(20, num_layers=2, max_len=16, positional="rope", **small), causal_steps, ""),
            (lambda: models.Seq2SeqTransformer(20, 20, num_encoder_layers=1, num_decoder_layers=2, **small),
             seq2seq_steps, "transformer.")]:
        runs = []
        for hooked in (False, True):
            npformer.manual_seed(0)
            model = build().eval()
            runs.append(_decoding_hooks(model, hooked, steps))
        for a, b in zip(runs[0][0], runs[1][0]):
            np.testing.assert_array_equal(b, a)
        seen = runs[1][1]
        silent = {"", "transformer", "transformer.encoder.layers", "transformer.decoder.layers"} if stacks else \
            {"", "encoder.layers"}
        assert set(dict(model.named_modules())) - set(seen) == silent
        attention = seen[f"{stacks}{'decoder' if stacks else 'encoder'}.layers.1.self_attn"]
        assert all(len(args) == 3 and args[0] is args[1] is args[2] and output[1] is None
                   for args, output in attention)
    layer_args = [args for args, _ in seen["transformer.decoder.layers.1"]]
    memory = runs[1][0][2]
    assert [len(args) for args in layer_args] == [2, 2]
    np.testing.assert_array_equal(layer_args[0][1].numpy(), memory)
    np.testing.assert_array_equal(layer_args[1][1].numpy(), memory[[1, 1]])   # the rows after the reorder
    cross = seen["transformer.decoder.layers.0.multihead_attn"]
    assert all(args[1] is args[2] and args[1].shape == memory[[1, 1]].shape for args, _ in cross)


def test_a_seq2seq_models_transformer_runs_its_hooks_with_the_same_output(torch):
    """Seq2SeqTransformer calls its nn.Transformer's encoder and decoder; with hooks on the
    Transformer itself it calls the Transformer (its hooks see the embedded src and tgt, as
    torch's would): the same logits and gradients, bit for bit (eval mode)."""
    from npformer import models
    ids = np.random.default_rng(0).integers(1, 20, (2, 6))
    model = models.Seq2SeqTransformer(20, 20, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                      dim_feedforward=12, pad_idx=0).eval()
    runs = []
    for hooked in (False, True):
        seen = []
        copied = copy.deepcopy(model)
        if hooked:
            copied.transformer.register_forward_hook(lambda m, args, output: seen.append([a.shape for a in args]))
        logits = copied(ids, ids)
        logits.sum().backward()
        runs.append([logits.numpy()] + [p.grad.numpy() for p in copied.parameters()])
        assert seen == ([[(2, 6, 8), (2, 6, 8)]] if hooked else [])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_replacing_hooks_change_the_gradients_as_torchs_do(torch):
    """A forward hook replacing an output, a backward pre-hook doubling grad_output, a full backward
    hook zeroing one grad_input and scaling another, a tensor hook on a parameter: every gradient,
    and what every other hook sees, as torch's."""
    replace = {
        "encoder.layers.0.norm2 output": lambda o: o * 0.5,
        "decoder.layers.0.norm3 grad_output": lambda g: tuple(x * 2.0 for x in g),
        "encoder.layers.1.linear2 grad_input": lambda g: tuple(x * 0.0 for x in g),
        "decoder.layers.1.norm1 grad_input": lambda g: tuple(x * 3.0 for x in g),
        "encoder.layers.0.linear1.weight gradient": lambda g: g * -1.0,
        "encoder.layers.1.self_attn output": lambda o: (o[0] * 0.5, o[1]),
        "decoder.layers.1 grad_input": lambda g: (g[0] * 2.0, g[1] * -1.0),
        "decoder.layers.0.multihead_attn grad_input": lambda g: (g[0], g[1] * 0.0, g[2] * 3.0),
        "encoder.layers.1.linear1 output": lambda o: o + 0.25,
        "decoder.layers.0.dropout2 grad_output": lambda g: tuple(x * 0.5 for x in g),
        "encoder.layers.0 output": lambda o: o * 1.5,
    }
    ours, theirs, inputs, upstream = twins(torch, seed=1)
    expected = run("torch", torch, theirs, inputs, upstream, replace)
    got = run("ours", torch, ours, inputs, upstream, replace)
    assert_same(expected, got)
    plain = run("ours", torch, twins(torch, seed=1)[0], inputs, upstream)
    assert not np.allclose(plain["src.grad"], got["src.grad"])  # (the replacements changed it)


def test_removed_hooks_are_not_called_and_a_model_without_hooks_is_unchanged(torch):
    ours, _, inputs, upstream = twins(torch)
    plain = {"src.grad": plain_run(copy.deepcopy(ours), inputs, upstream)[1]}  # the same model, never hooked
    seen = {}
    for handle in watch("ours", torch, ours, seen):
        handle.remove()
    for m in ours.modules():
        assert not m._module_hooks, m
    src, tgt = tensors("ours", torch, inputs, requires_grad=True)
    ours(src, tgt).backward(Tensor(upstream))
    assert seen == {}
    np.testing.assert_array_equal(src.grad.numpy(), plain["src.grad"])


def test_hook_order_prepend_and_what_pre_hooks_and_forward_hooks_return(torch):
    def run_on(lib):
        calls = []
        m = torch.nn.Linear(3, 2).double() if lib == "torch" else nn.Linear(3, 2).double()
        m.register_forward_pre_hook(lambda mod, args: calls.append("pre a") or (args[0] * 2.0,))
        m.register_forward_pre_hook(lambda mod, args: calls.append("pre b") or args[0] + 1.0)  # not a tuple
        m.register_forward_pre_hook(lambda mod, args: calls.append("pre first"), prepend=True)
        m.register_forward_pre_hook(
            lambda mod, args, kwargs: calls.append(f"kwargs {sorted(kwargs)}") or (args, kwargs), with_kwargs=True)
        m.register_forward_hook(lambda mod, args, out: calls.append("forward") or out * 3.0)
        m.register_forward_hook(
            lambda mod, args, kwargs, out: calls.append("forward with kwargs") or out + args[0].sum(), with_kwargs=True)
        m.register_forward_hook(lambda mod, args, out: calls.append("forward first"), prepend=True)
        m.register_full_backward_hook(lambda mod, gi, go: calls.append("backward"))
        m.register_full_backward_hook(lambda mod, gi, go: calls.append("backward first"), prepend=True)
        m.register_full_backward_pre_hook(lambda mod, go: calls.append("backward pre"))
        for p in m.parameters():
            p.data[...] = np.linspace(-1, 1, p.size).reshape(p.shape) if lib != "torch" else \
                torch.linspace(-1, 1, p.numel(), dtype=torch.float64).reshape(p.shape)
        x = tensors(lib, torch, [np.arange(6.0).reshape(2, 3)], requires_grad=True)[0]
        out = m(x)
        out.sum().backward()
        return calls, array(out), array(x.grad)

    (calls_t, out_t, grad_t), (calls_o, out_o, grad_o) = run_on("torch"), run_on("ours")
    assert calls_o == calls_t
    np.testing.assert_allclose(out_o, out_t, rtol=1e-12)
    np.testing.assert_allclose(grad_o, grad_t, rtol=1e-12)


def test_always_call_forward_hooks_run_when_forward_raises(torch):
    for lib in ("torch", "ours"):
        calls = []
        m = torch.nn.Linear(3, 2) if lib == "torch" else nn.Linear(3, 2)
        m.register_forward_hook(lambda mod, args, out: calls.append("not always"))
        m.register_forward_hook(lambda mod, args, out: calls.append(("always", out)), always_call=True)
        bad = torch.ones(2, 4) if lib == "torch" else Tensor(np.ones((2, 4), dtype=np.float32))
        with pytest.raises((RuntimeError, ValueError)):
            m(bad)
        assert calls == [("always", None)], (lib, calls)


def test_full_backward_hooks_get_none_for_inputs_without_grad_and_run_when_no_input_requires_grad(torch):
    # a module of two positional Tensor inputs, one without grad, and a non-Tensor argument
    class Scale(nn.Module):
        def forward(self, x, y, factor):
            return x * y * factor

    class TorchScale(torch.nn.Module):
        def forward(self, x, y, factor):
            return x * y * factor

    results = []
    for lib, m in (("torch", TorchScale()), ("ours", Scale())):
        seen = []
        record = lambda mod, gi, go: seen.append(([array(g) for g in gi], [array(g) for g in go]))  # noqa: E731
        m.register_full_backward_hook(record)
        x, = tensors(lib, torch, [np.array([1.0, 2.0])], requires_grad=True)
        y, = tensors(lib, torch, [np.array([3.0, -1.0])])
        m(x, y, 2.0).sum().backward()
        linear = torch.nn.Linear(2, 2).double() if lib == "torch" else nn.Linear(2, 2).double()
        linear.register_full_backward_hook(record)
        linear(y).sum().backward()  # no input requires grad (the weights do): grad_input is (None,)
        results.append(seen)
    theirs, ours = results
    assert len(theirs) == len(ours) == 2
    for (gi_t, go_t), (gi_o, go_o) in zip(theirs, ours):
        assert [g is None for g in gi_t] == [g is None for g in gi_o]
        for a, b in zip(gi_t + go_t, gi_o + go_o):
            if a is not None:
                np.testing.assert_allclose(b, a, rtol=1e-12)


def test_an_output_without_gradient_is_none_to_the_backward_hooks_and_forward_may_be_another_method(torch):
    """A module of two outputs, one unused: grad_output holds None for it, as torch's. And
    call_with_hooks(..., forward=...) runs the hooks around another method (for a parent that calls
    a child through one), with the args and output the hooks see as usual."""
    class Two(nn.Module):
        def forward(self, x):
            return x * 2.0, x * 3.0

    class TorchTwo(torch.nn.Module):
        def forward(self, x):
            return x * 2.0, x * 3.0

    results = []
    for lib, m in (("torch", TorchTwo()), ("ours", Two())):
        seen = []
        m.register_full_backward_pre_hook(lambda mod, go: seen.append(("pre", [array(g) for g in go])))
        m.register_full_backward_hook(lambda mod, gi, go: seen.append(("full", [array(g) for g in gi + go])))
        x, = tensors(lib, torch, [np.array([1.0, 2.0])], requires_grad=True)
        a, b = m(x)
        a.sum().backward()
        results.append(seen)
    assert [(k, [v is None for v in vs]) for k, vs in results[0]] == [(k, [v is None for v in vs]) for k, vs in results[1]]
    assert [k for k, _ in results[1]] == ["pre", "full"] and results[1][0][1][1] is None

    m, calls = nn.Linear(2, 2).double(), []
    m.register_forward_pre_hook(lambda mod, args: calls.append(("pre", args)))
    m.register_forward_hook(lambda mod, args, out: calls.append(("forward", out)) or out * 2.0)
    x = Tensor(np.ones((1, 2)))
    out = module_hooks.call_with_hooks(m, (x,), {}, forward=lambda t: t * 5.0)
    assert [kind for kind, _ in calls] == ["pre", "forward"] and calls[0][1] == (x,)
    np.testing.assert_array_equal(out.numpy(), np.full((1, 2), 10.0))


def test_under_create_graph_what_a_backward_hook_returns_is_differentiated(torch):
    """A full backward hook that multiplies grad_input by the input (a function of it): the first
    gradient, and the gradient of its squared sum (double backward), as torch's."""
    ours, theirs, inputs, upstream = twins(torch, seed=2)
    results = []
    for lib, model in (("torch", theirs), ("ours", ours)):
        src, tgt = tensors(lib, torch, inputs, requires_grad=True)
        layer = dict(model.named_modules())["encoder.layers.1.norm1"]
        layer.register_full_backward_hook(lambda mod, gi, go: tuple(g * g for g in gi))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # (twice differentiable)
            out = model(src, tgt)
        grad = (torch.autograd.grad if lib == "torch" else autograd.grad)
        gsrc, = grad((out * out).sum(), [src], create_graph=True)
        ggsrc, = grad((gsrc * gsrc).sum(), [src])
        results.append([array(gsrc), array(ggsrc)])
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-11, atol=1e-13 * np.abs(a).max())


def test_in_forward_mode_backward_hooks_see_gradients_that_carry_tangents():
    """Forward over reverse inside a dual level: grad_input and grad_output seen by a full backward
    hook, and the gradient that its replacement (grad_input * 2) changes, carry their tangents,
    equal to central differences of the same (torch's module backward hooks have no forward-mode
    rule; its reverse over reverse runs the hook again in the second pass, as ours)."""
    rng = np.random.default_rng(3)
    x0, u = rng.standard_normal((2, 4)), rng.standard_normal((2, 4))
    m = nn.Linear(4, 3).double()
    m.weight.data[...], m.bias.data[...] = rng.standard_normal((3, 4)), rng.standard_normal(3)
    seen = []
    m.register_full_backward_hook(lambda mod, gi, go: seen.append(gi + go) or tuple(g * 2.0 for g in gi))

    def gradient(x):
        y = m(x)
        return autograd.grad((y * y * y).sum(), [x])[0]

    with fwAD.dual_level():
        g = gradient(fwAD.make_dual(Tensor(x0, requires_grad=True), u))
        tangents = [fwAD.unpack_dual(t).tangent for t in seen[0]] + [fwAD.unpack_dual(g).tangent]
    eps, plain = 1e-6, []
    for sign in (1.0, -1.0):
        seen.clear()
        g = gradient(Tensor(x0 + sign * eps * u, requires_grad=True))
        plain.append([t.numpy() for t in seen[0]] + [g.numpy()])
    for tangent, plus, minus in zip(tangents, *plain):
        np.testing.assert_allclose(tangent, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-8)


# -- errors --------------------------------------------------------------------------------------------------
def test_bad_hooks_and_bad_returns_give_clear_errors():
    m = nn.Linear(3, 2).double()
    for register in (m.register_forward_pre_hook, m.register_forward_hook, m.register_full_backward_pre_hook,
                     m.register_full_backward_hook):
        with pytest.raises(TypeError, match="hook must be callable, got int"):
            register(3)
    with pytest.raises(TypeError, match="prepend"):
        m.register_forward_hook(print, prepend="yes")
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    handle = m.register_forward_pre_hook(lambda mod, args, kwargs: args, with_kwargs=True)
    with pytest.raises(RuntimeError, match=r"must return None or a tuple \(new_args, new_kwargs\), got tuple"):
        m(x)
    handle.remove()
    handle = m.register_full_backward_hook(lambda mod, gi, go: (gi[0], gi[0]))
    with pytest.raises(RuntimeError, match="invalid grad_input: expected None or a tuple of 1"):
        m(x).sum().backward()
    handle.remove()
    handle = m.register_full_backward_pre_hook(lambda mod, go: (Tensor(np.ones((5,))),))
    with pytest.raises(RuntimeError, match=r"grad_output\[0\] of shape \(5,\).*expected shape \(2, 2\)"):
        m(x).sum().backward()
    handle.remove()
    handle = m.register_full_backward_hook(lambda mod, gi, go: (3.0,))
    with pytest.raises(TypeError, match=r"grad_input\[0\] of type float: expected a Tensor or None"):
        m(x).sum().backward()


def test_tensor_and_module_hooks_on_every_backend(device):
    """The same hooks on each backend ("test" is numpy presented as another device, with CuPy's
    API): what they see and the gradients equal the CPU's; a replacement on another device than
    the tensor's is refused."""
    def run(on):
        rng = np.random.default_rng(5)
        m = nn.Linear(3, 2).double()
        m.weight.data[...], m.bias.data[...] = rng.standard_normal((2, 3)), rng.standard_normal(2)
        m.to(on)
        seen = []
        m.register_full_backward_hook(lambda mod, gi, go: seen.append(gi[0].numpy()) or (gi[0] * 3.0,))
        m.register_full_backward_pre_hook(lambda mod, go: seen.append(go[0].numpy()))
        m.weight.register_hook(lambda g: seen.append(g.numpy()) or g * 0.5)
        x = Tensor(rng.standard_normal((4, 3)), requires_grad=True, device=on)
        y = m(x)
        y.register_hook(lambda g: g + 1.0)
        (y * y).sum().backward()
        return seen + [x.grad.numpy(), m.weight.grad.numpy()]

    for a, b in zip(run("cpu"), run(device)):
        np.testing.assert_allclose(b, a, rtol=1e-12)
    if device != "cpu":
        x = Tensor(np.ones(2), requires_grad=True, device=device)
        x.register_hook(lambda g: Tensor(np.ones(2)))
        with pytest.raises(RuntimeError, match=f"on 'cpu': expected shape \\(2,\\), dtype float64 on '{device}'"):
            (x * 2.0).sum().backward()


def test_a_cuda_graph_replay_runs_no_hook_as_torchs():
    """npformer.cuda.graphed (here on the "test" device, its emulation) replays a captured step
    without its Python, as torch's CUDA graphs: hooks run in the warm-up call and the capture only."""
    import npformer
    from autograd import backend
    from npformer import optim
    m = nn.Linear(3, 2).to("test")
    opt = optim.Adam(m.parameters(), lr=0.01)
    calls = []
    m.weight.register_hook(lambda g: calls.append("tensor hook"))
    m.register_forward_hook(lambda mod, args, out: calls.append("forward hook"))

    def step(x):
        loss = (m(Tensor(x)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    graphed = npformer.cuda.graphed(step, device="test")
    for _ in range(4):
        graphed(backend.to_device(np.ones((4, 3), np.float32), "test"))
    assert calls == ["forward hook", "tensor hook"] * 2


def test_the_example_of_docs_hooks_md_runs():
    import pathlib
    import re
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/hooks.md", "exec"), {})
