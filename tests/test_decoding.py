"""Greedy and beam search: cached == uncached, beam width 1 == greedy, beam search against
brute force, EOS handling."""
import itertools
import tracemalloc

import numpy as np
import pytest

from autograd import no_grad
from npformer import functional as F
from npformer import nn
from npformer.data import EOS, PAD, SequenceTask
from npformer.decoding import beam_search, greedy_decode
from npformer.models import Seq2SeqTransformer
from npformer.runtime.random import manual_seed


def _model(vocab=12, device="cpu", d_model=16, layers=2):
    manual_seed(0)
    model = Seq2SeqTransformer(vocab, vocab, d_model=d_model, nhead=2, num_encoder_layers=layers,
                               num_decoder_layers=layers, dim_feedforward=32, dropout=0.1, pad_idx=PAD)
    return model.to(device)


def _sources(vocab=12, n=12):
    task = SequenceTask(vocab_size=vocab, min_len=2, max_len=7, seed=3, heldout_size=n)
    return task.collate(task.heldout).src  # variable lengths: padded


@pytest.mark.parametrize("eos", [EOS, None])
def test_greedy_cached_equals_uncached(device, eos):
    model, src = _model(device=device), _sources()
    model.train()  # decoding runs without dropout (nn.inference_mode), the mode untouched
    cached = greedy_decode(model, src, 9, eos=eos)
    uncached = greedy_decode(model, src, 9, eos=eos, use_cache=False)
    assert model.training
    assert cached.dtype == np.int64 and cached.shape[0] == len(src)
    np.testing.assert_array_equal(cached, uncached)
    if eos is None:
        assert cached.shape == (len(src), 9)


def test_greedy_matches_the_tutorials_loop():
    """The seed's greedy_decode: argmax of model(src, prefix)[:, -1], prefix grown by one."""
    model, src = _model(), _sources()
    model.eval()
    prefix = np.full((len(src), 1), 1)
    with no_grad():
        for _ in range(6):
            logits = model(src, prefix).numpy()[:, -1]
            prefix = np.concatenate([prefix, logits.argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(greedy_decode(model, src, 6, eos=None), prefix[:, 1:])


def test_greedy_pads_after_eos_and_stops_early():
    model, src = _model(), _sources()
    out = greedy_decode(model, src, 30)
    for row in out:
        hits = np.flatnonzero(row == EOS)
        if hits.size:
            assert (row[hits[0] + 1:] == PAD).all()
    assert out.shape[1] == 30 or (out == EOS).any(axis=1).all()


@pytest.mark.parametrize("beam_size", [2, 4])
def test_beam_cached_equals_uncached(beam_size):
    model, src = _model(), _sources()
    tokens, scores = beam_search(model, src, 8, beam_size=beam_size, return_scores=True)
    tokens_u, scores_u = beam_search(model, src, 8, beam_size=beam_size, use_cache=False, return_scores=True)
    np.testing.assert_array_equal(tokens, tokens_u)
    np.testing.assert_allclose(scores, scores_u, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eos", [EOS, None])
def test_beam_width_one_is_greedy(eos):
    model, src = _model(), _sources()
    np.testing.assert_array_equal(beam_search(model, src, 9, beam_size=1, eos=eos), greedy_decode(model, src, 9, eos=eos))


def _sequence_log_prob(model, src_row, tokens):
    """log p(tokens | src) from the uncached decoder, summed."""
    prefix = np.array([[1] + tokens[:-1]])
    with no_grad():
        logp = F.log_softmax(model.decode(prefix, model.encode(src_row[None])), dim=-1).numpy()[0]
    return float(sum(logp[i, t] for i, t in enumerate(tokens)))


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_finds_the_best_sequence_when_nothing_is_pruned(length_penalty):
    # vocab 6 (3 real symbols), max_len 2: every hypothesis fits in 36 beams, so beam search
    # must return the best of all of them under its scoring rule
    vocab, max_len = 6, 2
    model = _model(vocab=vocab, d_model=8, layers=1)
    model.eval()
    src = np.array([[3, 4, 5], [5, 5, 3]])
    tokens, scores = beam_search(model, src, max_len, beam_size=vocab ** max_len,
                                 length_penalty=length_penalty, return_scores=True)
    non_eos = [t for t in range(vocab) if t != EOS]
    hypotheses = [[EOS]] + [[a, EOS] for a in non_eos] + [list(p) for p in itertools.product(non_eos, repeat=2)]
    for row in range(len(src)):
        scored = [(_sequence_log_prob(model, src[row], h) / len(h) ** length_penalty, h) for h in hypotheses]
        best_score, best = max(scored)
        assert tokens[row, :len(best)].tolist() == best and (tokens[row, len(best):] == PAD).all()
        assert scores[row] == pytest.approx(best_score, rel=1e-4, abs=1e-5)


def test_bad_arguments():
    model, src = _model(), _sources()
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(model, src, 0)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, src, 5, beam_size=0)
    with pytest.raises(TypeError, match="src: expected integer token ids"):
        greedy_decode(model, src.astype(float), 5)
    with pytest.raises(ValueError, match=r"src: expected a 2-D array"):
        greedy_decode(model, src[0], 5)


@pytest.mark.parametrize("bos", [1, PAD])  # PAD as the start token: T5's and Marian's decoder_start_token_id
def test_generated_pad_ids_are_tokens_on_both_paths(device, bos):
    """A generated id equal to the model's pad_idx is a token, not padding, with or without the
    cache: the uncached path must not mask it (nor a BOS equal to pad_idx)."""
    model, src = _model(), _sources()
    model.generator.bias.data[PAD] += 2.0  # the model now emits PAD often
    model.to(device)
    cached = greedy_decode(model, src, 6, bos=bos, eos=None)
    assert (cached == PAD).any()
    np.testing.assert_array_equal(greedy_decode(model, src, 6, bos=bos, eos=None, use_cache=False), cached)
    tokens, scores = beam_search(model, src, 6, bos=bos, eos=None, return_scores=True)
    tokens_u, scores_u = beam_search(model, src, 6, bos=bos, eos=None, use_cache=False, return_scores=True)
    np.testing.assert_array_equal(tokens_u, tokens)
    np.testing.assert_allclose(scores_u, scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bos", "eos", "pad"])
@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_special_ids_must_be_in_the_target_vocabulary(decode, name):
    model, src = _model(vocab=12), _sources()
    with pytest.raises(ValueError, match=rf"{decode.__name__}: {name} must be an integer in \[0, 11\], got 12"):
        decode(model, src, 3, **{name: 12})


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_use_cache_must_be_a_bool(decode):
    model, src = _model(), _sources()
    with pytest.raises(TypeError, match=f"{decode.__name__}: use_cache must be True or False"):
        decode(model, src, 3, use_cache="no")
    with pytest.raises(TypeError, match="beam_search: return_scores must be True or False"):
        beam_search(model, src, 3, return_scores="no")


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_source_mask_as_a_list_or_tensor(decode):
    from autograd import Tensor
    model, src = _model(), _sources()
    mask = src == PAD
    expected = decode(model, src, 4, src_key_padding_mask=mask)
    np.testing.assert_array_equal(decode(model, src, 4, src_key_padding_mask=mask.tolist()), expected)
    np.testing.assert_array_equal(decode(model, src, 4, src_key_padding_mask=Tensor(mask)), expected)


def test_beam_search_in_train_mode_runs_without_dropout():
    model, src = _model(), _sources()
    model.eval()
    expected = beam_search(model, src, 6, beam_size=3, return_scores=True)
    model.train()
    tokens, scores = beam_search(model, src, 6, beam_size=3, return_scores=True)
    assert model.training
    np.testing.assert_array_equal(tokens, expected[0])
    np.testing.assert_array_equal(scores, expected[1])


def test_rope_and_none_positions_have_no_length_limit():
    """Only a positional table (learned, sinusoidal) bounds max_len, as the model's own forward."""
    manual_seed(0)
    src = _sources()
    for positional in ("rope", "none"):
        model = Seq2SeqTransformer(12, 12, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                   dim_feedforward=32, pad_idx=PAD, positional=positional, max_len=7)
        cached = greedy_decode(model, src, 9, eos=None)
        assert cached.shape == (len(src), 9)
        np.testing.assert_array_equal(greedy_decode(model, src, 9, eos=None, use_cache=False), cached)


@pytest.mark.parametrize("decode, options", [(greedy_decode, {}), (beam_search, dict(beam_size=3, length_penalty=0.6))])
def test_each_row_decodes_as_it_would_alone(decode, options):
    """Rows of a batch (sources of different lengths, finishing at different steps) do not
    affect each other: every row equals that source decoded alone (without its padding)."""
    model, src = _model(), _sources(n=6)
    out = decode(model, src, 9, **options)
    assert len({int((row != PAD).sum()) for row in out}) > 1  # rows finish at different steps
    for b, row in enumerate(src):
        alone = decode(model, row[row != PAD][None], 9, **options)[0]
        np.testing.assert_array_equal(out[b, :len(alone)], alone)
        assert (out[b, len(alone):] == PAD).all()


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_a_causal_lm_is_refused_with_a_pointer_to_generate(decode):
    from npformer.models import CausalLM
    model = CausalLM(12, d_model=8, nhead=2, num_layers=1, dim_feedforward=16)
    with pytest.raises(TypeError, match=f"{decode.__name__}: expected an encoder-decoder model .* got CausalLM"):
        decode(model, np.ones((1, 3), dtype=int), 3)


@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_decoding_leaves_the_mode_alone(decode):
    """Issue 29 item 4 for the seq2seq decoders: they flipped the shared model into eval mode and
    back; now they run in nn.inference_mode(), `training` unchanged all along (so a thread that
    trains the model meanwhile keeps its dropout, and decoding never runs with it)."""
    model, src = _model(), _sources()
    expected = decode(model.eval(), src, 5)
    model.train()
    found = []  # (model.training, inside inference_mode) at every step
    decode_step = model.decode_step

    def watched(*args, **kwargs):
        found.append((model.training, nn.is_inference_mode_enabled()))
        return decode_step(*args, **kwargs)
    model.decode_step = watched
    np.testing.assert_array_equal(decode(model, src, 5), expected)
    assert found and all(training and inference for training, inference in found)


@pytest.mark.parametrize("decode, beams", [(greedy_decode, 1), (beam_search, 4)])
def test_nan_logits_raise_naming_the_step_and_row(decode, beams):
    """Issue 29 item 10b: an argmax of NaN logits picked token 0 silently."""
    model, src = _model().eval(), _sources(n=3)
    decode_step, calls = model.decode_step, []

    def with_nan(*args, **kwargs):
        logits = decode_step(*args, **kwargs)
        if len(calls) == 1:  # the second call: the logits of step 1
            logits.data[beams * 1] = np.nan  # sequence 1 (its first beam)
        calls.append(None)
        return logits
    model.decode_step = with_nan
    with pytest.raises(ValueError, match=rf"{decode.__name__}: step 1: .*batch rows \[1\] hold NaN"):
        decode(model, src, 6, eos=None)


def test_a_huge_max_len_costs_only_what_is_produced():
    """Issue 29 item 8 for greedy_decode: its output (B, max_len) was allocated up front."""
    manual_seed(0)
    model = Seq2SeqTransformer(12, 12, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, pad_idx=PAD, positional="rope").eval()
    src = _sources()[:1]
    eos = int(greedy_decode(model, src, 1, eos=None)[0, 0])
    tracemalloc.start()
    try:
        out = greedy_decode(model, src, 10**9, eos=eos)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.tolist() == [[eos]] and peak < 2**22, f"peak {peak} bytes"
