"""npformer.interop (torch.nn): from_torch(to_torch(m)) reproduces the state_dict bit for bit
for every supported module; keys equal the torch counterpart's; torch-built modules convert and
compute the same; dtype and training mode carry over; the models' Hugging Face options match
their torch twins; sequence-first torch modules and unsupported things fail clearly."""
import numpy as np
import pytest

from autograd import Tensor, backend
from npformer import interop, models, nn

from tolerances import scaled

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")

MODULES = {
    "transformer": lambda: nn.Transformer(8, 2, 2, 1, 16, norm_first=True, activation="gelu"),
    "transformer_no_bias": lambda: nn.Transformer(8, 2, 1, 1, 16, bias=False, layer_norm_eps=1e-3),
    "encoder_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16),
    "decoder_layer": lambda: nn.TransformerDecoderLayer(8, 2, 16, norm_first=True),
    "encoder": lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, nn.LayerNorm(8)),
    "decoder": lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16), 2),
    "attention": lambda: nn.MultiheadAttention(8, 2, dropout=0.1),
    "linear": lambda: nn.Linear(3, 4, bias=False),
    "layer_norm": lambda: nn.LayerNorm(5, eps=1e-6),
    "rms_norm": lambda: nn.RMSNorm(5, eps=1e-6),
    "rms_norm_default_eps": lambda: nn.RMSNorm((2, 5)),
    "causal_lm_no_bias": lambda: models.CausalLM(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=8,
                                                 bias=False, tie_weights=True, activation="silu",
                                                 residual_init="gpt2"),
    "embedding": lambda: nn.Embedding(7, 3, padding_idx=2),
    "seq2seq": lambda: models.Seq2SeqTransformer(11, 12, d_model=8, nhead=2, num_encoder_layers=1,
                                                 num_decoder_layers=2, dim_feedforward=16, pad_idx=0),
    "seq2seq_tied": lambda: models.Seq2SeqTransformer(11, 12, d_model=8, nhead=2, num_encoder_layers=1,
                                                      num_decoder_layers=1, dim_feedforward=16, tie_weights=True,
                                                      positional="learned"),
    "seq2seq_tied_all": lambda: models.Seq2SeqTransformer(11, 11, d_model=8, nhead=2, num_encoder_layers=1,
                                                          num_decoder_layers=1, dim_feedforward=16,
                                                          tie_weights="all"),
    "causal_lm": lambda: models.CausalLM(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=8),
    "classifier": lambda: models.EncoderClassifier(11, 3, d_model=8, nhead=2, num_layers=1, dim_feedforward=16,
                                                   pooling="first", positional="sinusoidal"),
    "gpt2_style": lambda: models.CausalLM(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, max_len=8,
                                          activation="gelu_tanh", tie_weights=True, activation_dropout=0.0),
    "bert_style": lambda: models.BidirectionalEncoder(11, d_model=8, nhead=2, num_layers=1, dim_feedforward=16,
                                                      max_len=8, pooling="first", pooler=True, type_vocab_size=2,
                                                      embed_norm=True, final_norm=False, pad_idx=0),
    "bert_classifier": lambda: models.EncoderClassifier(11, 3, d_model=8, nhead=2, num_layers=1, dim_feedforward=16,
                                                        type_vocab_size=3, embed_norm=True, pooler=True,
                                                        classifier_dropout=0.2, attention_dropout=0.0),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(MODULES))
def test_round_trip_is_bit_exact(name, dtype, torch):
    ours = MODULES[name]().to(dtype=dtype).eval()
    theirs = interop.to_torch(ours)
    assert not theirs.training
    assert [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()] == \
           [(k, v.shape) for k, v in ours.state_dict().items()]
    back = interop.from_torch(theirs)
    assert type(back) is type(ours) and not back.training
    assert getattr(back, "config", None) == getattr(ours, "config", None)
    for (key, a), (key_back, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert key == key_back and a.dtype == b.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b, err_msg=key)


def test_torch_built_transformer_converts_and_computes_the_same(torch, rng):
    torch.manual_seed(0)
    theirs = torch.nn.Transformer(8, 2, 2, 2, 16, dropout=0.0, activation="gelu", norm_first=True,
                                  batch_first=True, dtype=torch.float64)
    ours = interop.from_torch(theirs)
    assert ours.config["activation"] == "gelu" and ours.config["norm_first"]
    src, tgt = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 3, 8))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(3, dtype=torch.float64)
    np.testing.assert_allclose(ours(Tensor(src), Tensor(tgt), tgt_mask=mask.numpy()).numpy(),
                               theirs(torch.tensor(src), torch.tensor(tgt), tgt_mask=mask).detach().numpy(),
                               atol=scaled(1e-10, src, tgt, *ours.parameters()))


def test_torch_composition_keys_equal_ours_for_every_tie(torch):
    classes = interop.torch_model_classes()
    for tie in (False, True, "all"):
        config = dict(src_vocab_size=9, tgt_vocab_size=9, d_model=8, nhead=2, num_encoder_layers=1,
                      num_decoder_layers=1, dim_feedforward=8, tie_weights=tie)
        ours = models.Seq2SeqTransformer(**config)
        theirs = classes["Seq2SeqTransformer"](**config)
        assert set(theirs.state_dict()) == set(ours.state_dict())
        assert theirs.config == ours.config


def test_unsupported_inputs(torch):
    with pytest.raises(TypeError, match="npformer nn.Module"):
        interop.to_torch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        interop.from_torch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="no torch counterpart for Sequential"):
        interop.to_torch(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="no npformer counterpart for Conv1d"):
        interop.from_torch(torch.nn.Conv1d(2, 2, 3))
    with pytest.raises(NotImplementedError, match="RoPE"):
        interop.to_torch(nn.Transformer(8, 2, 1, 1, 8, rotary=True))
    with pytest.raises(ValueError, match="relu or gelu"):
        interop.from_torch(torch.nn.TransformerEncoderLayer(8, 2, 8, activation=torch.tanh, batch_first=True))
    with pytest.raises(ValueError, match="activation must be one of"):
        models.CausalLM(11, d_model=8, nhead=2, activation="gelu_new")  # Hugging Face's name: say "gelu_tanh"
    with pytest.raises(ValueError, match=r"type_vocab_size \(0: no token types\) must be an integer >= 0"):
        models.BidirectionalEncoder(11, d_model=8, nhead=2, type_vocab_size=-1)
    with pytest.raises(ValueError, match="no token-type embedding"):
        models.BidirectionalEncoder(11, d_model=8, nhead=2, num_layers=1)([[1, 2]], token_type_ids=[[0, 0]])
    with pytest.raises(ValueError, match=r"CausalLM: attention_dropout must be a real number in \[0, 1\], got 1.5"):
        models.CausalLM(11, d_model=8, nhead=2, attention_dropout=1.5)


@pytest.mark.parametrize("make", [
    lambda t: t.nn.Transformer(8, 2, 1, 1, 16),
    lambda t: t.nn.TransformerEncoderLayer(8, 2, 16),
    lambda t: t.nn.TransformerDecoderLayer(8, 2, 16),
    lambda t: t.nn.TransformerEncoder(t.nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False),
    lambda t: t.nn.TransformerDecoder(t.nn.TransformerDecoderLayer(8, 2, 16), 1),
    lambda t: t.nn.MultiheadAttention(8, 2),
], ids=["transformer", "encoder_layer", "decoder_layer", "encoder", "decoder", "attention"])
def test_sequence_first_torch_modules_are_refused(make, torch):
    """torch's default batch_first=False takes (seq, batch, feature): converting it silently would
    give a batch-first model that reads the same input differently (issue 12)."""
    with pytest.raises(ValueError, match="batch_first") as info:
        interop.from_torch(make(torch))
    if not isinstance(make(torch), torch.nn.MultiheadAttention):
        assert "Rebuild it with batch_first=True" in str(info.value)


def test_the_rebuild_the_error_names_converts_exactly(torch, rng):
    """The fix the refusal names: a batch_first=True twin with the same state_dict; ours on
    (batch, seq, feature) equals torch's sequence-first original on the transposed input."""
    torch.manual_seed(0)
    original = torch.nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, dtype=torch.float64).eval()
    twin = torch.nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True, dtype=torch.float64).eval()
    twin.load_state_dict(original.state_dict())
    ours = interop.from_torch(twin)
    src, tgt = rng.standard_normal((5, 2, 8)), rng.standard_normal((3, 2, 8))  # (seq, batch, feature)
    want = original(torch.tensor(src), torch.tensor(tgt)).detach().numpy()
    got = ours(Tensor(src.transpose(1, 0, 2)), Tensor(tgt.transpose(1, 0, 2))).numpy()
    np.testing.assert_allclose(got.transpose(1, 0, 2), want, atol=1e-10)


HF_STYLE = {
    "gpt2_style": lambda rng: dict(input_ids=rng.integers(0, 11, size=(2, 6))),
    "bert_style": lambda rng: dict(input_ids=np.array([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 1, 2]]),
                                   token_type_ids=rng.integers(0, 2, size=(2, 6))),
    "bert_classifier": lambda rng: dict(input_ids=rng.integers(0, 11, size=(3, 5)),
                                        token_type_ids=rng.integers(0, 3, size=(3, 5))),
}


@pytest.mark.parametrize("name", list(HF_STYLE))
def test_new_model_options_match_their_torch_twins(name, torch, rng):
    """gelu_tanh, token types, embedding LayerNorm, no final norm, the pooler: forward and every
    parameter's gradient (random upstream gradient) equal the torch composition's in float64."""
    ours = MODULES[name]().double().eval()
    theirs = interop.to_torch(ours)
    inputs = HF_STYLE[name](rng)
    outs = ours(**inputs)
    refs = theirs(**{k: torch.tensor(v) for k, v in inputs.items()})
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    ours_loss, theirs_loss = 0, 0
    for o, r in zip(outs, refs):
        np.testing.assert_allclose(o.numpy(), r.detach().numpy(), atol=1e-12 * max(1.0, np.abs(o.numpy()).max()))
        g = rng.standard_normal(o.shape)
        ours_loss = ours_loss + (o * Tensor(g)).sum()
        theirs_loss = theirs_loss + (r * torch.tensor(g)).sum()
    ours_loss.backward()
    theirs_loss.backward()
    named = dict(theirs.named_parameters())
    for key, p in ours.named_parameters():
        want = named[key].grad.numpy()
        np.testing.assert_allclose(p.grad, want, atol=1e-10 * max(1.0, np.abs(want).max()), err_msg=key)


def test_dropout_rates_reach_every_layer(torch):
    ours = models.CausalLM(11, d_model=8, nhead=2, num_layers=2, dropout=0.3, attention_dropout=0.1,
                           activation_dropout=0.0)
    theirs = interop.to_torch(ours)
    for mine, twin in zip(ours.encoder.layers, theirs.encoder.layers):
        assert (mine.self_attn.dropout, mine.dropout.p, mine.dropout1.p, mine.dropout2.p) == (0.1, 0.0, 0.3, 0.3)
        assert (twin.self_attn.dropout, twin.dropout.p, twin.dropout1.p, twin.dropout2.p) == (0.1, 0.0, 0.3, 0.3)
    default = models.CausalLM(11, d_model=8, nhead=2, num_layers=1, dropout=0.2).encoder.layers[0]
    assert (default.self_attn.dropout, default.dropout.p) == (0.2, 0.2)  # unchanged: torch.nn's layout


@pytest.mark.parametrize("name", list(HF_STYLE))
def test_new_model_options_run_on_device(name, device, rng):
    model = MODULES[name]().to(device)
    outs = model(**HF_STYLE[name](rng))
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert all(o.device == device for o in outs)
    sum(o.sum() for o in outs).backward()
    assert all(p.grad.device == device for p in model.parameters())
