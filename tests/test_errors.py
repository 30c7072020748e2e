"""Every mistake of the seed articles' troubleshooting table, made on purpose at the public API
(models, nn, F, checkpoints, autograd): one table of (case, call, exception type, key words).
Each message must name the argument and say what was expected and what came instead; the
key words are one regex searched in the message (re.DOTALL, so `.*` spans lines)."""
import re

import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor
from npformer import decoding, nn, optim
from npformer.checkpoint import CheckpointError
from npformer.models import CausalLM, Seq2SeqTransformer

SMALL = dict(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0)


def seq2seq(**overrides):
    """src vocabulary 10, tgt vocabulary 12, sinusoidal positions up to max_len=6, float32."""
    return Seq2SeqTransformer(10, 12, **{**SMALL, "max_len": 6, **overrides})


def ids(*shape, value=3):
    return np.full(shape, value, dtype=np.int64)


def floats(*shape, dtype=np.float32, device="cpu"):
    return Tensor(np.zeros(shape, dtype=dtype), device=device)


def mha(**kwargs):
    """A call of MultiheadAttention(8 features, 2 heads) on (2, 4, 8) self-attention inputs."""
    x = floats(2, 4, 8)
    return nn.MultiheadAttention(8, 2)(x, x, x, **kwargs)


def sdpa(q_shape=(2, 2, 4, 8), k_shape=(2, 2, 4, 8), v_shape=(2, 2, 4, 8), **kwargs):
    return F.scaled_dot_product_attention(floats(*q_shape), floats(*k_shape), floats(*v_shape), **kwargs)


def decode_past_max_len():
    """Cached decoding one step beyond the positional table (max_len=6 positions)."""
    model = seq2seq()
    cache = model.init_cache(model.encode(ids(1, 3)))
    for _ in range(7):
        model.decode_step(ids(1), cache)


def load_mismatched_state_dict():
    """One key missing, one unexpected, one of the wrong shape: all three in one error."""
    state = seq2seq().state_dict()
    del state["generator.bias"]
    state["extra.weight"] = np.zeros(3)
    state["src_embed.weight"] = np.zeros((11, 8))
    seq2seq().load_state_dict(state)


def load_damaged_checkpoint(tmp_path, damage):
    """Save a real checkpoint, damage its bytes with `damage(bytes, rng) -> bytes`, load it."""
    path = tmp_path / "ck.npz"
    npformer.save_checkpoint(path, seq2seq(), step=1)
    path.write_bytes(damage(path.read_bytes(), np.random.default_rng(0)))
    npformer.load_checkpoint(path)


def load_checkpoint_of_another_model(tmp_path):
    path = npformer.save_checkpoint(tmp_path / "ck.npz", seq2seq(d_model=16))
    npformer.load_checkpoint(path, seq2seq())


def random_bytes(data, rng):
    return rng.bytes(len(data))


def overwrite_middle(data, rng):
    """The zip directory stays intact; an array's stored bytes change (its CRC no longer matches)."""
    middle = len(data) // 2
    return data[:middle] + rng.bytes(64) + data[middle + 64:]


def cross_entropy_every_target_pad(**kwargs):
    """A batch in which every target is padding, with the loss a trainer computes."""
    return F.cross_entropy(floats(6, 12), ids(6, value=0), ignore_index=0, **kwargs)


CASES = [
    # -- token ids ----------------------------------------------------------------------------------
    ("src_id_equal_to_vocab", lambda _: seq2seq()(np.array([[3, 10]]), ids(1, 2)), IndexError,
     r"Seq2SeqTransformer: src token ids must be in \[0, 9\] \(vocabulary size 10\), got min 3 and max 10"),
    ("tgt_id_above_its_own_vocab", lambda _: seq2seq()(ids(1, 2), np.array([[1, 12]])), IndexError,
     r"tgt token ids must be in \[0, 11\] \(vocabulary size 12\), got min 1 and max 12"),
    ("negative_src_id", lambda _: seq2seq()(np.array([[3, -1]]), ids(1, 2)), IndexError,
     r"src token ids must be in \[0, 9\].*got min -1"),
    ("lm_id_above_vocab", lambda _: CausalLM(10, d_model=8, nhead=2, num_layers=1)(np.array([[1, 10]])),
     IndexError, r"CausalLM: input_ids token ids must be in \[0, 9\].*max 10"),
    ("embedding_module_id_above_vocab", lambda _: nn.Embedding(5, 3)(np.array([1, 5])), IndexError,
     r"\[0, 4\] \(num_embeddings=5\), got min 1 and max 5"),
    ("float_src_ids", lambda _: seq2seq()(np.array([[3.0, 1.0]]), ids(1, 2)), TypeError,
     r"Seq2SeqTransformer: src must hold integer token ids, got dtype float64"),
    ("float_tgt_ids_as_tensor", lambda _: seq2seq()(ids(1, 2), floats(1, 2)), TypeError,
     r"tgt must hold integer token ids, got dtype float32"),
    ("float_ids_into_embedding", lambda _: nn.Embedding(5, 3)(Tensor(np.array([1.0, 2.0]))), TypeError,
     r"Embedding: input must hold integer token ids, got dtype float64"),
    # -- longer than the positional table -----------------------------------------------------------
    ("src_longer_than_max_len", lambda _: seq2seq()(ids(1, 7), ids(1, 2)), ValueError,
     r"src has 7 positions but max_len=6"),
    ("tgt_longer_than_max_len", lambda _: seq2seq(positional="learned")(ids(1, 2), ids(1, 9)), ValueError,
     r"tgt has 9 positions but max_len=6"),
    ("lm_input_longer_than_max_len", lambda _: CausalLM(10, d_model=8, nhead=2, num_layers=1, max_len=5)(ids(1, 6)),
     ValueError, r"input_ids has 6 positions but max_len=5"),
    ("cached_decoding_past_max_len", lambda _: decode_past_max_len(), ValueError,
     r"positions \[6, 7\) exceed max_len=6"),
    # -- d_model % nhead ------------------------------------------------------------------------------
    ("seq2seq_d_model_not_divisible", lambda _: seq2seq(d_model=10, nhead=3), ValueError,
     r"Seq2SeqTransformer: d_model=10 is not divisible by nhead=3.*nhead in \[1, 2, 5, 10\]"),
    ("lm_d_model_not_divisible", lambda _: CausalLM(10, d_model=8, nhead=3), ValueError,
     r"CausalLM: d_model=8 is not divisible by nhead=3"),
    ("transformer_d_model_not_divisible", lambda _: nn.Transformer(d_model=12, nhead=5), ValueError,
     r"Transformer: d_model=12 is not divisible by nhead=5"),
    ("attention_embed_dim_not_divisible", lambda _: nn.MultiheadAttention(10, 4), ValueError,
     r"embed_dim=10 must be divisible by num_heads=4"),
    # -- masks: shape and dtype -------------------------------------------------------------------------
    ("attn_mask_shape", lambda _: mha(attn_mask=np.zeros((4, 5), bool)), ValueError,
     r"attn_mask must have shape \(4, 4\) or \(4, 4, 4\).*got \(4, 5\)"),
    ("attn_mask_int_dtype", lambda _: mha(attn_mask=np.zeros((4, 4), np.int64)), TypeError,
     r"attn_mask must be a bool or floating mask, got dtype int64"),
    ("key_padding_mask_transposed", lambda _: mha(key_padding_mask=np.zeros((4, 2), bool)), ValueError,
     r"key_padding_mask must have shape \(batch, S\) = \(2, 4\), got \(4, 2\)"),
    ("key_padding_mask_int_dtype", lambda _: mha(key_padding_mask=np.zeros((2, 4), np.int32)), TypeError,
     r"key_padding_mask must be a bool or floating mask, got dtype int32"),
    ("src_key_padding_mask_shape",
     lambda _: seq2seq()(ids(2, 3), ids(2, 2), src_key_padding_mask=np.zeros((2, 4), bool)), ValueError, r"src_key_padding_mask must have shape \(batch, S\) = \(2, 3\), got \(2, 4\)"),
    ("tgt_key_padding_mask_of_ints", lambda _: seq2seq()(ids(2, 3), ids(2, 2), tgt_key_padding_mask=[[0, 1], [0, 0]]),
     TypeError, r"tgt_key_padding_mask must be a bool or floating mask, got dtype int64"),
    ("transformer_tgt_mask_shape",
     lambda _: nn.Transformer(**SMALL)(floats(2, 5, 8), floats(2, 4, 8), tgt_mask=np.zeros((5, 5), bool)),
     ValueError, r"tgt_mask must have shape \(4, 4\).*got \(5, 5\)"),
    ("sdpa_attn_mask_shape", lambda _: sdpa(attn_mask=np.ones((3, 4), bool)), ValueError,
     r"attn_mask must broadcast to \(\.\.\., Tq, Tk\) = \(2, 2, 4, 4\), got shape \(3, 4\)"),
    ("sdpa_attn_mask_5d", lambda _: sdpa(attn_mask=np.ones((1, 2, 2, 4, 4), bool)), ValueError,
     r"attn_mask must broadcast to .*got shape \(1, 2, 2, 4, 4\)"),
    ("sdpa_attn_mask_int_dtype", lambda _: sdpa(attn_mask=np.ones((4, 4), np.int64)), TypeError,
     r"attn_mask must be bool \(True = takes part\) or floating .*got dtype int64"),
    # -- batch sizes ---------------------------------------------------------------------------------------
    ("src_tgt_batch_mismatch", lambda _: seq2seq()(ids(2, 3), ids(3, 2)), ValueError,
     r"src and tgt batch sizes differ: 2 vs 3"),
    ("transformer_src_tgt_batch_mismatch", lambda _: nn.Transformer(**SMALL)(floats(2, 3, 8), floats(3, 3, 8)),
     ValueError, r"batch sizes of src \(2\) and tgt \(3\) must be equal"),
    ("decode_memory_batch_mismatch", lambda _: seq2seq().decode(ids(3, 2), floats(2, 3, 8)), ValueError,
     r"batch sizes of tgt \(3\) and memory \(2\) must be equal"),
    ("attention_query_key_batch_mismatch", lambda _: nn.MultiheadAttention(8, 2)(floats(2, 4, 8), floats(3, 4, 8),
                                                                                floats(3, 4, 8)),
     ValueError, r"batch sizes differ: query 2, key 3, value 3"),
    # -- empty batches and zero-length sequences -----------------------------------------------------------
    ("empty_batch", lambda _: seq2seq()(ids(0, 3), ids(0, 2)), ValueError,
     r"src must be a non-empty \(batch, seq\) array of token ids, got shape \(0, 3\)"),
    ("zero_length_src", lambda _: seq2seq()(ids(2, 0), ids(2, 2)), ValueError,
     r"src must be a non-empty \(batch, seq\) array .*got shape \(2, 0\)"),
    ("zero_length_tgt", lambda _: seq2seq()(ids(2, 3), ids(2, 0)), ValueError,
     r"tgt must be a non-empty \(batch, seq\) array .*got shape \(2, 0\)"),
    ("lm_empty_batch", lambda _: CausalLM(10, d_model=8, nhead=2, num_layers=1)(ids(0, 4)), ValueError,
     r"input_ids must be a non-empty \(batch, seq\) array .*got shape \(0, 4\)"),
    ("transformer_zero_length_src", lambda _: nn.Transformer(**SMALL)(floats(2, 0, 8), floats(2, 3, 8)),
     ValueError, r"Transformer: src must have at least one position \(seq >= 1\), got shape \(2, 0, 8\)"),
    ("attention_zero_length_key", lambda _: nn.MultiheadAttention(8, 2)(floats(2, 3, 8), floats(2, 0, 8),
                                                                       floats(2, 0, 8)),
     ValueError, r"key and value must have at least one position \(S >= 1\), got shape \(2, 0, 8\)"),
    # -- q, k, v dimensions ----------------------------------------------------------------------------------
    ("sdpa_query_1d", lambda _: sdpa(q_shape=(8,)), ValueError,
     r"query, key and value must be at least 2-D \(\.\.\., T, head_dim\), got shapes \(8,\), \(2, 2, 4, 8\)"),
    ("sdpa_value_1d", lambda _: sdpa(v_shape=(4,)), ValueError, r"at least 2-D .*\(2, 2, 4, 8\), \(4,\)"),
    ("sdpa_key_head_dim_differs", lambda _: sdpa(k_shape=(2, 2, 4, 6)), ValueError,
     r"expected query \(\.\.\., Tq, hd\), key \(\.\.\., Tk, hd\).*\(2, 2, 4, 8\), \(2, 2, 4, 6\)"),
    ("sdpa_3d_key_against_4d_query", lambda _: sdpa(k_shape=(3, 4, 8), v_shape=(3, 4, 8)), ValueError,
     r"leading \(batch, head\) dimensions .* must broadcast, got shapes \(2, 2, 4, 8\), \(3, 4, 8\)"),
    ("attention_query_2d", lambda _: nn.MultiheadAttention(8, 2)(floats(4, 8), floats(2, 4, 8), floats(2, 4, 8)),
     ValueError, r"query must be \(batch, seq, 8\), got \(4, 8\)"),
    # -- state dicts and checkpoints --------------------------------------------------------------------------
    ("load_state_dict_lists_every_problem", lambda _: load_mismatched_state_dict(), RuntimeError,
     r"Seq2SeqTransformer:.*missing keys \(1\): generator\.bias.*unexpected keys \(1\): extra\.weight"
     r".*mis-shaped keys \(1\): src_embed\.weight: checkpoint \(11, 8\), model \(10, 8\)"),
    ("checkpoint_of_another_model", load_checkpoint_of_another_model, RuntimeError,
     r"mis-shaped keys \(\d+\): src_embed\.weight: checkpoint \(10, 16\), model \(10, 8\)"),
    ("truncated_checkpoint", lambda tmp: load_damaged_checkpoint(tmp, lambda data, _: data[: len(data) // 2]),
     CheckpointError, r"ck\.npz: not a readable npformer checkpoint, the file is truncated or corrupted"),
    ("empty_checkpoint_file", lambda tmp: load_damaged_checkpoint(tmp, lambda data, _: b""), CheckpointError,
     r"ck\.npz: .*truncated or corrupted"),
    ("random_bytes_checkpoint", lambda tmp: load_damaged_checkpoint(tmp, random_bytes), CheckpointError,
     r"ck\.npz: .*truncated or corrupted"),
    ("checkpoint_with_corrupted_array", lambda tmp: load_damaged_checkpoint(tmp, overwrite_middle), CheckpointError,
     r"ck\.npz: .*truncated or corrupted"),
    # -- devices and dtypes mixed in one op ----------------------------------------------------------------------
    ("float64_input_to_float32_linear", lambda _: nn.Linear(8, 3)(floats(2, 8, dtype=np.float64)), TypeError,
     r"LinearFunction: expected one floating dtype, got \['float32', 'float64'\].*\.float\(\)/\.double\(\)"),
    ("float64_memory_to_float32_model", lambda _: seq2seq().decode(ids(2, 2), floats(2, 3, 8, dtype=np.float64)),
     TypeError, r"expected one floating dtype, got \['float32', 'float64'\]"),
    ("sdpa_float32_key_float64_query",
     lambda _: F.scaled_dot_product_attention(floats(2, 4, 8, dtype=np.float64), floats(2, 4, 8), floats(2, 4, 8)),
     TypeError, r"one floating dtype, got \['float32', 'float64'\]"),
    ("cpu_module_test_device_input", lambda _: nn.Linear(8, 3)(floats(2, 8, device="test")), RuntimeError,
     r"LinearFunction: expected all tensors on one device, got \['cpu', 'test'\]; move them with \.to\(device\)"),
    ("sdpa_key_on_another_device",
     lambda _: F.scaled_dot_product_attention(floats(2, 4, 8), floats(2, 4, 8, device="test"), floats(2, 4, 8)),
     RuntimeError, r"one device, got \['cpu', 'test'\]"),
    ("test_device_model_cpu_memory", lambda _: seq2seq().to("test").decode(ids(2, 2), floats(2, 3, 8)), RuntimeError,
     r"one device, got \['cpu', 'test'\]"),
    ("cross_entropy_target_on_another_device",
     lambda _: F.cross_entropy(floats(3, 4), Tensor(ids(3, value=1), device="test")), RuntimeError,
     r"cross_entropy: target is on device 'test' but the inputs are on 'cpu'"),
    # -- decoding, clipping and checkpoint paths -----------------------------------------------------------------
    ("greedy_decode_past_max_len", lambda _: decoding.greedy_decode(seq2seq(), ids(1, 3), max_len=7), ValueError,
     r"max_len: decoding 7 tokens needs 7 target positions but the model's positional table has max_len=6"),
    ("beam_search_past_max_len", lambda _: decoding.beam_search(seq2seq(), ids(1, 3), max_len=9), ValueError,
     r"max_len: decoding 9 tokens .*max_len=6"),
    ("greedy_decode_float_src", lambda _: decoding.greedy_decode(seq2seq(), np.ones((1, 3)), max_len=3), TypeError,
     r"src: expected integer token ids, got dtype float64"),
    ("clip_grad_norm_nan_max_norm", lambda _: optim.clip_grad_norm_(seq2seq().parameters(), float("nan")),
     ValueError, r"clip_grad_norm_: max_norm must be a real number >= 0, got nan"),
    ("load_checkpoint_from_a_directory", lambda tmp: npformer.load_checkpoint(tmp), IsADirectoryError, r"."),
    # -- cross-entropy with every target ignored ------------------------------------------------------------------
    ("cross_entropy_every_target_padding", lambda _: cross_entropy_every_target_pad(), ValueError,
     r"every target equals ignore_index=0, so the mean over valid targets is undefined.*reduction='sum'"),
    ("cross_entropy_no_targets", lambda _: F.cross_entropy(floats(0, 5), ids(0)), ValueError,
     r"cross_entropy: no targets \(input shape \(0, 5\)\), so the mean is undefined"),
    ("cross_entropy_zero_weight_on_every_target",
     lambda _: F.cross_entropy(floats(2, 3), np.array([1, 2]), weight=np.array([1.0, 0.0, 0.0], np.float32)),
     ValueError, r"class weights of every valid target are 0, so the weighted mean is undefined"),
    ("cross_entropy_every_target_padding_smoothed", lambda _: cross_entropy_every_target_pad(label_smoothing=0.1),
     ValueError, r"every target equals ignore_index=0"),
]


@pytest.mark.parametrize("call, error, pattern", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_raises_a_clear_error(call, error, pattern, tmp_path):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert re.search(pattern, str(info.value), re.DOTALL), f"{pattern!r} not found in:\n{info.value}"

