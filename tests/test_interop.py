"""npformer.interop: from_torch(to_torch(m)) reproduces the state_dict bit for bit for every
supported module; keys equal the torch counterpart's; torch-built modules convert and compute
the same; dtype and training mode carry over; unsupported things fail clearly."""
import numpy as np
import pytest

from autograd import Tensor
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
