"""Autoregressive decoding: greedy and beam search for `Seq2SeqTransformer`; `generate`
(greedy or sampled, with temperature, top-k and top-p as Hugging Face defines them) for the
causal LM (`CausalLM`, e.g. GPT-2 from `load_pretrained`).

Both run with the model's KV cache (`init_cache` computes the cross-attention keys/values
of the memory once; `decode_step` appends one position of self-attention keys/values per
step), or, with `use_cache=False`, by re-running the decoder on the whole prefix at every
step (the seed tutorial's way). Both give the same tokens.

Outputs are int64 numpy arrays (B, L) of generated ids without the leading BOS; a sequence
that produced EOS keeps it and has PAD after it. L <= max_len; decoding stops early once
every sequence has finished.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from autograd import Tensor, backend
from autograd.backend import Array, ArrayLike
from autograd.checks import as_array, check_bool, check_int, check_optional_int, check_real
from npformer.runtime import random, threads
from . import functional as F
from .functional._common import check_index_range
from .data import BOS, EOS, PAD
from .nn import Module, inference_mode

__all__ = ["greedy_decode", "beam_search", "generate", "sample_logits", "top_k_filter", "top_p_filter"]


def _blas_threads(device):
    """On the CPU, this thread's ops run in the caller and numpy's BLAS threads the products
    (threads.blas_threads_in_caller). A decoding step multiplies a few rows by every weight
    matrix: BLAS's own threads run these matrix-vector products faster than npformer's split
    (BENCHMARKS.md, "Thresholds")."""
    return threads.blas_threads_in_caller() if device == "cpu" else contextlib.nullcontext()


def _source(model, src, src_key_padding_mask, owner):
    """src as a 2-D int array and its key padding mask as a host array (derived from pad ids when the
    model has pad_idx)."""
    src = src.data if isinstance(src, Tensor) else src
    src = backend.as_numpy(src) if backend.is_array(src) else as_array(src, "src", owner, np)
    if src.dtype.kind not in "iu":
        raise TypeError(f"{owner}: src: expected integer token ids, got dtype {src.dtype}")
    if src.ndim != 2:
        raise ValueError(f"{owner}: src: expected a 2-D array (B, S) of token ids, got shape {src.shape}")
    if src_key_padding_mask is None:
        pad_idx = (getattr(model, "config", None) or {}).get("pad_idx")
        if pad_idx is not None:
            src_key_padding_mask = src == pad_idx
        return src, src_key_padding_mask
    mask = src_key_padding_mask.data if isinstance(src_key_padding_mask, Tensor) else src_key_padding_mask
    mask = backend.as_numpy(mask) if backend.is_array(mask) else as_array(mask, "src_key_padding_mask", owner, np)
    if mask.shape != src.shape:
        raise ValueError(f"{owner}: src_key_padding_mask: expected shape {src.shape}, got {mask.shape}")
    return src, mask


def _check_max_len(model, max_len, owner):
    """max_len (an int >= 1) generated tokens need a positional table (learned, sinusoidal; rope and
    none have none) of at least max_len decoder positions."""
    max_len = check_int(max_len, "max_len", owner, at_least=1)
    config = getattr(model, "config", None) or {}
    table = config.get("max_len") if config.get("positional", "sinusoidal") in ("learned", "sinusoidal") else None
    if table is not None and max_len > table:
        raise ValueError(f"{owner}: max_len: decoding {max_len} tokens needs {max_len} target positions but the "
                         f"model's positional table has max_len={table}")
    return max_len


def _check_seq2seq(model, owner):
    """TypeError unless `model` has the encoder-decoder interface (Seq2SeqTransformer) decoding uses."""
    methods = ("encode", "decode", "init_cache", "decode_step")
    if not hasattr(model, "tgt_embed") or not all(callable(getattr(model, name, None)) for name in methods):
        raise TypeError(f"{owner}: expected an encoder-decoder model (npformer.models.Seq2SeqTransformer), got "
                        f"{type(model).__name__}; a causal LM continues prompts with npformer.decoding.generate")


def _check_special_ids(model, bos, eos, pad, owner):
    """bos and pad as ids of the model's target vocabulary (both are fed to the decoder), eos None or one."""
    last = model.tgt_embed.num_embeddings - 1
    return (check_int(bos, "bos", owner, at_least=0, at_most=last),
            check_optional_int(eos, "eos", owner, at_least=0, at_most=last),
            check_int(pad, "pad", owner, at_least=0, at_most=last))


def _log_probs(logits):
    """(N, V) Tensor of logits -> host array of log-probabilities."""
    return F.log_softmax(logits, dim=-1).numpy()


def _refuse_nan(scores, where, beams=1):
    """ValueError naming `where` (the caller and its step) and the batch rows (sequences; `beams`
    score rows each) whose next-token scores (N, V) hold a NaN: an argmax would silently pick
    some token for them."""
    xp = backend.get_array_module(scores)
    bad = backend.as_numpy(xp.isnan(scores).any(axis=-1))                          # (N,)
    if bad.any():
        rows = np.unique(np.flatnonzero(bad) // beams).tolist()
        raise ValueError(f"{where}: the next-token logits of batch rows {rows} hold NaN (the model's output "
                         f"is not a number there)")


class _Stepper:
    """Next-token logits for a batch of prefixes, with or without the KV cache."""

    def __init__(self, model, memory, memory_mask, bos, batch, use_cache):
        self.model, self.memory, self.memory_mask, self.use_cache = model, memory, memory_mask, use_cache
        self.prefix = np.full((batch, 1), bos, dtype=np.int64)  # (N, t) tokens so far, BOS first
        if use_cache:
            self.cache = model.init_cache(memory, memory_key_padding_mask=memory_mask)

    def logits(self):
        """(N, V) Tensor: the next-token logits after the current prefix. Every prefix token is a
        token (an id equal to the model's pad_idx too, as on the cached path): no target padding mask."""
        if self.use_cache:
            return self.model.decode_step(self.prefix[:, -1], self.cache)
        out = self.model.decode(self.prefix, self.memory, memory_key_padding_mask=self.memory_mask,
                                tgt_key_padding_mask=np.zeros(self.prefix.shape, dtype=bool))
        return out[:, -1]

    def advance(self, tokens, order=None):
        """Append `tokens` (N,) after reordering the prefixes (and the cache) by `order`."""
        if order is not None:
            self.prefix = self.prefix[order]
            if self.use_cache:
                self.cache.reorder(order)
        self.prefix = np.concatenate([self.prefix, tokens[:, None]], axis=1)


def greedy_decode(model: Module, src: ArrayLike, max_len: int, *, bos: int = BOS, eos: int | None = EOS,
                  pad: int = PAD, src_key_padding_mask: ArrayLike | None = None,
                  use_cache: bool = True) -> np.ndarray:
    """Pick the most likely token at every step.

    src: (B, S) int ids. max_len: most tokens to generate. eos: stop a sequence at this id
    (None: always generate max_len tokens). bos, eos and pad are ids of the target vocabulary;
    generated ids equal to the model's pad_idx are tokens, not padding (both paths). use_cache=False
    re-runs the decoder on the whole prefix at every step. Returns (B, L) int64, L <= max_len.
    """
    _check_seq2seq(model, "greedy_decode")
    max_len = _check_max_len(model, max_len, "greedy_decode")
    bos, eos, pad = _check_special_ids(model, bos, eos, pad, "greedy_decode")
    use_cache = check_bool(use_cache, "use_cache", "greedy_decode")
    src, mask = _source(model, src, src_key_padding_mask, "greedy_decode")
    batch = len(src)
    columns = []  # (B,) tokens per step: the output grows as tokens come (max_len may be huge)
    finished = np.zeros(batch, dtype=bool)
    with inference_mode():
        memory = model.encode(src, src_key_padding_mask=mask)
        stepper = _Stepper(model, memory, mask, bos, batch, use_cache)
        for t in range(max_len):
            logits = stepper.logits()
            _refuse_nan(logits.data, f"greedy_decode: step {t}")
            tokens = backend.as_numpy(logits.xp.argmax(logits.data, axis=-1)).astype(np.int64)  # (B,)
            tokens[finished] = pad
            columns.append(tokens)
            if eos is not None:
                finished |= tokens == eos
                if finished.all():
                    break
            stepper.advance(tokens)
    return np.stack(columns, axis=1)


def beam_search(model: Module, src: ArrayLike, max_len: int, *, beam_size: int = 4, length_penalty: float = 1.0,
                bos: int = BOS, eos: int = EOS, pad: int = PAD, src_key_padding_mask: ArrayLike | None = None,
                use_cache: bool = True, return_scores: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Keep the `beam_size` most likely prefixes of every sequence at each step.

    A hypothesis that emits EOS among the top `beam_size` candidates is finished, scored
    `sum(log p) / length ** length_penalty` (length counts the EOS; 0 = raw sum, larger
    values favour longer outputs); a sequence stops when it has `beam_size` finished
    hypotheses, and at max_len the open ones are finished as they are. Returns the best
    hypothesis per sequence, (B, L) int64 (and its scores (B,) with return_scores).
    beam_size=1 gives greedy decoding.
    """
    _check_seq2seq(model, "beam_search")
    max_len = _check_max_len(model, max_len, "beam_search")
    k = check_int(beam_size, "beam_size", "beam_search", at_least=1)
    length_penalty = check_real(length_penalty, "length_penalty", "beam_search")
    bos, eos, pad = _check_special_ids(model, bos, eos, pad, "beam_search")
    use_cache = check_bool(use_cache, "use_cache", "beam_search")
    return_scores = check_bool(return_scores, "return_scores", "beam_search")
    src, mask = _source(model, src, src_key_padding_mask, "beam_search")
    batch = len(src)
    rows = np.repeat(np.arange(batch), k)  # (B*k,) source row of each beam
    scores = np.zeros((batch, k))
    scores[:, 1:] = -math.inf  # all beams start identical: expand only the first
    finished = [[] for _ in range(batch)]  # per sequence: (normalised score, tokens)
    done = np.zeros(batch, dtype=bool)

    def finish(b, tokens, score):
        finished[b].append((score / len(tokens) ** length_penalty, tokens))

    with inference_mode():
        memory = model.encode(src, src_key_padding_mask=mask)
        device_rows = backend.to_device(rows, memory.device)
        memory = memory[device_rows]  # (B*k, S, D)
        beam_mask = None if mask is None else mask[rows]
        stepper = _Stepper(model, memory, beam_mask, bos, batch * k, use_cache)
        for t in range(max_len):
            logp = _log_probs(stepper.logits())  # (B*k, V)
            _refuse_nan(logp, f"beam_search: step {t}", beams=k)
            vocab = logp.shape[1]
            candidates = (scores.reshape(-1, 1) + logp).reshape(batch, k * vocab)
            top = np.argsort(-candidates, axis=1, kind="stable")[:, :2 * k]  # (B, 2k)
            order = np.arange(batch * k)
            tokens = np.full(batch * k, pad, dtype=np.int64)
            for b in np.flatnonzero(~done):
                kept = 0
                for rank, flat in enumerate(top[b]):
                    beam, token = divmod(int(flat), vocab)
                    score = float(candidates[b, flat])
                    history = stepper.prefix[b * k + beam, 1:].tolist()
                    if eos is not None and token == eos:
                        if rank < k and score > -math.inf:  # (-inf: an unused beam of step 0)
                            finish(b, history + [token], score)
                        continue
                    order[b * k + kept], tokens[b * k + kept] = b * k + beam, token
                    scores[b, kept] = score
                    kept += 1
                    if kept == k:
                        break
                if len(finished[b]) >= k:
                    done[b] = True
            if done.all():
                break
            stepper.advance(tokens, order)
        else:
            for b in np.flatnonzero(~done):  # max_len reached: finish the open beams as they are
                for j in range(k):
                    finish(b, stepper.prefix[b * k + j, 1:].tolist(), float(scores[b, j]))

    best = [max(hyps, key=lambda h: h[0]) for hyps in finished]
    out = np.full((batch, max(len(tokens) for _, tokens in best)), pad, dtype=np.int64)
    for b, (_, tokens) in enumerate(best):
        out[b, :len(tokens)] = tokens
    return (out, np.array([s for s, _ in best])) if return_scores else out


# -- causal language models ------------------------------------------------------------------
def top_k_filter(logits: Tensor | Array, top_k: int) -> Array:
    """Logits (..., V) with every entry below the k-th largest of its row set to -inf (ties
    with the k-th are kept), as Hugging Face's TopKLogitsWarper. top_k: int >= 1 (capped at V)."""
    scores = logits.data if isinstance(logits, Tensor) else logits
    xp = backend.get_array_module(scores)
    k = min(check_int(top_k, "top_k", "top_k_filter", at_least=1), scores.shape[-1])
    kth = -xp.partition(-scores, k - 1, axis=-1)[..., k - 1:k]                     # (..., 1) k-th largest
    return xp.where(scores < kth, -math.inf, scores).astype(scores.dtype, copy=False)


def top_p_filter(logits: Tensor | Array, top_p: float) -> Array:
    """Nucleus filtering, as Hugging Face's TopPLogitsWarper: sort each row's logits ascending,
    take the cumulative softmax probability c; entries with c <= 1 - top_p are set to -inf,
    the most likely entry always stays. What stays is the smallest set of most likely tokens
    whose probabilities add up to more than top_p (1.0: everything). top_p: a real number in (0, 1]."""
    top_p = check_real(top_p, "top_p", "top_p_filter", above=0.0, at_most=1.0)
    scores = logits.data if isinstance(logits, Tensor) else logits
    xp = backend.get_array_module(scores)
    order = xp.argsort(scores, axis=-1, kind="stable")                             # (..., V) ascending
    ascending = xp.take_along_axis(scores, order, axis=-1).astype("float64")
    probs = xp.exp(ascending - ascending[..., -1:])                                # the max is last
    cumulative = xp.cumsum(probs, axis=-1) / probs.sum(axis=-1, keepdims=True)    # (..., V)
    remove_sorted = cumulative <= 1.0 - top_p
    remove_sorted[..., -1] = False                                                 # keep at least one
    remove = xp.empty_like(remove_sorted)
    xp.put_along_axis(remove, order, remove_sorted, axis=-1)                      # back to vocabulary order
    return xp.where(remove, -math.inf, scores).astype(scores.dtype, copy=False)


def sample_logits(logits: Tensor | Array, rng: np.random.Generator, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None) -> np.ndarray:
    """Next tokens (B,) int64 on the host from logits (B, V): the argmax when temperature == 0,
    else a draw from softmax(filtered logits / temperature) with `rng` (a numpy Generator), the
    logits processed in Hugging Face's order: temperature, top-k (None or 0: all), top-p (None
    or 1: all). The maximum is subtracted before dividing by the temperature, so a tiny
    temperature tends to the argmax instead of overflowing. ValueError for a row whose logits
    give no distribution (NaN, +inf, or every entry -inf), as torch.multinomial, and for a row
    with a NaN at temperature 0 (its argmax would be an arbitrary token)."""
    owner = "sample_logits"
    temperature, top_k, top_p = _sampling_settings(temperature, top_k, top_p, owner)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"{owner}: rng must be a numpy.random.Generator, got {type(rng).__name__}")
    scores = logits.data if isinstance(logits, Tensor) else logits
    if not backend.is_array(scores):
        raise TypeError(f"{owner}: logits must be an autograd.Tensor or an array, got {type(logits).__name__}")
    if scores.ndim != 2 or scores.shape[-1] == 0:
        raise ValueError(f"{owner}: logits must be (batch, vocabulary) with a vocabulary of at least one entry, "
                         f"got shape {tuple(scores.shape)}")
    return _choose(scores, rng, temperature, top_k, top_p, owner)


def _choose(scores, rng, temperature, top_k, top_p, where):
    """sample_logits of checked arguments (scores: the (B, V) array); errors begin with `where`."""
    xp = backend.get_array_module(scores)
    if temperature == 0:
        _refuse_nan(scores, where)
        return backend.as_numpy(xp.argmax(scores, axis=-1)).astype(np.int64)
    scores = scores.astype("float64")
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / +inf logits: refused below; -inf: a 0 probability
        scores = (scores - scores.max(axis=-1, keepdims=True)) / temperature       # (B, V), max 0
    if top_k:
        scores = top_k_filter(scores, top_k)
    if top_p is not None and top_p < 1.0:
        scores = top_p_filter(scores, top_p)
    probs = xp.exp(scores)                                                         # 0 where filtered
    cumulative = xp.cumsum(probs, axis=-1)                                         # (B, V)
    total = cumulative[:, -1]                                                      # (B,) >= 1 unless NaN
    # inverse CDF: the first token whose cumulative mass exceeds u * total (never a 0-mass token)
    u = backend.to_device(rng.random(len(scores)), backend.device_of(scores))      # (B,) in [0, 1)
    chosen = (cumulative <= (u * total)[:, None]).sum(axis=-1)                     # (B,)
    chosen = xp.where(total >= 1.0, xp.minimum(chosen, scores.shape[-1] - 1), -1)  # -1: no distribution
    tokens = backend.as_numpy(chosen).astype(np.int64)
    if (tokens < 0).any():
        raise ValueError(f"{where}: logits rows {np.flatnonzero(tokens < 0).tolist()} give no probability "
                         f"distribution (NaN, +inf, or every entry -inf)")
    return tokens


def _check_ids(ids, vocab):
    """IndexError naming generate's `ids` unless every id is in [0, vocab) (checked before any cast)."""
    check_index_range(ids, vocab, lambda lo, hi: IndexError(
        f"generate: ids token ids must be in [0, {vocab - 1}] (vocabulary size {vocab}), got min {lo} and max {hi}"))


def _prompts(ids, key_padding_mask, pad, vocab, pad_idx):
    """(prompt (B, P) int64 host array, key padding mask (B, P) bool or None, ragged) from a 2-D
    array of ids (left-padded, with a mask) or a list of 1-D prompts of any lengths (left-padded
    here with `pad`), every id checked against the vocabulary. Without key_padding_mask, the ids
    of a 2-D array equal to the model's pad_idx are its padding (as Hugging Face's generate infers
    attention_mask from pad_token_id)."""
    if isinstance(ids, Tensor):
        ids = backend.as_numpy(ids.data)
    if isinstance(ids, (list, tuple)):  # a list of prompts, left-padded here
        if key_padding_mask is not None:
            raise ValueError("generate: key_padding_mask is for a padded 2-D array of ids; prompts given as "
                             "a list are padded here")
        rows = [np.asarray(backend.as_numpy(row.data) if isinstance(row, Tensor) else row) for row in ids]
        if not rows or any(row.ndim != 1 or row.size == 0 or row.dtype.kind not in "iu" for row in rows):
            raise ValueError("generate: a list of prompts must hold at least one prompt, each a non-empty "
                             "1-D sequence of integer token ids")
        for row in rows:
            _check_ids(row, vocab)
        width = max(len(row) for row in rows)
        prompt = np.full((len(rows), width), pad, dtype=np.int64)
        key_padding_mask = np.ones((len(rows), width), dtype=bool)
        for b, row in enumerate(rows):
            prompt[b, width - len(row):] = row
            key_padding_mask[b, width - len(row):] = False
        return prompt, (key_padding_mask if key_padding_mask.any() else None), True
    prompt = np.asarray(backend.as_numpy(ids) if backend.is_array(ids) else ids)
    if prompt.dtype.kind not in "iu" or prompt.ndim != 2 or 0 in prompt.shape:
        raise ValueError(f"generate: ids must be a non-empty 2-D array (batch, prompt length) of integer token "
                         f"ids or a list of 1-D prompts, got {prompt.dtype} with shape {prompt.shape}")
    _check_ids(prompt, vocab)
    if key_padding_mask is not None:
        mask = key_padding_mask.data if isinstance(key_padding_mask, Tensor) else key_padding_mask
        mask = backend.as_numpy(mask) if backend.is_array(mask) else as_array(mask, "key_padding_mask", "generate", np)
        if mask.dtype != bool or mask.shape != prompt.shape:
            raise ValueError(f"generate: key_padding_mask must be a bool array of the shape of ids {prompt.shape} "
                             f"(True = padding), got {mask.dtype} {mask.shape}")
        source = "key_padding_mask"
    elif pad_idx is not None:
        mask = prompt == pad_idx
        source = f"the prompt (its ids equal to the model's pad_idx={pad_idx} are padding)"
    else:
        return prompt.astype(np.int64), None, False
    if mask.all(axis=1).any():
        raise ValueError(f"generate: rows {np.flatnonzero(mask.all(axis=1)).tolist()} of {source} are all padding; "
                         f"every prompt needs at least one token")
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError(f"generate: prompts must be left-padded (padding before the tokens, as Hugging Face's "
                         f"tokenizer(padding_side='left') gives); {source} has padding after a token"
                         + ("" if key_padding_mask is not None else "; pass key_padding_mask to say which ids are "
                                                                    "padding"))
    return prompt.astype(np.int64), (mask if mask.any() else None), False


def _sampling_settings(temperature, top_k, top_p, owner):
    """(temperature >= 0, top_k None or >= 0, top_p None or in (0, 1]) as plain numbers, checked
    for `owner` (autograd.checks: TypeError for a wrong type, ValueError out of range)."""
    return (check_real(temperature, "temperature", owner, at_least=0.0),
            check_optional_int(top_k, "top_k", owner, at_least=0),
            None if top_p is None else check_real(top_p, "top_p", owner, above=0.0, at_most=1.0))


def _check_sampling(temperature, top_k, top_p, max_new_tokens, eos, seed, vocab):
    """The sampling arguments as plain numbers (_sampling_settings, and eos an id of the vocabulary)."""
    owner = "generate"
    return (*_sampling_settings(temperature, top_k, top_p, owner),
            check_int(max_new_tokens, "max_new_tokens", owner, at_least=1),
            check_optional_int(eos, "eos", owner, at_least=0, at_most=vocab - 1),
            check_optional_int(seed, "seed", owner, at_least=0))


def generate(model: Module, ids: ArrayLike | list[ArrayLike], max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos: int | None = None,
             seed: int | None = None, *, key_padding_mask: ArrayLike | None = None, pad: int | None = None,
             use_cache: bool = True, crop: bool = True) -> np.ndarray:
    """Continue prompts with a causal LM (`CausalLM`, e.g. GPT-2 from `load_pretrained`), like
    Hugging Face's `model.generate`. Returns prompt + new ids.

    ids: a 2-D array (B, P) of token ids (numpy/cupy array or Tensor), left-padded when prompts
    differ in length, with key_padding_mask (B, P) bool, True = padding (from a Hugging Face
    tokenizer: `attention_mask == 0`); or a list of 1-D prompts of any lengths, left-padded here.
    Padding is masked out and positions count real tokens only, so each row continues exactly
    as it would alone. For a model built with pad_idx, a 2-D array without key_padding_mask has
    its ids equal to pad_idx as its (left) padding, as Hugging Face's generate infers
    attention_mask from pad_token_id; generated tokens are never padding.
    temperature: 0 = greedy (the argmax at every step; equals recomputing the whole prefix);
    > 0 = sample from softmax(logits / temperature) after top_k (keep the k most likely; None or
    0: all) and top_p (nucleus: the smallest set of most likely tokens with mass > top_p; None or
    1: all), applied in Hugging Face's order (its generate defaults to top_k=50; here None).
    eos: a row stops after producing this id and gets `pad` after it (pad defaults to eos, else
    0; both ids of the vocabulary: pad is fed back for finished rows); generation stops early
    when every row has. seed: an int >= 0 makes sampling reproducible (None: npformer's global
    generator, seeded by npformer.manual_seed).
    use_cache=False recomputes the whole prefix at every step instead of using the KV cache.
    The model runs in `nn.inference_mode()`: without a graph and with dropout off in this thread
    only, `model.training` untouched (like Hugging Face's generate, which never changes the mode;
    another thread may train the model meanwhile).
    Context longer than the positional table (learned or sinusoidal positions, max_len): with
    crop=True (the default) the model sees the last max_len tokens only, as nanoGPT's generate
    (idx[:, -block_size:]): once a row's prompt and new tokens exceed max_len, every step
    recomputes the cache from that window (its first token at position 0), so each step costs a
    forward over max_len tokens. crop=False refuses (ValueError) unless the table holds the
    prompt and every new token but the last (which is never fed back): P + max_new_tokens - 1
    positions. Rotary positions ("rope") and "none" have no table: generation goes on, the KV
    cache growing with the context (or bounded by the model's sliding_window).

    Returns an int64 numpy array (B, P + n), n <= max_new_tokens, keeping the prompt's left
    padding; for a list of prompts, a list of 1-D arrays, each its prompt and its new tokens
    (up to and including eos, no padding).
    """
    for method in ("init_cache", "decode_step", "project"):
        if not callable(getattr(model, method, None)):
            raise TypeError(f"generate: expected a causal LM with init_cache/decode_step (npformer.models."
                            f"CausalLM), got {type(model).__name__}")
    vocab, pad_idx = model.tok_embed.num_embeddings, getattr(model, "pad_idx", None)
    temperature, top_k, top_p, max_new_tokens, eos, seed = _check_sampling(temperature, top_k, top_p,
                                                                           max_new_tokens, eos, seed, vocab)
    use_cache = check_bool(use_cache, "use_cache", "generate")
    crop = check_bool(crop, "crop", "generate")
    pad = (eos if eos is not None else 0) if pad is None else check_int(pad, "pad", "generate", at_least=0,
                                                                        at_most=vocab - 1)
    prompt, mask, ragged = _prompts(ids, key_padding_mask, pad, vocab, pad_idx)
    batch, width = prompt.shape
    config = getattr(model, "config", None) or {}
    table = config.get("max_len") if config.get("positional") in ("learned", "sinusoidal") else None
    longest = width if mask is None else int((~mask).sum(axis=1).max())
    if not crop and table is not None and longest + max_new_tokens - 1 > table:  # the last new token is never fed back
        raise ValueError(f"generate: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs "
                         f"{longest + max_new_tokens - 1} positions but the model's positional table has "
                         f"max_len={table}; crop=True continues on the last {table} tokens (as nanoGPT does)")
    window = table if crop else None  # None: the context always fits
    # a model with pad_idx would take pad ids for padding: it gets explicit masks (new tokens never are)
    step_mask = None if pad_idx is None else np.zeros((batch, 1), dtype=bool)
    if mask is None and pad_idx is not None:
        mask = np.zeros(prompt.shape, dtype=bool)
    rng = np.random.default_rng(seed) if seed is not None else random.global_rng("cpu")
    device = model.tok_embed.weight.device
    columns = []  # (B,) new tokens per step: the output grows as they come (max_new_tokens may be huge)
    finished = np.zeros(batch, dtype=bool)
    with inference_mode(), _blas_threads(device):
        if use_cache:
            cache = model.init_cache()
            logits = _cached_logits(model, prompt, mask, window, cache)
        for t in range(max_new_tokens):
            if not use_cache:
                logits = _full_prefix_logits(model, np.column_stack([prompt, *columns]), mask, t, window)
            tokens = _choose(logits.data, rng, temperature, top_k, top_p, f"generate: step {t}")
            tokens[finished] = pad
            columns.append(tokens)
            if eos is not None:
                finished |= tokens == eos
            if finished.all():
                break
            if use_cache and t + 1 < max_new_tokens:
                if window is not None and longest + t + 1 > window:  # past the table: recompute on the window
                    cache = model.init_cache()
                    logits = _cached_logits(model, np.column_stack([prompt, *columns]),
                                            _context_mask(mask, len(columns)), window, cache)
                else:
                    logits = model.decode_step(backend.to_device(tokens[:, None], device), cache,
                                               key_padding_mask=step_mask)
    out = np.stack(columns, axis=1)                                                 # (B, n)
    result = np.concatenate([prompt, out], axis=1)
    if not ragged:
        return result
    rows = []
    for b in range(batch):
        new = out[b]
        if eos is not None and (new == eos).any():
            new = new[:int(np.argmax(new == eos)) + 1]
        rows.append(np.concatenate([prompt[b] if mask is None else prompt[b][~mask[b]], new]))
    return rows


def _context_mask(prompt_mask, generated):
    """The padding mask (B, P + generated) of the prompt and `generated` new tokens (never padding), or None."""
    if prompt_mask is None:
        return None
    return np.concatenate([prompt_mask, np.zeros((len(prompt_mask), generated), dtype=bool)], axis=1)


def _cropped(ids, mask, window):
    """(ids, mask) of the last `window` columns when they are wider (window None: as they are).
    Every row keeps its last `window` tokens: the prompts are left-padded and new tokens are
    never padding, so a row with fewer real tokens loses padding only."""
    if window is None or ids.shape[1] <= window:
        return ids, mask
    return ids[:, -window:], (None if mask is None else mask[:, -window:])


def _cached_logits(model, context, mask, window, cache):
    """The next-token logits (B, V) after `context` (B, L) (cropped to its last `window`
    columns), its keys and values filling the empty `cache`."""
    device = model.tok_embed.weight.device
    context, mask = _cropped(context, mask, window)
    return model.decode_step(backend.to_device(context, device), cache, key_padding_mask=mask)


def _full_prefix_logits(model, prefix, prompt_mask, generated, window=None):
    """The uncached path: next-token logits (B, V) of the whole prefix (prompt + `generated`
    new tokens; its last `window` columns when window is not None) with its padding mask and
    per-row positions."""
    device = model.tok_embed.weight.device
    prefix, mask = _cropped(prefix, _context_mask(prompt_mask, generated), window)
    if mask is None:
        return model(backend.to_device(prefix, device))[:, -1]
    positions = np.maximum(np.cumsum(~mask, axis=1) - 1, 0)
    return model(backend.to_device(prefix, device), key_padding_mask=backend.to_device(mask, device),
                 position_ids=backend.to_device(positions, device))[:, -1]
