"""Named hook points (npformer.nn.hook_points): every name docs/hook_points.md lists is the
model's, with the documented shapes; run_with_cache's activations and gradients are those of the
model's own graph (retain_grad, record_attention, finite differences through a patching hook);
outputs and parameter gradients are unchanged bit for bit; run_with_hooks patches and its
backward hooks replace gradients; hooks come off after the call; bad names say the close ones."""
import pathlib
import re

import numpy as np
import pytest

import npformer
from autograd import Tensor
from npformer import nn
from npformer.models import BidirectionalEncoder, CausalLM, EncoderClassifier, Seq2SeqTransformer
from npformer.nn.hook_points import HookPoint, hook_point_names, hook_points

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "hook_points.md").read_text()
V, E, FF = 13, 8, 12
IDS = np.array([[3, 5, 7, 2, 9, 4], [6, 1, 8, 11, 2, 0]])            # pad_idx 0: the second row's last


def seq2seq():
    return Seq2SeqTransformer(V, V, d_model=E, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                              dim_feedforward=FF, dropout=0.1, pad_idx=0).double()


def causal():
    return CausalLM(V, d_model=E, nhead=2, num_layers=2, dim_feedforward=FF, max_len=16, dropout=0.1,
                    pad_idx=0).double()


def causal_rope_gqa():
    """Rotary, grouped-query (4 query heads, 2 kv heads), gated feed-forward (pre-LN)."""
    return CausalLM(V, d_model=E, nhead=4, num_kv_heads=2, num_layers=2, dim_feedforward=FF, max_len=16,
                    dropout=0.1, pad_idx=0, positional="rope", activation="swiglu").double()


def bert():
    return BidirectionalEncoder(V, d_model=E, nhead=2, num_layers=2, dim_feedforward=FF, max_len=16, dropout=0.1,
                                pad_idx=0, pooling="first", pooler=True, type_vocab_size=2, embed_norm=True,
                                final_norm=False, layer_norm_eps=1e-12).double()


def bert_classifier():
    return EncoderClassifier(V, 3, d_model=E, nhead=2, num_layers=2, dim_feedforward=FF, max_len=16, dropout=0.1,
                             pad_idx=0, embed_norm=True, final_norm=False).double()


# kind: (builder, inputs, docs section, the `when` options it has)
MODELS = {"seq2seq": (seq2seq, (IDS, IDS[:, :5]), "Seq2SeqTransformer", ()),
          "causal": (causal, (IDS,), "CausalLM", ()),
          "causal_rope_gqa": (causal_rope_gqa, (IDS,), "CausalLM", ("swiglu",)),
          "bert": (bert, (IDS,), "BERT", ("embed_norm",)),
          "bert_classifier": (bert_classifier, (IDS,), "BERT", ("embed_norm",)),
          "encoder_final_norm": (lambda: BidirectionalEncoder(V, d_model=E, nhead=2, num_layers=1, dim_feedforward=FF,
                                                              max_len=16).double(), (IDS,), "BERT", ("final_norm",))}


def build(kind, seed=0):
    npformer.manual_seed(seed)
    return MODELS[kind][0]()


def loss_of(output, seed=1):
    """A random linear function of the output (a tuple's parts summed): every entry matters."""
    rng = np.random.default_rng(seed)
    parts = output if isinstance(output, tuple) else (output,)
    return sum((p * Tensor(rng.standard_normal(p.shape))).sum() for p in parts)


def documented(section):
    """{name pattern: (shape, when)} of a section of docs/hook_points.md."""
    text = DOC.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]*) \|", text, re.M)
    assert len({name for name, _, _ in rows}) == len(rows), f"{section}: a name is listed twice"
    return {name: (shape.strip(), when.strip()) for name, shape, when in rows}


def pattern(name):
    return re.sub(r"\.layers\.\d+\.", ".layers.{i}.", name)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_documented_names_and_shapes_are_the_models(kind):
    _, inputs, section, options = MODELS[kind]
    model = build(kind).eval()
    names = hook_point_names(model)
    assert names == model.hook_point_names() and len(set(names)) == len(names)
    docs = {name: shape for name, (shape, when) in documented(section).items() if not when or when in options}
    assert {pattern(n) for n in names} == set(docs)
    _, cache = model.run_with_cache(*inputs)
    assert set(cache) == set(names)                   # every hook point ran, and only they are cached
    layer = model.transformer.encoder.layers[0] if kind == "seq2seq" else model.encoder.layers[0]
    attn = layer.self_attn
    T = inputs[-1].shape[1]
    symbols = dict(B=2, T=T, S_src=inputs[0].shape[1], E=E, H=attn.num_heads, H_kv=attn.num_kv_heads,
                   hd=attn.head_dim, F=FF)
    for name in names:
        expected = tuple(symbols[s.strip()] for s in docs[pattern(name)].strip("()").split(","))
        assert cache[name].shape == expected, (name, cache[name].shape, docs[pattern(name)])


@pytest.mark.parametrize("kind", ["seq2seq", "causal_rope_gqa", "bert"])
def test_outputs_and_parameter_gradients_are_unchanged_bit_for_bit(kind):
    """In train mode (dropout in attention, residuals and embeddings): the cache runs the attention
    as separate ops, with the fused op's dropout masks. With grouped-query attention the kv heads'
    gradients sum over their groups in another order: parameter gradients within rounding."""
    _, inputs, _, _ = MODELS[kind]

    def run(cached):
        model = build(kind).train()
        npformer.manual_seed(7)
        if cached:
            output, cache = model.run_with_cache(*inputs, loss_fn=loss_of)
            assert len(cache) == len(model.hook_point_names())
        else:
            output = model(*inputs)
            loss_of(output).backward()
        parts = output if isinstance(output, tuple) else (output,)
        return [p.numpy() for p in parts], [p.grad.numpy() for p in model.parameters() if p.grad is not None]

    (outputs, grads), (cached_outputs, cached_grads) = run(False), run(True)
    for plain, cached in zip(outputs, cached_outputs, strict=True):
        assert np.array_equal(plain, cached)
    for plain, cached in zip(grads, cached_grads, strict=True):
        if kind == "causal_rope_gqa":
            np.testing.assert_allclose(cached, plain, rtol=1e-13, atol=1e-15 * np.abs(plain).max())
        else:
            assert np.array_equal(plain, cached)


@pytest.mark.parametrize("kind", ["seq2seq", "causal_rope_gqa", "bert"])
def test_every_cached_gradient_equals_finite_differences_through_a_patching_hook(kind, rng):
    """d/de L(activation + e U) at e = 0 against <cache.grad(name), U>, for every name: the
    gradient is that of the intermediate the model uses (a patched activation flows downstream)."""
    _, inputs, _, _ = MODELS[kind]
    model = build(kind).eval()
    _, cache = model.run_with_cache(*inputs, loss_fn=loss_of)
    eps = 1e-6
    for name in cache:
        grad = cache.grad(name)
        assert grad is not None and grad.shape == cache[name].shape, name
        U = rng.standard_normal(grad.shape)

        def loss(e):
            out = model.run_with_hooks(*inputs, fwd_hooks=[(name, lambda x, hook: x + Tensor(e * U))])
            return loss_of(out).item()
        numeric = (loss(eps) - loss(-eps)) / (2 * eps)
        analytic = float(np.sum(np.where(np.isfinite(grad.numpy()), grad.numpy(), 0) * U))
        assert abs(numeric - analytic) <= 1e-6 * (1 + abs(analytic)), (name, numeric, analytic)


def test_cached_gradients_equal_retain_grad_and_record_attention():
    """CausalLM run layer by layer with retain_grad on each layer's output, and record_attention's
    P and dL/dP: the cache's resid_post and pattern, and their gradients, are the same."""
    model = build("causal").train()
    npformer.manual_seed(3)
    _, cache = model.run_with_cache(IDS, loss_fn=loss_of)

    model.zero_grad()
    npformer.manual_seed(3)
    with nn.record_attention(model) as recorder:
        first = model.encoder.layers[0]
        x = model.embed(IDS)
        mask = first.self_attn_mask(x, None, IDS == 0, True)
        outputs = []
        for layer in model.encoder.layers:
            x = layer.forward_masked(x, mask).retain_grad()
            outputs.append(x)
        loss_of(model.project(model.encoder.norm(x))).backward()
    for i, (x, record) in enumerate(zip(outputs, recorder, strict=True)):
        name = f"encoder.layers.{i}"
        np.testing.assert_allclose(cache[f"{name}.hook_resid_post"].numpy(), x.numpy(), rtol=0, atol=1e-14)
        np.testing.assert_allclose(cache.grad(f"{name}.hook_resid_post").numpy(), x.grad.numpy(), rtol=0, atol=1e-13)
        assert record.name == f"{name}.self_attn"
        np.testing.assert_allclose(cache[f"{name}.self_attn.hook_pattern"].numpy(), record.weights.numpy(),
                                   rtol=0, atol=1e-15)
        np.testing.assert_allclose(cache[f"{name}.self_attn.hook_pattern_grad"].numpy(), record.grad,
                                   rtol=0, atol=1e-13)


def test_the_scores_gradient_is_p_times_dp_minus_its_row_sum():
    """dS = P (dP - sum_k P dP) between the cached scores' and pattern's gradients, for every
    attention of the encoder-decoder (encoder self, decoder self, cross), in train mode."""
    model = build("seq2seq").train()
    npformer.manual_seed(5)
    _, cache = model.run_with_cache(IDS, IDS[:, :5], names_filter=lambda n: n.endswith(("scores", "pattern")),
                                    loss_fn=loss_of)
    modules = sorted({name.rsplit(".", 1)[0] for name in cache})
    assert len(modules) == 6
    for module in modules:
        P, dP = cache[f"{module}.hook_pattern"].numpy(), cache.grad(f"{module}.hook_pattern").numpy()
        dS = cache.grad(f"{module}.hook_attn_scores").numpy()
        np.testing.assert_allclose(dS, P * (dP - (P * dP).sum(-1, keepdims=True)), rtol=0, atol=1e-14)
        assert np.abs(dS).max() > 1e-6
    hidden = np.isinf(cache["transformer.decoder.layers.0.self_attn.hook_attn_scores"].numpy())
    assert hidden[:, :, 0, 1:].all() and not hidden[:, :, -1].any()        # causal: the future is -inf


def test_patching_one_heads_output_changes_the_logits_as_computed_by_hand():
    """A one-layer pre-LN CausalLM: head 0 of hook_z from run A put into run B; the logits equal
    out_proj, the residual, the feed-forward and the final norm applied by hand to the patched z."""
    npformer.manual_seed(0)
    model = CausalLM(V, d_model=E, nhead=2, num_layers=1, dim_feedforward=FF, max_len=16).double().eval()
    ids_a, ids_b = IDS, IDS[:, ::-1].copy()
    name = "encoder.layers.0.self_attn.hook_z"
    _, cache_a = model.run_with_cache(ids_a, names_filter=name)
    logits_b, cache_b = model.run_with_cache(ids_b, names_filter=[name, "encoder.layers.0.hook_resid_pre"])

    def patch(z, hook):
        assert hook.name == name
        patched = z.numpy().copy()
        patched[:, 0] = cache_a[name].numpy()[:, 0]
        return Tensor(patched)
    patched_logits = model.run_with_hooks(ids_b, fwd_hooks=[(name, patch)])

    layer = model.encoder.layers[0]
    z = cache_b[name].numpy().copy()
    z[:, 0] = cache_a[name].numpy()[:, 0]
    joined = Tensor(z.transpose(0, 2, 1, 3).reshape(2, 6, E))                 # heads joined (B, T, E)
    resid_mid = cache_b["encoder.layers.0.hook_resid_pre"] + layer.self_attn.out_proj(joined)
    resid_post = resid_mid + layer._ff_block(layer.norm2(resid_mid))
    by_hand = model.project(model.encoder.norm(resid_post))
    np.testing.assert_allclose(patched_logits.numpy(), by_hand.numpy(), rtol=0, atol=1e-12)
    assert np.abs(patched_logits.numpy() - logits_b.numpy()).max() > 1e-3
    unchanged = model.run_with_hooks(ids_b, fwd_hooks=[(name, lambda z, hook: None)])
    assert np.array_equal(unchanged.numpy(), logits_b.numpy())


def test_backward_hooks_see_the_gradient_and_may_replace_it():
    name = "encoder.norm.hook_normalized"
    model = build("causal").eval()
    _, cache = model.run_with_cache(IDS, loss_fn=loss_of)
    plain = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    seen = []
    model.zero_grad()
    model.run_with_hooks(IDS, bwd_hooks=[(name, lambda g, hook: seen.append(g.numpy()))], loss_fn=loss_of)
    (grad,) = seen
    assert np.array_equal(grad, cache.grad(name).numpy())

    model.zero_grad()
    output = model.run_with_hooks(IDS, bwd_hooks=[(name, lambda g, hook: g * 2.0)])
    assert not any(point.active for point in model.hook_points().values())   # reset before the backward pass
    loss_of(output).backward()                                               # the hook bound to the graph runs
    for n, p in model.named_parameters():
        expected = plain[n] if n == "lm_head.weight" else 2 * plain[n]       # lm_head is past the hook point
        np.testing.assert_allclose(p.grad.numpy(), expected, rtol=1e-12, atol=1e-15)


def test_hooks_come_off_after_each_call_even_when_a_hook_raises():
    model = build("seq2seq")

    def everything_off():
        points = model.hook_points().values()
        owners = {id(p.owner): p.owner for p in points}.values()
        return not any(p.active for p in points) and not any(o.hooks_active for o in owners)
    model.run_with_cache(IDS, IDS[:, :5], loss_fn=loss_of)
    assert everything_off()
    model.run_with_hooks(IDS, IDS[:, :5], fwd_hooks=[(lambda n: "pattern" in n, lambda x, hook: None)],
                         bwd_hooks=[("transformer.decoder.norm.hook_normalized", lambda g, hook: None)])
    assert everything_off()

    def fails(x, hook):
        raise RuntimeError("a hook that fails")
    with pytest.raises(RuntimeError, match="a hook that fails"):
        model.run_with_hooks(IDS, IDS[:, :5], fwd_hooks=[("transformer.encoder.layers.1.hook_mlp_post", fails)])
    assert everything_off()
    handles = model.add_hook("transformer.encoder.layers.1.self_attn.hook_pattern", lambda x, hook: None)
    assert model.transformer.encoder.layers[1].self_attn.hooks_active
    model.run_with_hooks(IDS, IDS[:, :5], reset_hooks_end=True)
    assert model.transformer.encoder.layers[1].self_attn.hooks_active    # hooks added outside the call stay
    handles[0].remove()
    assert everything_off()
    model.add_hook(lambda n: n.endswith("hook_z"), lambda x, hook: None, dir="bwd")
    model.reset_hooks()
    assert everything_off()


def test_with_no_hook_no_hook_point_runs_and_attention_stays_fused(monkeypatch):
    model = build("seq2seq")
    npformer.manual_seed(2)
    reference = model(IDS, IDS[:, :5]).numpy()

    def refuse(*args, **kwargs):
        raise AssertionError("called without a hook")
    monkeypatch.setattr(HookPoint, "forward", refuse)
    monkeypatch.setattr(nn.MultiheadAttention, "attention_scores", refuse)
    npformer.manual_seed(2)
    assert np.array_equal(model(IDS, IDS[:, :5]).numpy(), reference)
    monkeypatch.undo()
    monkeypatch.setattr(nn.MultiheadAttention, "attention_scores", refuse)  # only hook_z: the fused op still
    _, cache = model.run_with_cache(IDS, IDS[:, :5], names_filter=lambda n: n.endswith("hook_z"))
    assert len(cache) == 6


def test_bad_names_and_bad_hooks_give_clear_errors():
    model = build("causal")
    with pytest.raises(KeyError, match=r"encoder\.layers\.0\.self_attn\.hook_pattern"):
        model.run_with_hooks(IDS, fwd_hooks=[("encoder.layers.0.self_attn.hook_patern", lambda x, hook: None)])
    with pytest.raises(KeyError, match=r"close names: \['encoder\.layers\.1\.hook_resid_post'"):
        model.run_with_cache(IDS, names_filter=["encoder.layers.1.hook_resid_psot"])
    _, cache = model.run_with_cache(IDS, names_filter="encoder.layers.1.hook_resid_post")
    with pytest.raises(KeyError, match="close names"):
        cache["encoder.layers.1.hook_resid_pos"]
    with pytest.raises(RuntimeError, match="keeps no gradients"):
        cache.grad("encoder.layers.1.hook_resid_post")
    with pytest.raises(TypeError, match=r"\(name or filter, fn\) pairs"):
        model.run_with_hooks(IDS, fwd_hooks=["encoder.norm.hook_normalized"])
    with pytest.raises(ValueError, match=r"returned shape \(2, 6\); expected \(2, 6, 8\)"):
        model.run_with_hooks(IDS, fwd_hooks=[("encoder.norm.hook_normalized", lambda x, hook: x.sum(-1))])
    with pytest.raises(TypeError, match="returned ndarray; expected None or an autograd.Tensor"):
        model.run_with_hooks(IDS, fwd_hooks=[("encoder.norm.hook_normalized", lambda x, hook: x.numpy())])
    assert not any(p.active for p in model.hook_points().values())


def test_a_bare_attention_module_and_nn_transformer_have_hook_points(rng):
    mha = nn.MultiheadAttention(E, 2).double()
    assert hook_point_names(mha) == ["hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern",
                                     "hook_pattern_dropped", "hook_z"]
    q, m = Tensor(rng.standard_normal((2, 3, E))), Tensor(rng.standard_normal((2, 4, E)))
    seen = {}
    hook_points(mha)["hook_pattern"].add_hook(lambda p, hook: seen.setdefault("P", p))
    out, weights = mha(q, m, m, average_attn_weights=False)
    assert seen["P"].shape == (2, 2, 3, 4) and np.allclose(seen["P"].numpy().sum(-1), 1)
    np.testing.assert_allclose(weights.numpy(), seen["P"].numpy(), rtol=0, atol=0)   # eval-free: dropout 0
    transformer = nn.Transformer(E, 2, 1, 1, FF, dropout=0.0)
    assert "decoder.layers.0.multihead_attn.hook_pattern" in transformer.hook_point_names()
    assert transformer.state_dict().keys() == nn.Transformer(E, 2, 1, 1, FF).state_dict().keys()
    assert "hook" not in repr(transformer) and not any("hook" in n for n, _ in transformer.named_modules())


def test_a_backward_hook_on_a_leaf_input_runs_in_that_forward_passs_backward_only(rng):
    """nn.Transformer's first hook point sees the user's leaf src: the hook goes on a node of that
    graph, so the leaf keeps no hook for later passes."""
    transformer = nn.Transformer(E, 2, 1, 1, FF, dropout=0.0).double()
    src = Tensor(rng.standard_normal((2, 4, E)), requires_grad=True)
    tgt = Tensor(rng.standard_normal((2, 3, E)))
    seen = []
    out = transformer.run_with_hooks(src, tgt, bwd_hooks=[("encoder.layers.0.hook_resid_pre",
                                                           lambda g, hook: seen.append(g.numpy()))])
    out.sum().backward()
    assert len(seen) == 1 and np.array_equal(seen[0], src.grad.numpy())
    transformer(src, tgt).sum().backward()
    assert len(seen) == 1 and np.allclose(src.grad.numpy(), 2 * seen[0])


def test_record_attention_and_the_cache_share_the_pattern_node():
    """record_attention is a hook on hook_pattern: inside its block the cache's P is the record's
    Tensor and dL/dP is the same array."""
    model = build("causal").train()
    with nn.record_attention(model) as recorder:
        _, cache = model.run_with_cache(IDS, names_filter=lambda n: n.endswith("hook_pattern"), loss_fn=loss_of)
    assert recorder.names() == [name.rsplit(".", 1)[0] for name in cache]
    for record, name in zip(recorder, cache, strict=True):
        assert record.weights is cache[name] and np.array_equal(record.grad, cache.grad(name).numpy())
    assert not any(p.active for p in model.hook_points().values())


def test_the_cache_on_every_device(device):
    """The separate attention ops and the cache on each backend: the outputs those of the fused
    path (bit for bit on the host's numpy; within rounding on a GPU, whose kernels differ)."""
    model = build("seq2seq").train().to(device)
    npformer.manual_seed(4)
    plain = model(IDS, IDS[:, :5]).numpy()
    npformer.manual_seed(4)
    output, cache = model.run_with_cache(IDS, IDS[:, :5], loss_fn=lambda out: out.sum())
    if device == "cuda":
        np.testing.assert_allclose(output.numpy(), plain, rtol=1e-12, atol=1e-12)
    else:
        assert np.array_equal(output.numpy(), plain)
    name = "transformer.decoder.layers.1.multihead_attn.hook_pattern"
    assert cache[name].device == device and cache.grad(name).device == device
