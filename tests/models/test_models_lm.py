"""CausalLM (GPT-style) and EncoderClassifier (BERT-style): parity with the equivalent torch
composition (torch.nn.TransformerEncoder + embeddings + head, our weights) forward and for
every parameter's gradient, causality, padding handling, gradcheck, devices, errors."""
import numpy as np
import pytest

import autograd
import npformer.functional as F
from autograd import Tensor, backend
from npformer import interop
from npformer.models import CausalLM, EncoderClassifier

from helpers import PAD, padded_batch
from tolerances import scaled

SMALL = dict(d_model=8, nhead=2, num_layers=2, dim_feedforward=12, dropout=0.0)


def assert_parity(torch, model, ids, loss_fn, torch_loss_fn, atol=1e-10, rtol=0.0):
    theirs = interop.to_torch(model)
    out, ref = model(ids), theirs(torch.tensor(ids))
    atol = scaled(atol, *model.parameters())         # atol is set at unit scale
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol, err_msg="logits")
    loss_fn(out).backward()
    torch_loss_fn(ref).backward()
    named = dict(theirs.named_parameters())
    assert set(named) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), named[name].grad.numpy(), atol=atol, rtol=rtol,
                                   err_msg=f"gradient of {name}")


LM_CONFIGS = [dict(norm_first=True, activation="gelu", positional="learned", tie_weights=False),
              dict(norm_first=False, activation="relu", positional="sinusoidal", tie_weights=True),
              dict(norm_first=True, activation="relu", positional="none", tie_weights=True)]


@pytest.mark.parametrize("options", LM_CONFIGS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_causal_lm_matches_torch(options, torch, rng):
    model = CausalLM(13, pad_idx=PAD, max_len=16, **SMALL, **options).double()
    ids = padded_batch(rng, 13, [6, 4], 6)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    assert_parity(torch, model, inputs,
                  lambda o: F.cross_entropy(o.reshape(-1, 13), labels.reshape(-1), ignore_index=PAD),
                  lambda o: torch.nn.functional.cross_entropy(o.reshape(-1, 13), torch.tensor(labels).reshape(-1),
                                                              ignore_index=PAD))


def test_causal_lm_float32_matches_torch(torch, rng):
    model = CausalLM(30, d_model=64, nhead=4, num_layers=1, dim_feedforward=128, dropout=0.0, max_len=8)
    ids = rng.integers(0, 30, size=(2, 7))
    g = rng.standard_normal((2, 7, 30)).astype("float32")
    assert_parity(torch, model, ids, lambda o: (o * Tensor(g)).sum(), lambda o: (o * torch.tensor(g)).sum(),
                  atol=1e-5, rtol=1e-4)


def test_causal_lm_is_causal(rng):
    model = CausalLM(11, max_len=8, **SMALL).double()
    ids = rng.integers(1, 11, size=(1, 6))
    changed = ids.copy()
    changed[0, 4] = (ids[0, 4] % 10) + 1  # a different token at position 4
    a, b = model(ids).numpy(), model(changed).numpy()
    np.testing.assert_array_equal(a[0, :4], b[0, :4])  # earlier positions cannot see it
    assert not np.allclose(a[0, 4:], b[0, 4:])


def test_causal_lm_rope_gradcheck_and_keys(rng):
    model = CausalLM(7, d_model=4, nhead=2, num_layers=1, dim_feedforward=4, dropout=0.0, positional="rope")
    assert [k for k in model.state_dict() if not k.startswith("encoder.")] == ["tok_embed.weight", "lm_head.weight"]
    model.double()
    ids = rng.integers(0, 7, size=(2, 3))
    g = rng.standard_normal((2, 3, 7))
    autograd.gradcheck(lambda *params: model(ids) * Tensor(g), list(model.parameters()))
    with pytest.raises(NotImplementedError, match="RoPE"):
        interop.to_torch(model)


@pytest.mark.parametrize("pooling", ["mean", "first"])
@pytest.mark.parametrize("norm_first, positional", [(False, "learned"), (True, "sinusoidal")])
def test_encoder_classifier_matches_torch(pooling, norm_first, positional, torch, rng):
    model = EncoderClassifier(13, 3, pooling=pooling, norm_first=norm_first, positional=positional, pad_idx=PAD,
                              max_len=8, **SMALL).double()
    ids = padded_batch(rng, 13, [6, 3, 4], 6)
    labels = np.array([0, 2, 1])
    assert_parity(torch, model, ids, lambda o: F.cross_entropy(o, labels, label_smoothing=0.1),
                  lambda o: torch.nn.functional.cross_entropy(o, torch.tensor(labels), label_smoothing=0.1))


def test_mean_pooling_ignores_padding(rng):
    model = EncoderClassifier(9, 4, pad_idx=PAD, max_len=8, **SMALL).double()
    ids = padded_batch(rng, 9, [6, 2], 6)
    np.testing.assert_allclose(model(ids).numpy()[1], model(ids[1:, :2]).numpy()[0], atol=1e-12)
    all_padding = np.zeros((1, 3), dtype=int)
    assert np.isfinite(model(all_padding).numpy()).all()  # nothing to pool: zeros, not NaN


def test_runs_on_device(device, rng):
    for model in (CausalLM(9, max_len=8, **SMALL), EncoderClassifier(9, 2, max_len=8, pad_idx=PAD, **SMALL)):
        model.to(device)
        out = model(padded_batch(rng, 9, [5, 3], 5))
        assert out.device == device
        out.sum().backward()
        assert all(p.grad.device == device for p in model.parameters())


def test_errors():
    with pytest.raises(ValueError, match="pooling must be one of"):
        EncoderClassifier(9, 2, pooling="max", **SMALL)
    with pytest.raises(ValueError, match="activation must be one of"):
        CausalLM(9, activation="swish", **SMALL)
    with pytest.raises(ValueError, match="d_model=8 is not divisible by nhead=3"):
        CausalLM(9, **dict(SMALL, nhead=3))
    with pytest.raises(TypeError, match="CausalLM: tie_weights must be True or False, got 'no'"):
        CausalLM(9, tie_weights="no", **SMALL)
    for flag in ("embed_norm", "final_norm", "pooler"):  # bool("no") would be True
        with pytest.raises(TypeError, match=f"EncoderClassifier: {flag} must be True or False, got 'no'"):
            EncoderClassifier(9, 2, **{flag: "no"}, **SMALL)
    # classifier_dropout=None: the hidden dropout, as Hugging Face's BertForSequenceClassification
    classifier = EncoderClassifier(9, 2, **dict(SMALL, dropout=0.3), classifier_dropout=None)
    assert classifier.config["classifier_dropout"] == 0.3 and classifier.head_dropout.p == 0.3
    assert EncoderClassifier(**classifier.config).head_dropout.p == 0.3
    numpy_flags = CausalLM(9, tie_weights=np.bool_(True), norm_first=np.bool_(False), **SMALL).config
    assert numpy_flags["tie_weights"] is True and numpy_flags["norm_first"] is False  # plain bools: JSON-ready
    model = CausalLM(9, max_len=4, **SMALL)
    with pytest.raises(ValueError, match="max_len=4"):
        model(np.ones((1, 5), dtype=int))
    with pytest.raises(ValueError, match=r"input_ids must be a non-empty \(batch, seq\) array"):
        model(np.ones(3, dtype=int))
