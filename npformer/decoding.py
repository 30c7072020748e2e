"""Autoregressive decoding for `Seq2SeqTransformer`: greedy and beam search.

Both run with the model's KV cache (`init_cache` computes the cross-attention keys/values
of the memory once; `decode_step` appends one position of self-attention keys/values per
step), or, with `use_cache=False`, by re-running the decoder on the whole prefix at every
step (the seed tutorial's way). Both give the same tokens.

Outputs are int64 numpy arrays (B, L) of generated ids without the leading BOS; a sequence
that produced EOS keeps it and has PAD after it. L <= max_len; decoding stops early once
every sequence has finished.
"""
import contextlib
import math

import numpy as np

from autograd import Tensor, backend, no_grad
from autograd.checks import as_array, check_int, check_optional_int, check_real
from . import functional as F
from .data import BOS, EOS, PAD


@contextlib.contextmanager
def _inference(model):
    """Eval mode and no graph, restoring the model's previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            yield
    finally:
        model.train(was_training)


def _source(model, src, src_key_padding_mask, owner):
    """src as a 2-D int array and its key padding mask (derived from pad ids when the model has pad_idx)."""
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
    elif np.shape(src_key_padding_mask) != src.shape:
        raise ValueError(f"{owner}: src_key_padding_mask: expected shape {src.shape}, got "
                         f"{np.shape(src_key_padding_mask)}")
    return src, src_key_padding_mask


def _check_max_len(model, max_len, owner):
    """max_len (an int >= 1) generated tokens need a positional table of at least max_len decoder positions."""
    max_len = check_int(max_len, "max_len", owner, at_least=1)
    config = getattr(model, "config", None) or {}
    table = config.get("max_len") if config.get("positional", "sinusoidal") != "none" else None
    if table is not None and max_len > table:
        raise ValueError(f"{owner}: max_len: decoding {max_len} tokens needs {max_len} target positions but the "
                         f"model's positional table has max_len={table}")
    return max_len


def _check_special_ids(bos, eos, pad, owner):
    """bos and pad as ints >= 0, eos None or an int >= 0."""
    return (check_int(bos, "bos", owner, at_least=0), check_optional_int(eos, "eos", owner, at_least=0),
            check_int(pad, "pad", owner, at_least=0))


def _log_probs(logits):
    """(N, V) Tensor of logits -> host array of log-probabilities."""
    return F.log_softmax(logits, dim=-1).numpy()


class _Stepper:
    """Next-token logits for a batch of prefixes, with or without the KV cache."""

    def __init__(self, model, memory, memory_mask, bos, batch, use_cache):
        self.model, self.memory, self.memory_mask, self.use_cache = model, memory, memory_mask, use_cache
        self.prefix = np.full((batch, 1), bos, dtype=np.int64)  # (N, t) tokens so far, BOS first
        if use_cache:
            self.cache = model.init_cache(memory, memory_key_padding_mask=memory_mask)

    def logits(self):
        """(N, V) Tensor: the next-token logits after the current prefix."""
        if self.use_cache:
            return self.model.decode_step(self.prefix[:, -1], self.cache)
        out = self.model.decode(self.prefix, self.memory, memory_key_padding_mask=self.memory_mask)
        return out[:, -1]

    def advance(self, tokens, order=None):
        """Append `tokens` (N,) after reordering the prefixes (and the cache) by `order`."""
        if order is not None:
            self.prefix = self.prefix[order]
            if self.use_cache:
                self.cache.reorder(order)
        self.prefix = np.concatenate([self.prefix, tokens[:, None]], axis=1)


def greedy_decode(model, src, max_len, *, bos=BOS, eos=EOS, pad=PAD, src_key_padding_mask=None,
                  use_cache=True):
    """Pick the most likely token at every step.

    src: (B, S) int ids. max_len: most tokens to generate. eos: stop a sequence at this id
    (None: always generate max_len tokens). Returns (B, L) int64, L <= max_len.
    """
    max_len = _check_max_len(model, max_len, "greedy_decode")
    bos, eos, pad = _check_special_ids(bos, eos, pad, "greedy_decode")
    src, mask = _source(model, src, src_key_padding_mask, "greedy_decode")
    batch = len(src)
    out = np.full((batch, max_len), pad, dtype=np.int64)
    finished = np.zeros(batch, dtype=bool)
    with _inference(model):
        memory = model.encode(src, src_key_padding_mask=mask)
        stepper = _Stepper(model, memory, mask, bos, batch, use_cache)
        for t in range(max_len):
            logits = stepper.logits()
            tokens = backend.as_numpy(logits.xp.argmax(logits.data, axis=-1)).astype(np.int64)  # (B,)
            tokens[finished] = pad
            out[:, t] = tokens
            if eos is not None:
                finished |= tokens == eos
                if finished.all():
                    return out[:, :t + 1]
            stepper.advance(tokens)
    return out


def beam_search(model, src, max_len, *, beam_size=4, length_penalty=1.0, bos=BOS, eos=EOS, pad=PAD,
                src_key_padding_mask=None, use_cache=True, return_scores=False):
    """Keep the `beam_size` most likely prefixes of every sequence at each step.

    A hypothesis that emits EOS among the top `beam_size` candidates is finished, scored
    `sum(log p) / length ** length_penalty` (length counts the EOS; 0 = raw sum, larger
    values favour longer outputs); a sequence stops when it has `beam_size` finished
    hypotheses, and at max_len the open ones are finished as they are. Returns the best
    hypothesis per sequence, (B, L) int64 (and its scores (B,) with return_scores).
    beam_size=1 gives greedy decoding.
    """
    max_len = _check_max_len(model, max_len, "beam_search")
    k = check_int(beam_size, "beam_size", "beam_search", at_least=1)
    length_penalty = check_real(length_penalty, "length_penalty", "beam_search")
    bos, eos, pad = _check_special_ids(bos, eos, pad, "beam_search")
    src, mask = _source(model, src, src_key_padding_mask, "beam_search")
    batch = len(src)
    rows = np.repeat(np.arange(batch), k)  # (B*k,) source row of each beam
    scores = np.zeros((batch, k))
    scores[:, 1:] = -math.inf  # all beams start identical: expand only the first
    finished = [[] for _ in range(batch)]  # per sequence: (normalised score, tokens)
    done = np.zeros(batch, dtype=bool)

    def finish(b, tokens, score):
        finished[b].append((score / len(tokens) ** length_penalty, tokens))

    with _inference(model):
        memory = model.encode(src, src_key_padding_mask=mask)
        device_rows = backend.to_device(rows, memory.device)
        memory = memory[device_rows]  # (B*k, S, D)
        beam_mask = None if mask is None else mask[rows]
        stepper = _Stepper(model, memory, beam_mask, bos, batch * k, use_cache)
        for t in range(max_len):
            logp = _log_probs(stepper.logits())  # (B*k, V)
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
