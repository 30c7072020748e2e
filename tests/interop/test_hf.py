"""npformer.interop.from_hf / to_hf against Hugging Face transformers, on random-initialised
GPT-2 and BERT models built from small configs (nothing downloaded): the same logits (and
BERT's hidden states and pooled output) to 1e-5 in float32 and 1e-9 in float64, the same
gradient of a loss with a random upstream gradient for every parameter to 1e-8 in float64,
both relative to the magnitudes involved; round trips keep every number; every weight is
mapped, and what cannot be mapped is named."""
import numpy as np
import pytest

from autograd import Tensor
from npformer import interop, models
from npformer.models import huggingface

from helpers import gpt2_config, randomised

TOLERANCE = {"float32": 1e-5, "float64": 1e-9}
GRAD_TOLERANCE = 1e-8  # float64


def bert_config(transformers, **options):
    settings = dict(vocab_size=61, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=24, max_position_embeddings=16, type_vocab_size=3, num_labels=3)
    return transformers.BertConfig(**{**settings, **options})


def assert_close(ours, theirs, tolerance, what):
    """max |ours - theirs| <= tolerance * max(1, max |theirs|)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} vs {theirs.shape}"
    error, scale = np.abs(ours - theirs).max(), max(1.0, np.abs(theirs).max())
    assert error <= tolerance * scale, f"{what}: max |difference| {error:.3g} > {tolerance} * {scale:.3g}"


def batch(rng, lengths, width, vocab=61):
    """(ids (B, width) in [1, vocab) right-padded with 0, attention mask (B, width), 1 = token)."""
    ids = rng.integers(1, vocab, size=(len(lengths), width))
    attention = np.arange(width)[None, :] < np.array(lengths)[:, None]
    return np.where(attention, ids, 0), attention.astype(np.int64)


def assert_gradients_match(torch, ours, hf_model):
    """Every parameter's gradient (after backward on both sides), HF's mapped onto our names."""
    grads = {name: p.grad.numpy() for name, p in hf_model.named_parameters()}
    assert all(g is not None for g in grads.values())
    theirs, _ = huggingface.state_dict_from_hf(ours, grads)
    named = dict(ours.named_parameters())
    assert set(theirs) == set(named), "every parameter has a Hugging Face gradient"
    overall = max(np.abs(g).max() for g in theirs.values())
    for name, p in named.items():
        want = theirs[name]
        scale = max(np.abs(want).max(), 1e-4 * overall)
        error = np.abs(p.grad - want).max()
        assert error <= GRAD_TOLERANCE * scale, f"gradient of {name}: max |difference| {error:.3g} > " \
                                                f"{GRAD_TOLERANCE} * {scale:.3g}"


GPT2_VARIANTS = {"gpt2": {},
                 "untied-relu-inner": dict(tie_word_embeddings=False, activation_function="relu", n_inner=24),
                 "gelu-exact": dict(activation_function="gelu")}


@pytest.mark.parametrize("variant", list(GPT2_VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpt2_logits_match(variant, dtype, torch, transformers, rng):
    hf_model = randomised(torch, transformers.GPT2LMHeadModel(gpt2_config(transformers, **GPT2_VARIANTS[variant])),
                          dtype)
    ours = interop.from_hf(hf_model)
    assert isinstance(ours, models.CausalLM) and not ours.training
    assert ours.tok_embed.weight.dtype == np.dtype(dtype)
    ids, attention = batch(rng, [9, 6, 9], 9)
    want = hf_model(torch.tensor(ids), attention_mask=torch.tensor(attention)).logits.detach().numpy()
    got = ours(ids, key_padding_mask=attention == 0).numpy()
    assert_close(got, want, TOLERANCE[dtype], "logits")


@pytest.mark.parametrize("variant", list(GPT2_VARIANTS))
def test_gpt2_gradients_match(variant, torch, transformers, rng):
    hf_model = randomised(torch, transformers.GPT2LMHeadModel(gpt2_config(transformers, **GPT2_VARIANTS[variant])),
                          "float64")
    ours = interop.from_hf(hf_model)
    ids, attention = batch(rng, [7, 4], 7)
    upstream = rng.standard_normal((2, 7, 61))
    logits = hf_model(torch.tensor(ids), attention_mask=torch.tensor(attention)).logits
    (logits * torch.tensor(upstream)).sum().backward()
    (ours(ids, key_padding_mask=attention == 0) * Tensor(upstream)).sum().backward()
    assert_gradients_match(torch, ours, hf_model)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bert_model_hidden_states_and_pooled_output_match(dtype, torch, transformers, rng):
    hf_model = randomised(torch, transformers.BertModel(bert_config(transformers)), dtype)
    ours = interop.from_hf(hf_model)
    assert isinstance(ours, models.BidirectionalEncoder) and ours.config["pooler"]
    ids, attention = batch(rng, [8, 5, 2], 8)
    types = rng.integers(0, 3, size=ids.shape)
    out = hf_model(torch.tensor(ids), attention_mask=torch.tensor(attention), token_type_ids=torch.tensor(types))
    hidden, pooled = ours(ids, key_padding_mask=attention == 0, token_type_ids=types)
    assert_close(hidden.numpy(), out.last_hidden_state.detach().numpy(), TOLERANCE[dtype], "hidden states")
    assert_close(pooled.numpy(), out.pooler_output.detach().numpy(), TOLERANCE[dtype], "pooled output")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bert_classifier_logits_match(dtype, torch, transformers, rng):
    hf_model = randomised(torch, transformers.BertForSequenceClassification(bert_config(transformers)), dtype)
    ours = interop.from_hf(hf_model)
    assert isinstance(ours, models.EncoderClassifier) and ours.config["num_classes"] == 3
    ids, attention = batch(rng, [8, 5, 2], 8)
    types = rng.integers(0, 3, size=ids.shape)
    want = hf_model(torch.tensor(ids), attention_mask=torch.tensor(attention),
                    token_type_ids=torch.tensor(types)).logits.detach().numpy()
    assert_close(ours(ids, key_padding_mask=attention == 0, token_type_ids=types).numpy(), want, TOLERANCE[dtype],
                 "logits")
    # BERT's [PAD] is pad_token_id=0: without a mask, npformer masks it as Hugging Face does with
    # the attention mask its tokenizer returns
    assert_close(ours(ids, token_type_ids=types).numpy(), want, TOLERANCE[dtype], "logits, mask from pad ids")


def test_bert_gradients_match(torch, transformers, rng):
    for cls in (transformers.BertModel, transformers.BertForSequenceClassification):
        hf_model = randomised(torch, cls(bert_config(transformers)), "float64")
        ours = interop.from_hf(hf_model)
        ids, attention = batch(rng, [6, 4], 6)
        ids[1, 1] = 0  # a [PAD] token inside the mask: its embedding row gets no gradient on either side
        types = rng.integers(0, 3, size=ids.shape)
        inputs = dict(attention_mask=torch.tensor(attention), token_type_ids=torch.tensor(types))
        out = hf_model(torch.tensor(ids), **inputs)
        mine = ours(ids, key_padding_mask=attention == 0, token_type_ids=types)
        if cls is transformers.BertModel:
            g_hidden, g_pooled = rng.standard_normal((2, 6, 16)), rng.standard_normal((2, 16))
            ((out.last_hidden_state * torch.tensor(g_hidden)).sum()
             + (out.pooler_output * torch.tensor(g_pooled)).sum()).backward()
            ((mine[0] * Tensor(g_hidden)).sum() + (mine[1] * Tensor(g_pooled)).sum()).backward()
        else:
            upstream = rng.standard_normal((2, 3))
            (out.logits * torch.tensor(upstream)).sum().backward()
            (mine * Tensor(upstream)).sum().backward()
        assert np.abs(ours.tok_embed.weight.grad[0]).max() == 0.0
        assert_gradients_match(torch, ours, hf_model)


def test_bert_without_pooler(torch, transformers, rng):
    hf_model = randomised(torch, transformers.BertModel(bert_config(transformers), add_pooling_layer=False), "float64")
    ours = interop.from_hf(hf_model)
    assert not ours.config["pooler"] and not any(k.startswith("pooler") for k in ours.state_dict())
    ids, _ = batch(rng, [5, 5], 5)
    assert_close(ours(ids)[0].numpy(), hf_model(torch.tensor(ids)).last_hidden_state.detach().numpy(), 1e-9, "hidden")
    assert interop.to_hf(ours).pooler is None


@pytest.mark.parametrize("make", [
    lambda t: t.GPT2LMHeadModel(gpt2_config(t)),
    lambda t: t.GPT2LMHeadModel(gpt2_config(t, tie_word_embeddings=False)),
    lambda t: t.BertModel(bert_config(t)),
    lambda t: t.BertForSequenceClassification(bert_config(t, classifier_dropout=0.3)),
], ids=["gpt2", "gpt2-untied", "bert", "bert-classifier"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_round_trips_keep_every_number(make, dtype, torch, transformers):
    hf_model = randomised(torch, make(transformers), dtype).train()
    ours = interop.from_hf(hf_model)
    assert ours.training
    back = interop.to_hf(ours)
    assert type(back) is type(hf_model) and back.training and back.dtype == hf_model.dtype
    theirs, again = hf_model.state_dict(), back.state_dict()
    assert list(theirs) == list(again)
    for key in theirs:
        assert torch.equal(theirs[key], again[key]), key
    ours_again = interop.from_hf(back)
    assert ours_again.config == ours.config
    for (key, a), (key_again, b) in zip(ours.state_dict().items(), ours_again.state_dict().items()):
        assert key == key_again
        np.testing.assert_array_equal(a, b, err_msg=key)
    for option in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "attn_pdrop",
                   "resid_pdrop", "layer_norm_eps", "layer_norm_epsilon"):
        assert getattr(back.config, option, None) == getattr(hf_model.config, option, None), option


def test_every_weight_is_mapped_once(transformers):
    """Both directions cover every key: each npformer key comes from Hugging Face keys, and
    hf_state_dict names exactly the transformers model's state_dict (less a tied lm_head)."""
    for ours in (models.CausalLM(61, d_model=16, nhead=4, num_layers=2, dim_feedforward=24, max_len=16,
                                 tie_weights=False),
                 models.EncoderClassifier(61, 3, d_model=16, nhead=4, num_layers=2, dim_feedforward=24, max_len=16,
                                          pooling="first", pooler=True, type_vocab_size=2, embed_norm=True,
                                          final_norm=False)):
        names = huggingface.hf_state_dict(ours)
        assert set(names) == set(interop.to_hf(ours).state_dict())
        state, skipped = huggingface.state_dict_from_hf(ours, names)
        assert list(state) == list(ours.state_dict()) or set(state) == set(ours.state_dict())
        assert skipped == []


def test_unmapped_missing_and_misshaped_keys_are_named(torch, transformers):
    hf_model = transformers.GPT2LMHeadModel(gpt2_config(transformers))
    ours = interop.from_hf(hf_model)
    tensors = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    with pytest.raises(ValueError, match=r"unmapped key 'transformer\.h\.0\.attn\.q_attn\.weight'"):
        huggingface.state_dict_from_hf(ours, {**tensors, "transformer.h.0.attn.q_attn.weight": np.zeros((16, 16))})
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(ValueError, match=r"missing key 'transformer\.h\.1\.mlp\.c_fc\.bias' \(npformer's "
                                         r"encoder\.layers\.1\.linear1\.bias\)"):
        huggingface.state_dict_from_hf(ours, missing)
    wrong = dict(tensors, **{"transformer.h.0.attn.c_attn.weight": np.zeros((48, 16))})
    with pytest.raises(ValueError, match=r"mis-shaped key 'transformer\.h\.0\.attn\.c_attn\.weight': shape \(48, 16\), "
                                         r"expected \(16, 48\)"):
        huggingface.state_dict_from_hf(ours, wrong)
    untied = dict(tensors, **{"lm_head.weight": tensors["transformer.wte.weight"] + 1})
    with pytest.raises(ValueError, match="differs from the word embeddings"):
        huggingface.state_dict_from_hf(ours, untied)
    before = ours.state_dict()
    with pytest.raises(ValueError):
        huggingface.state_dict_from_hf(ours, missing)
    for key, value in ours.state_dict().items():
        np.testing.assert_array_equal(value, before[key])


def test_configs_without_counterpart_are_refused(torch, transformers):
    with pytest.raises(TypeError, match="expected a transformers GPT2LMHeadModel"):
        interop.from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="got GPT2Model"):
        interop.from_hf(transformers.GPT2Model(gpt2_config(transformers)))
    for options, message in ((dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
                             (dict(activation_function="silu"), "activation_function='silu'"),
                             (dict(embd_pdrop=0.0), "one dropout rate")):
        with pytest.raises(ValueError, match=message):
            interop.from_hf(transformers.GPT2LMHeadModel(gpt2_config(transformers, **options)))
    with pytest.raises(ValueError, match="BERT config: type_vocab_size must be an integer >= 1, got 0"):
        interop.from_hf(transformers.BertModel(bert_config(transformers, type_vocab_size=0)))
    with pytest.raises(TypeError, match=r"to_hf: expected float32 or float64 parameters, got \['float16'\]"):
        interop.to_hf(models.CausalLM(11, d_model=8, nhead=2, num_layers=1, dim_feedforward=8, max_len=8,
                                      ).to(dtype="float16"))
    with pytest.raises(ValueError, match="model_type 't5' is not supported"):
        huggingface.config_from_hf({"model_type": "t5"})
    small = dict(d_model=8, nhead=2, num_layers=1, dim_feedforward=8, max_len=8)
    for model, message in ((models.CausalLM(11, positional="rope", **small), "positional='rope'"),
                           (models.CausalLM(11, norm_first=False, **small), "pre-LN"),
                           (models.EncoderClassifier(11, 2, **small),
                            r"BERT needs EncoderClassifier\(embed_norm=True\)"),
                           (models.EncoderClassifier(11, 2, embed_norm=True, final_norm=False, type_vocab_size=2,
                                                     **small), "pooler=True and pooling='first'"),
                           (models.Seq2SeqTransformer(11, 11, d_model=8, nhead=2, num_encoder_layers=1,
                                                      num_decoder_layers=1, dim_feedforward=8),
                            "Seq2SeqTransformer has no Hugging Face counterpart")):
        with pytest.raises(ValueError, match=message):
            interop.to_hf(model)


def test_to_hf_of_an_npformer_trained_gpt(torch, transformers, rng):
    """A default CausalLM (exact GELU, untied head) exports as a GPT-2 with the same logits."""
    ours = models.CausalLM(23, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, max_len=12).double().eval()
    theirs = interop.to_hf(ours)
    assert theirs.config.activation_function == "gelu" and not theirs.config.tie_word_embeddings
    ids = rng.integers(0, 23, size=(2, 12))
    assert_close(ours(ids).numpy(), theirs(torch.tensor(ids)).logits.detach().numpy(), 1e-9, "logits")
