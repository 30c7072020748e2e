"""Every mistake of the seed articles' troubleshooting table, made on purpose at the public API
(models, nn, F, checkpoints, autograd): one table of (case, call, exception type, key words).
Each message must name the argument and say what was expected and what came instead; the
key words are one regex searched in the message (re.DOTALL, so `.*` spans lines)."""
import json
import re

import numpy as np
import pytest

import autograd
import npformer
import npformer.functional as F
from autograd import Tensor
from npformer import decoding, nn, optim
from npformer.checkpoint import CheckpointError
from npformer.data import SequenceTask
from npformer.models import CausalLM, EncoderClassifier, Seq2SeqTransformer
from npformer.runtime import threads

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


def lm(**overrides):
    return CausalLM(10, **{"d_model": 8, "nhead": 2, "num_layers": 1, "dim_feedforward": 16, **overrides})


def params():
    return nn.Linear(3, 2).parameters()


def optimizer():
    return optim.SGD(params(), lr=0.1)


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
     r"linear: expected one floating dtype, got \['float32', 'float64'\].*\.float\(\)/\.double\(\)"),
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
    # -- numbers: bools, strings and floats where a number or an integer is expected -------------------------
    ("d_model_bool", lambda _: seq2seq(d_model=True), TypeError,
     r"Seq2SeqTransformer: d_model must be an integer >= 1, got True \(a bool, not a number\)"),
    ("pad_idx_float", lambda _: seq2seq(pad_idx=1.5), TypeError,
     r"Seq2SeqTransformer: pad_idx must be an integer in \[0, 9\], got 1\.5 of type float"),
    ("pad_idx_bool", lambda _: seq2seq(pad_idx=True), TypeError, r"pad_idx must be an integer .*got True \(a bool"),
    ("pad_idx_outside_the_vocabulary", lambda _: seq2seq(pad_idx=10), ValueError,
     r"Seq2SeqTransformer: pad_idx must be an integer in \[0, 9\], got 10"),
    ("lm_pad_idx_float", lambda _: lm(pad_idx=1.5), TypeError, r"CausalLM: pad_idx must be an integer in \[0, 9\]"),
    ("lm_dropout_string", lambda _: lm(dropout="0.1"), TypeError,
     r"CausalLM: dropout must be a real number in \[0, 1\], got '0\.1' of type str"),
    ("classifier_num_classes_float", lambda _: EncoderClassifier(10, 2.0, d_model=8, nhead=2, num_layers=1),
     TypeError, r"EncoderClassifier: num_classes must be an integer >= 1, got 2\.0 of type float"),
    ("seq2seq_max_len_zero", lambda _: seq2seq(max_len=0), ValueError,
     r"Seq2SeqTransformer: max_len must be an integer >= 1, got 0"),
    ("seq2seq_layer_norm_eps_zero", lambda _: seq2seq(layer_norm_eps=0.0), ValueError,
     r"Seq2SeqTransformer: layer_norm_eps must be a finite real number > 0, got 0\.0"),
    ("transformer_zero_encoder_layers", lambda _: nn.Transformer(**{**SMALL, "num_encoder_layers": 0}), ValueError,
     r"Transformer: num_encoder_layers must be an integer >= 1, got 0"),
    ("encoder_layer_dim_feedforward_float", lambda _: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16.0),
     TypeError, r"TransformerEncoderLayer: dim_feedforward must be an integer >= 1, got 16\.0 of type float"),
    ("linear_in_features_float", lambda _: nn.Linear(3.0, 4), TypeError,
     r"Linear: in_features must be an integer >= 1, got 3\.0 of type float"),
    ("embedding_padding_idx_float", lambda _: nn.Embedding(5, 3, padding_idx=1.5), TypeError,
     r"Embedding: padding_idx must be an integer in \[-5, 4\], got 1\.5 of type float"),
    ("layer_norm_module_eps_string", lambda _: nn.LayerNorm(8, eps="1e-5"), TypeError,
     r"LayerNorm: eps must be a finite real number > 0, got '1e-5' of type str"),
    ("dropout_module_p_string", lambda _: nn.Dropout("0.1"), TypeError,
     r"Dropout: p must be a real number in \[0, 1\], got '0\.1' of type str"),
    ("dropout_module_p_numpy_out_of_range", lambda _: nn.Dropout(np.float32(1.5)), ValueError,
     r"Dropout: p must be a real number in \[0, 1\], got 1\.5"),
    ("attention_dropout_bool", lambda _: nn.MultiheadAttention(8, 2, dropout=True), TypeError,
     r"MultiheadAttention: dropout must be a real number in \[0, 1\], got True \(a bool"),
    ("generate_square_subsequent_mask_float", lambda _: nn.Transformer.generate_square_subsequent_mask(4.0),
     TypeError, r"generate_square_subsequent_mask: sz must be an integer >= 1, got 4\.0"),
    ("init_normal_std_string", lambda _: nn.init.normal_(nn.Linear(3, 2).weight, std="1"), TypeError,
     r"normal_: std must be a finite real number >= 0, got '1' of type str"),
    ("set_num_threads_string", lambda _: threads.set_num_threads("2"), TypeError,
     r"set_num_threads: n must be an integer >= 1, got '2' of type str"),
    ("manual_seed_float", lambda _: npformer.manual_seed(1.5), TypeError,
     r"manual_seed: seed must be an integer >= 0, got 1\.5 of type float"),
    ("manual_seed_negative", lambda _: npformer.manual_seed(-1), ValueError,
     r"manual_seed: seed must be an integer >= 0, got -1"),
    # -- numbers of the functional ops ------------------------------------------------------------------------
    ("cross_entropy_label_smoothing_string", lambda _: F.cross_entropy(floats(2, 3), ids(2, value=1),
                                                                       label_smoothing="0.1"),
     TypeError, r"cross_entropy: label_smoothing must be a real number in \[0, 1\], got '0\.1' of type str"),
    ("cross_entropy_label_smoothing_bool", lambda _: F.cross_entropy(floats(2, 3), ids(2, value=1),
                                                                     label_smoothing=True),
     TypeError, r"label_smoothing must be a real number in \[0, 1\], got True \(a bool, not a number\)"),
    ("cross_entropy_ignore_index_float", lambda _: F.cross_entropy(floats(2, 3), ids(2, value=1), ignore_index=1.5),
     TypeError, r"cross_entropy: ignore_index must be an integer, got 1\.5 of type float"),
    ("cross_entropy_weight_requires_grad", lambda _: F.cross_entropy(
        floats(2, 3), ids(2, value=1), weight=Tensor(np.ones(3, np.float32), requires_grad=True)), RuntimeError,
     r"cross_entropy: weight requires grad, but the class weights are constants.*weight\.detach\(\)"),
    ("softmax_dim_float", lambda _: F.softmax(floats(2, 3), dim=1.0), TypeError,
     r"softmax: dim must be an integer, got 1\.0 of type float"),
    ("log_softmax_0d_dim_1", lambda _: F.log_softmax(floats(), dim=1), IndexError,
     r"log_softmax: dim out of range: expected in \[-1, 0\], got 1"),
    ("layer_norm_eps_string", lambda _: F.layer_norm(floats(2, 4), 4, eps="1e-5"), TypeError,
     r"layer_norm: eps must be a finite real number > 0, got '1e-5' of type str"),
    ("embedding_padding_idx_bool", lambda _: F.embedding(ids(2), floats(5, 3), padding_idx=True), TypeError,
     r"embedding: padding_idx must be an integer in \[-5, 4\], got True \(a bool"),
    ("sdpa_dropout_p_string", lambda _: sdpa(dropout_p="0.1"), TypeError,
     r"scaled_dot_product_attention: dropout_p must be a real number in \[0, 1\], got '0\.1' of type str"),
    ("sdpa_scale_string", lambda _: sdpa(scale="0.5"), TypeError,
     r"scaled_dot_product_attention: scale must be a finite real number, got '0\.5' of type str"),
    ("sdpa_block_size_float", lambda _: sdpa(memory_efficient=True, block_size=2.0), TypeError,
     r"scaled_dot_product_attention: block_size must be an integer >= 1, got 2\.0 of type float"),
    ("split_heads_chunks_bool", lambda _: F.split_heads(floats(2, 4, 12), 2, chunks=True), TypeError,
     r"split_heads: chunks must be an integer >= 1, got True \(a bool"),
    ("rotary_cos_sin_head_dim_float", lambda _: F.rotary_cos_sin(4, 8.0), TypeError,
     r"rotary_cos_sin: head_dim must be an integer >= 1, got 8\.0 of type float"),
    # -- numbers of decoding, optimizers, schedulers, clipping and data ----------------------------------------
    ("greedy_decode_max_len_bool", lambda _: decoding.greedy_decode(seq2seq(), ids(1, 3), max_len=True), TypeError,
     r"greedy_decode: max_len must be an integer >= 1, got True \(a bool, not a number\)"),
    ("greedy_decode_eos_float", lambda _: decoding.greedy_decode(seq2seq(), ids(1, 3), max_len=3, eos=2.0),
     TypeError, r"greedy_decode: eos must be an integer in \[0, \d+\], got 2\.0 of type float"),
    ("beam_search_beam_size_bool", lambda _: decoding.beam_search(seq2seq(), ids(1, 3), max_len=3, beam_size=True),
     TypeError, r"beam_search: beam_size must be an integer >= 1, got True"),
    ("beam_search_length_penalty_string",
     lambda _: decoding.beam_search(seq2seq(), ids(1, 3), max_len=3, length_penalty="1"), TypeError,
     r"beam_search: length_penalty must be a finite real number, got '1' of type str"),
    ("adam_lr_string", lambda _: optim.Adam(params(), lr="1e-3"), TypeError,
     r"Adam: lr must be a finite real number >= 0, got '1e-3' of type str"),
    ("adamw_beta_bool", lambda _: optim.AdamW(params(), betas=(0.9, True)), TypeError,
     r"AdamW: betas\[1\] must be a real number in \[0, 1\), got True \(a bool"),
    ("adam_betas_number", lambda _: optim.Adam(params(), betas=0.9), TypeError,
     r"Adam: betas must be a pair \(beta1, beta2\), got 0\.9"),
    ("sgd_momentum_string_with_nesterov", lambda _: optim.SGD(params(), momentum="0.9", nesterov=True), TypeError,
     r"SGD: momentum must be a finite real number >= 0, got '0\.9' of type str"),
    ("noam_d_model_string", lambda _: optim.NoamLR(optimizer(), d_model="512"), TypeError,
     r"NoamLR: d_model must be an integer >= 1, got '512' of type str"),
    ("warmup_cosine_warmup_float", lambda _: optim.WarmupCosineLR(optimizer(), warmup_steps=1.5, total_steps=10),
     TypeError, r"WarmupCosineLR: warmup_steps must be an integer >= 0, got 1\.5 of type float"),
    ("warmup_cosine_total_below_warmup", lambda _: optim.WarmupCosineLR(optimizer(), warmup_steps=20, total_steps=10),
     ValueError, r"WarmupCosineLR: total_steps must be >= warmup_steps=20, got 10"),
    ("clip_grad_norm_max_norm_string", lambda _: optim.clip_grad_norm_(params(), "1.0"), TypeError,
     r"clip_grad_norm_: max_norm must be a real number >= 0, got '1\.0' of type str"),
    ("sequence_task_vocab_size_float", lambda _: SequenceTask(vocab_size=20.5), TypeError,
     r"SequenceTask: vocab_size .*must be an integer >= 5, got 20\.5 of type float"),
    ("sequence_task_batch_size_bool", lambda _: SequenceTask(heldout_size=10).batch(True), TypeError,
     r"SequenceTask\.batch: batch_size must be an integer >= 1, got True \(a bool"),
    # -- ragged lists where an array is expected ------------------------------------------------------------------
    ("ragged_src_ids", lambda _: seq2seq()([[3, 4], [5]], ids(2, 2)), ValueError,
     r"Seq2SeqTransformer: src must be a rectangular array \(every row of the same length\), got a ragged list "
     r"with rows of lengths 2, 1"),
    ("ragged_lm_ids", lambda _: lm()([[3, 4, 5], [5]]), ValueError,
     r"CausalLM: input_ids must be a rectangular array .*rows of lengths 3, 1"),
    ("ragged_greedy_decode_src", lambda _: decoding.greedy_decode(seq2seq(), [[3, 4], [5]], max_len=3), ValueError,
     r"greedy_decode: src must be a rectangular array .*rows of lengths 2, 1"),
    ("ragged_cross_entropy_target", lambda _: F.cross_entropy(floats(2, 2, 3), [[1, 2], [1]]), ValueError,
     r"cross_entropy: target must be a rectangular array .*rows of lengths 2, 1"),
    ("ragged_key_padding_mask", lambda _: mha(key_padding_mask=[[False] * 4, [False] * 3]), ValueError,
     r"key_padding_mask must be a rectangular array .*rows of lengths 4, 3"),
    ("ragged_tensor_data", lambda _: Tensor([[1.0, 2.0], [3.0]]), ValueError,
     r"Tensor: data must be a rectangular array .*rows of lengths 2, 1"),
]



# -- custom autograd Functions: what a backward or forward returns -------------------------------------------
class MultiplyBy(autograd.Function):
    """out = x * w (w broadcast over x); `backward_returns(dy, x, w)` is the mistake under test."""

    backward_returns = None

    @classmethod
    def forward(cls, ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @classmethod
    def backward(cls, ctx, dy):
        x, w = ctx.saved_tensors
        return cls.backward_returns(dy, x, w)


def backward_returning(returns, x_shape=(2, 3, 5), w_shape=(5,), device="cpu", check=False):
    """Backpropagate through a MultiplyBy whose backward returns `returns(dy, x, w)` (float32 inputs;
    check=True: through autograd.gradcheck, in float64)."""
    op = type("MultiplyBy", (MultiplyBy,), {"backward_returns": staticmethod(returns)})
    dtype = np.float64 if check else np.float32
    x = Tensor(np.ones(x_shape, dtype), requires_grad=True, device=device)
    w = Tensor(np.ones(w_shape, dtype), requires_grad=True, device=device)
    if check:
        autograd.gradcheck(op.apply, [x, w])
    op.apply(x, w).sum().backward()


class ReturnsTensor(autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return Tensor(x * 2)

    @staticmethod
    def backward(ctx, dy):
        return dy * 2


class ReturnsList(autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return [x, x]

    @staticmethod
    def backward(ctx, dy):
        return dy


CASES += [
    ("backward_returns_fewer_gradients", lambda _: backward_returning(lambda dy, x, w: dy * w), RuntimeError,
     r"function test_errors\.MultiplyBy returned an incorrect number of gradients \(expected 2, got 1\)"),
    ("backward_returns_one_too_many", lambda _: backward_returning(lambda dy, x, w: (dy * w, dy * x, dy)),
     RuntimeError, r"MultiplyBy returned an incorrect number of gradients \(expected 2, got 3\)"),
    ("backward_gradient_of_a_transposed_shape",
     lambda _: backward_returning(lambda dy, x, w: (dy * w, (dy * x).T), x_shape=(3, 5), w_shape=(3, 5)),
     RuntimeError, r"Function test_errors\.MultiplyBy returned an invalid gradient at index 1 - got shape "
                   r"\(5, 3\) but expected shape compatible with \(3, 5\)"),
    ("backward_gradient_broadcastable_but_not_reducible",
     lambda _: backward_returning(lambda dy, x, w: (dy * w, (dy * x)[:1]), x_shape=(3, 5), w_shape=(3, 5)),
     RuntimeError, r"invalid gradient at index 1 - got shape \(1, 5\) but expected shape compatible with \(3, 5\)"),
    ("backward_gradient_float64_for_float32",
     lambda _: backward_returning(lambda dy, x, w: (dy * w, (dy * x).sum(axis=(0, 1)).astype(np.float64))),
     RuntimeError, r"MultiplyBy returned an invalid gradient at index 1 - expected dtype float32 but got float64"),
    ("backward_gradient_on_another_device",
     lambda _: backward_returning(lambda dy, x, w: (dy * w, np.ones(5, np.float32)), device="test"), RuntimeError,
     r"MultiplyBy returned an invalid gradient at index 1 - expected device 'test' but got 'cpu'"),
    ("backward_returns_a_tensor", lambda _: backward_returning(lambda dy, x, w: (Tensor(dy * w), None)),
     RuntimeError, r"invalid gradient at index 0 - got a Tensor: backward works on raw arrays .*`\.data`"),
    ("backward_returns_a_python_float", lambda _: backward_returning(lambda dy, x, w: (dy * w, 1.0)),
     RuntimeError, r"invalid gradient at index 1 - got float: expected an array of shape \(5,\) or None"),
    ("gradcheck_names_a_wrong_gradient_shape",
     lambda _: backward_returning(lambda dy, x, w: (dy * w, (dy * x).T), x_shape=(3, 5), w_shape=(3, 5),
                                  check=True),
     RuntimeError, r"MultiplyBy returned an invalid gradient at index 1 - got shape \(5, 3\)"),
    ("forward_returns_a_tensor", lambda _: ReturnsTensor.apply(floats(3)), TypeError,
     r"test_errors\.ReturnsTensor\.forward returned a Tensor as output 0: .*return arrays \(use `\.data`"),
    ("forward_returns_a_list", lambda _: ReturnsList.apply(floats(3)), TypeError,
     r"ReturnsList\.forward returned list as output 0: expected an array, or a tuple of arrays"),
    ("gradcheck_of_raw_numpy_inputs", lambda _: autograd.gradcheck(F.relu, [np.ones(3)]), ValueError,
     r"gradcheck: no input has requires_grad=True; input\(s\) \[0\] are raw arrays.*"
     r"wrap them: Tensor\(x, requires_grad=True\)"),
    ("gradcheck_of_tensors_without_requires_grad", lambda _: autograd.gradcheck(F.relu, [floats(3)]), ValueError,
     r"no input has requires_grad=True; create the inputs to check with Tensor\(x, requires_grad=True\)"),
]

@pytest.mark.parametrize("call, error, pattern", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_raises_a_clear_error(call, error, pattern, tmp_path):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert re.search(pattern, str(info.value), re.DOTALL), f"{pattern!r} not found in:\n{info.value}"



# -- numpy scalars are numbers: accepted wherever a Python int or float is, and stored as one --------------
i64, f32 = np.int64, np.float32


def check_numpy_scalars_model():
    model = Seq2SeqTransformer(i64(10), i64(12), d_model=i64(8), nhead=i64(2), num_encoder_layers=i64(1),
                               num_decoder_layers=i64(1), dim_feedforward=i64(16), dropout=f32(0.1), max_len=i64(6),
                               pad_idx=i64(0), layer_norm_eps=np.float64(1e-5))
    json.dumps(model.config)                                      # plain ints and floats: the checkpoint's config
    assert model(ids(1, 3), ids(1, 2)).shape == (1, 2, 12)
    return model


def check_numpy_scalars_layers():
    assert nn.Linear(i64(3), i64(4))(floats(2, 3)).shape == (2, 4)
    assert nn.Embedding(i64(5), i64(3), padding_idx=i64(0))(ids(2, value=1)).shape == (2, 3)
    assert nn.LayerNorm(i64(8), eps=f32(1e-5)).normalized_shape == (8,)
    assert type(nn.Dropout(f32(0.25)).p) is float
    assert nn.MultiheadAttention(i64(8), i64(2), dropout=f32(0.1)).head_dim == 4
    assert nn.Transformer(d_model=i64(8), nhead=i64(2), num_encoder_layers=i64(1), num_decoder_layers=i64(1),
                          dim_feedforward=i64(16), dropout=f32(0.0)).d_model == 8
    assert nn.Transformer.generate_square_subsequent_mask(i64(3)).shape == (3, 3)
    assert lm(d_model=i64(8), nhead=i64(2), max_len=i64(8)).config["max_len"] == 8


def check_numpy_scalars_functional():
    F.cross_entropy(floats(3, 4), ids(3, value=1), ignore_index=i64(0), label_smoothing=f32(0.1))
    F.softmax(floats(2, 3), dim=i64(-1))
    F.layer_norm(floats(2, 4), i64(4), eps=f32(1e-5))
    F.split_heads(floats(2, 4, 8), i64(2))
    sdpa(memory_efficient=True, block_size=i64(2), dropout_p=np.float64(0.0), scale=f32(0.5))
    F.rotary_cos_sin(i64(4), i64(8), base=f32(100.0))


def check_numpy_scalars_training():
    model = check_numpy_scalars_model()
    decoding.beam_search(model, ids(1, 3), max_len=i64(3), beam_size=i64(2), length_penalty=f32(0.6))
    decoding.greedy_decode(model, ids(1, 3), max_len=i64(3), eos=i64(2))
    opt = optim.Adam(model.parameters(), lr=f32(1e-3), betas=(f32(0.9), np.float64(0.98)), eps=f32(1e-9))
    assert type(opt.param_groups[0]["lr"]) is float and all(type(b) is float for b in opt.param_groups[0]["betas"])
    optim.NoamLR(opt, d_model=i64(8), warmup_steps=i64(4))
    optim.WarmupCosineLR(optim.SGD(params(), lr=f32(0.1), momentum=f32(0.9)), i64(2), i64(10), min_ratio=f32(0.1))
    optim.clip_grad_norm_(model.parameters(), f32(1.0), norm_type=i64(2))
    SequenceTask(vocab_size=i64(10), min_len=i64(3), heldout_size=i64(5), seed=i64(1)).batch(i64(2))
    saved = threads.get_num_threads()
    try:
        threads.set_num_threads(i64(2))
        assert threads.get_num_threads() == 2
    finally:
        threads.set_num_threads(saved)


@pytest.mark.parametrize("check", [check_numpy_scalars_model, check_numpy_scalars_layers,
                                   check_numpy_scalars_functional, check_numpy_scalars_training],
                         ids=lambda f: f.__name__)
def test_numpy_scalars_are_accepted_as_numbers(check):
    check()
