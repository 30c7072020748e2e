"""Seq2SeqTransformer: logits and the gradient of every parameter equal torch's (through
interop.to_torch) with label-smoothed, padding-ignoring cross-entropy, in float64 over small
configs and in float32 at d_model 512; the seed article's shape check; KV-cached decoding
equals full decoding; config rebuild; padding handling; devices; errors."""
import numpy as np
import pytest

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor, backend
from npformer import interop
from npformer.models import Seq2SeqTransformer

from helpers import PAD, padded_batch
from tolerances import scaled

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def assert_model_parity(torch, model, src, tgt, labels, *, atol, rtol=0.0, masks=None):
    """Logits, the loss (label smoothing 0.1, ignore_index PAD) and every parameter's gradient
    against the torch composition with the same weights. atol is set at unit scale."""
    masks = masks or {}
    theirs = interop.to_torch(model)
    atol = scaled(atol, *model.parameters())
    vocab = model.config["tgt_vocab_size"]
    logits = model(src, tgt, **masks)
    ref = theirs(torch.tensor(src), torch.tensor(tgt), **{k: torch.tensor(v) for k, v in masks.items()})
    np.testing.assert_allclose(logits.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol, err_msg="logits")
    loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=PAD, label_smoothing=0.1)
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, vocab), torch.tensor(labels).reshape(-1),
                                                 ignore_index=PAD, label_smoothing=0.1)
    np.testing.assert_allclose(loss.item(), ref_loss.item(), atol=atol, rtol=rtol)
    loss.backward()
    ref_loss.backward()
    named = dict(theirs.named_parameters())
    assert set(named) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        np.testing.assert_allclose(backend.as_numpy(p.grad), named[name].grad.numpy(), atol=atol, rtol=rtol,
                                   err_msg=f"gradient of {name}")


def random_config(seed):
    """A small random configuration (vocabularies, widths, depths, LN placement, activation...)."""
    rng = np.random.default_rng(seed)
    nhead = int(rng.choice([1, 2, 4]))
    tie = [False, True, "all"][seed % 3]
    src_vocab = int(rng.integers(8, 20))
    return dict(src_vocab_size=src_vocab, tgt_vocab_size=src_vocab if tie == "all" else int(rng.integers(8, 20)),
                d_model=nhead * int(rng.integers(2, 5)), nhead=nhead, num_encoder_layers=int(rng.integers(1, 3)),
                num_decoder_layers=int(rng.integers(1, 3)), dim_feedforward=int(rng.integers(4, 20)), dropout=0.0,
                activation=["relu", "gelu"][seed % 2], norm_first=bool(seed // 2 % 2), pad_idx=PAD, tie_weights=tie,
                positional=["sinusoidal", "learned", "none"][seed // 3 % 3])


CONFIGS = [random_config(seed) for seed in range(6)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "{norm}-{activation}-tie_{tie_weights}-{positional}".format(
    norm="preLN" if c["norm_first"] else "postLN", **c))
def test_whole_model_matches_torch_float64(config, torch):
    npformer.manual_seed(1)
    rng = np.random.default_rng(2)
    model = Seq2SeqTransformer(**config).double()
    src = padded_batch(rng, config["src_vocab_size"], [6, 3, 5], 6)
    tgt_full = padded_batch(rng, config["tgt_vocab_size"], [5, 4, 2], 6)
    tgt, labels = tgt_full[:, :-1], tgt_full[:, 1:]
    assert_model_parity(torch, model, src, tgt, labels, atol=1e-9)


def test_explicit_masks_without_pad_idx_match_torch(torch, rng):
    model = Seq2SeqTransformer(9, 9, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=16, dropout=0.0, norm_first=True).double()
    src, tgt = padded_batch(rng, 9, [4, 2], 4), padded_batch(rng, 9, [3, 2], 3)
    masks = dict(src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt == PAD)
    assert_model_parity(torch, model, src, tgt, padded_batch(rng, 9, [3, 2], 3), atol=1e-9, masks=masks)
    # the same masks derived from pad_idx give the same logits
    derived = Seq2SeqTransformer(**dict(model.config, pad_idx=PAD)).double()
    derived.load_state_dict(model.state_dict())
    np.testing.assert_allclose(derived(src, tgt).numpy(), model(src, tgt, **masks).numpy(), atol=1e-12)


def test_whole_model_matches_torch_float32_d512(torch, rng):
    npformer.manual_seed(0)
    model = Seq2SeqTransformer(40, 40, d_model=512, nhead=8, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=2048, dropout=0.0, pad_idx=PAD)
    src, tgt_full = padded_batch(rng, 40, [5, 3], 5), padded_batch(rng, 40, [6, 4], 6)
    assert_model_parity(torch, model, src, tgt_full[:, :-1], tgt_full[:, 1:], atol=1e-5, rtol=1e-4)


def test_seed_article_shape_check():
    model = Seq2SeqTransformer(10000, 10000, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(0, 10000, size=(2, 10)), rng.integers(0, 10000, size=(2, 10))
    with autograd.no_grad():
        logits = model(src, tgt)
    assert logits.shape == (2, 10, 10000) and logits.dtype == np.float32
    assert np.isfinite(logits.numpy()).all()


def test_padding_does_not_change_the_valid_logits(rng):
    """A padded row gives the same logits at its real positions as the same sentence alone."""
    model = Seq2SeqTransformer(12, 12, d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=16, pad_idx=PAD).double().eval()
    src, tgt = padded_batch(rng, 12, [6, 3], 6), padded_batch(rng, 12, [5, 2], 5)
    batch = model(src, tgt).numpy()
    alone = model(src[1:, :3], tgt[1:, :2]).numpy()
    np.testing.assert_allclose(batch[1, :2], alone[0], atol=1e-12)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_decoding_equals_full_decoding(positional, norm_first, rng):
    model = Seq2SeqTransformer(11, 13, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=2,
                               dim_feedforward=16, pad_idx=PAD, positional=positional,
                               norm_first=norm_first).double().eval()
    src, tgt = padded_batch(rng, 11, [5, 3, 4], 5), rng.integers(1, 13, size=(3, 6))
    memory = model.encode(src)
    full = model.decode(tgt, memory, memory_key_padding_mask=src == PAD).numpy()      # (3, 6, 13)
    cache = model.init_cache(memory, memory_key_padding_mask=src == PAD)
    for t in range(6):
        step = model.decode_step(tgt[:, t], cache)
        assert step.shape == (3, 13) and len(cache) == t + 1
        np.testing.assert_allclose(step.numpy(), full[:, t], atol=1e-10, rtol=0)
    # reorder: expand and permute rows (beam search), then continue decoding
    order = np.array([2, 0, 0, 1])
    cache = model.init_cache(memory, memory_key_padding_mask=src == PAD)
    for t in range(3):
        model.decode_step(tgt[:, t], cache)
    cache.reorder(order)
    assert cache.batch_size == 4
    for t in range(3, 6):
        np.testing.assert_allclose(model.decode_step(tgt[order, t], cache).numpy(), full[order, t], atol=1e-10)


def test_cache_errors(rng):
    model = Seq2SeqTransformer(7, 7, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=8, max_len=3)
    cache = model.init_cache(model.encode(rng.integers(0, 7, size=(2, 3))))
    with pytest.raises(ValueError, match=r"tokens must be a 1-D array \(batch,\)"):
        model.decode_step(np.zeros((2, 1), dtype=int), cache)
    with pytest.raises(ValueError, match=r"x must be \(batch=2, 1, d\)"):
        model.decode_step(np.zeros(3, dtype=int), cache)
    with pytest.raises(IndexError, match=r"decode_step: tokens token ids must be in \[0, 6\]"):
        model.decode_step(np.array([0, 7]), cache)
    with pytest.raises(TypeError, match="decode_step: cache must come from init_cache, got dict"):
        model.decode_step(np.zeros(2, dtype=int), {})
    assert cache.length == 0  # nothing appended by the refused calls
    with pytest.raises(IndexError, match=r"indices must be in \[0, 1\]"):
        cache.reorder([0, 2])
    for _ in range(3):
        model.decode_step(np.zeros(2, dtype=int), cache)
    with pytest.raises(ValueError, match="max_len=3"):
        model.decode_step(np.zeros(2, dtype=int), cache)


def test_config_rebuilds_the_model(rng):
    model = Seq2SeqTransformer(**CONFIGS[1])
    rebuilt = Seq2SeqTransformer(**model.config)
    rebuilt.load_state_dict(model.state_dict())
    src, tgt = rng.integers(1, 8, size=(2, 4)), rng.integers(1, 8, size=(2, 3))
    np.testing.assert_array_equal(rebuilt.eval()(src, tgt).numpy(), model.eval()(src, tgt).numpy())


@pytest.mark.parametrize("tie, expected", [(False, ["src_embed.weight", "tgt_embed.weight", "generator.weight",
                                                    "generator.bias"]),
                                           (True, ["src_embed.weight", "tgt_embed.weight", "generator.bias"]),
                                           ("all", ["tgt_embed.weight", "generator.bias"])])
def test_state_dict_keys(tie, expected):
    model = Seq2SeqTransformer(9, 9, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=8, tie_weights=tie)
    keys = list(model.state_dict())
    assert [k for k in keys if not k.startswith("transformer.")] == expected
    assert keys[len(expected) - (1 if tie else 2)].startswith("transformer.")  # transformer.* before generator
    if tie:
        assert model.generator.weight is None
        assert model.project(Tensor(np.ones((1, 8), dtype="float32"))).shape == (1, 9)


def test_init(rng):
    npformer.manual_seed(0)
    model = Seq2SeqTransformer(50, 60, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=64, pad_idx=3)
    for name, p in model.named_parameters():
        if p.ndim == 2:
            assert np.abs(p.numpy()).max() <= np.sqrt(6 / sum(p.shape)), name
    assert np.all(model.src_embed.weight.numpy()[3] == 0) and np.all(model.tgt_embed.weight.numpy()[3] == 0)


def test_runs_on_device(device, rng):
    model = Seq2SeqTransformer(9, 9, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=8, pad_idx=PAD).to(device)
    src, tgt = padded_batch(rng, 9, [4, 2], 4), padded_batch(rng, 9, [3, 3], 3)
    logits = model(src, tgt)
    assert logits.device == device
    F.cross_entropy(logits.reshape(-1, 9), tgt.reshape(-1), ignore_index=PAD).backward()
    assert all(backend.device_of(p.grad) == device for p in model.parameters())
    with autograd.no_grad():
        cache = model.init_cache(model.encode(src), src == PAD)
        assert model.decode_step(tgt[:, 0], cache).device == device
    assert model.double()(src, tgt).dtype == np.float64


def test_errors(rng):
    with pytest.raises(ValueError, match="d_model=10 is not divisible by nhead=4"):
        Seq2SeqTransformer(5, 5, d_model=10, nhead=4)
    with pytest.raises(ValueError, match=r"src_vocab_size \(5\) must equal tgt_vocab_size \(6\)"):
        Seq2SeqTransformer(5, 6, d_model=8, nhead=2, tie_weights="all")
    with pytest.raises(TypeError, match="src_vocab_size must be an integer >= 1, got '5'"):
        Seq2SeqTransformer("5", 5, d_model=8, nhead=2, share_embeddings=True)
    with pytest.raises(ValueError, match="positional must be one of"):
        Seq2SeqTransformer(5, 5, d_model=8, nhead=2, positional="relative")
    model = Seq2SeqTransformer(7, 7, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=8, max_len=6)
    ids = rng.integers(0, 7, size=(2, 4))
    with pytest.raises(TypeError, match="src must hold integer token ids"):
        model(ids.astype(float), ids)
    with pytest.raises(ValueError, match=r"tgt must be a non-empty \(batch, seq\) array"):
        model(ids, ids[0])
    with pytest.raises(ValueError, match="batch sizes differ: 2 vs 1"):
        model(ids, ids[:1])
    with pytest.raises(IndexError, match=r"\[0, 6\]"):
        model(ids + 7, ids)
    with pytest.raises(ValueError, match="max_len=6"):
        model(rng.integers(0, 7, size=(1, 7)), ids[:1])
