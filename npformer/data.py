"""Seeded toy sequence-to-sequence tasks: reverse (the seed tutorial's), copy and sort.

Token ids: PAD=0, BOS=1, EOS=2, then the symbols. A task with `vocab_size` V has V - 3
symbols, written 1..V-3 for people (the seed tutorial's integers) and stored as ids 3..V-1
(`encode`/`decode` convert). Batches are int64 numpy arrays on the host:

    src      (B, S)  the source symbols, PAD after each sequence
    tgt_out  (B, T)  the target, with EOS appended when the task uses EOS, PAD after it
    tgt_in   (B, T)  the decoder input: BOS + tgt_out[:-1] (teacher forcing, as in the seeds)

With variable lengths (min_len < max_len) targets end with EOS so that decoding knows when
to stop; fixed-length tasks (the tutorial's) have no EOS unless asked for.

Held-out set: `heldout_size` distinct sequences drawn once from a separate seeded stream.
Training batches reject (and redraw) every sequence that is in the held-out set, so the
held-out sequences are never trained on, whatever the vocabulary and lengths.

Data parallelism: every rank draws the same global batch from the same stream and keeps its
own contiguous share (`shard`), so N ranks see exactly the batches of one process, and a
run saved on N ranks continues on M. `RandomBatches` does the same for any dataset of arrays.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from autograd.checks import check_bool, check_int, is_integer

from .checkpoint.packing import bit_generator

__all__ = ["PAD", "BOS", "EOS", "NUM_SPECIAL", "TASKS", "Batch", "shard", "RandomBatches", "SequenceTask"]

PAD, BOS, EOS = 0, 1, 2
NUM_SPECIAL = 3
TASKS = ("reverse", "copy", "sort")


@dataclass
class Batch:
    """One batch of integer arrays (see the module docstring for the layout)."""

    src: np.ndarray  # (B, S) int64
    tgt_in: np.ndarray  # (B, T) int64
    tgt_out: np.ndarray  # (B, T) int64

    @property
    def src_padding_mask(self) -> np.ndarray:
        """(B, S) bool, True at padding (torch's key_padding_mask convention)."""
        return self.src == PAD

    @property
    def tgt_padding_mask(self) -> np.ndarray:
        """(B, T) bool, True at padding of the decoder input."""
        return self.tgt_in == PAD

    @property
    def n_tokens(self) -> int:
        """Number of target tokens that count in the loss (not PAD)."""
        return int((self.tgt_out != PAD).sum())

    def __len__(self):
        return len(self.src)


def shard(n: int, rank: int, world_size: int) -> slice:
    """The slice of n items (a global batch) that `rank` of `world_size` takes: contiguous
    shares whose sizes differ by at most one, together the whole batch in order (torch's
    DistributedSampler splits by stride instead). ValueError unless 0 <= rank < world_size <= n;
    TypeError for an argument that is not an integer."""
    n = check_int(n, "n", "shard", at_least=0)
    world_size = check_int(world_size, "world_size", "shard", at_least=1)
    rank = check_int(rank, "rank", "shard", at_least=0)
    if rank >= world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if n < world_size:
        raise ValueError(f"batch_size: expected at least one item per rank (>= world_size={world_size}), got {n}")
    return slice(rank * n // world_size, (rank + 1) * n // world_size)


class RandomBatches:
    """Endless shuffled mini-batches of a dataset held in arrays (row i of every array is
    example i), like a torch DataLoader with shuffle=True and a DistributedSampler.

    Each epoch is a seeded permutation of the examples; each step takes its next batch_size
    examples (a partial batch at the end of an epoch is dropped) and rank keeps its share
    (`shard`). Iterating yields one array per array given (the array itself when one is given).
    `state_dict`/`load_state_dict` continue the stream (on any number of ranks).

    rank / world_size: default to npformer.distributed's (0 and 1 without an MPI job).
    Raises ValueError without arrays, for arrays of different lengths, or a batch_size larger
    than the dataset or smaller than world_size.
    """

    def __init__(self, *arrays: Any, batch_size: int, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None):
        from . import distributed

        if not arrays:
            raise ValueError("arrays: expected at least one array of examples")
        arrays = tuple(np.asarray(a) for a in arrays)
        if any(a.ndim == 0 or len(a) != len(arrays[0]) for a in arrays):
            raise ValueError(f"arrays: expected arrays with the same number of rows, got shapes "
                             f"{[a.shape for a in arrays]}")
        self.arrays = arrays
        self.batch_size = check_int(batch_size, "batch_size", "RandomBatches", at_least=1)
        if self.batch_size > len(arrays[0]):
            raise ValueError(f"batch_size: expected at most the {len(arrays[0])} examples, got {batch_size}")
        self.rank = distributed.rank() if rank is None else rank
        self.world_size = distributed.world_size() if world_size is None else world_size
        self.share = shard(self.batch_size, self.rank, self.world_size)
        self.rng = np.random.default_rng(check_int(seed, "seed", "RandomBatches", at_least=0))
        self._new_epoch()

    def _new_epoch(self):
        self.epoch_start_state = self.rng.bit_generator.state
        self.order = self.rng.permutation(len(self.arrays[0]))
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position + self.batch_size > len(self.order):
            self._new_epoch()
        indices = self.order[self.position:self.position + self.batch_size][self.share]
        self.position += self.batch_size
        batch = tuple(a[indices] for a in self.arrays)
        return batch[0] if len(batch) == 1 else batch

    def state_dict(self) -> dict[str, Any]:
        """The stream's position: the generator state the epoch's permutation came from, and
        how many examples of it were used."""
        return {"epoch_start": self.epoch_start_state, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream from `state` (what state_dict returned, on this or another number
        of ranks): the same epoch permutation, at the same position. All or nothing: ValueError or
        TypeError naming what is wrong, and the stream is unchanged."""
        owner = "RandomBatches.load_state_dict"
        if not isinstance(state, dict) or set(state) != {"epoch_start", "position"}:
            raise ValueError(f"{owner}: expected a dict with the keys ['epoch_start', 'position'], got {state!r:.80}")
        position = check_int(state["position"], "position", owner, at_least=0, at_most=len(self.arrays[0]))
        trial = bit_generator(state["epoch_start"], f"{owner}: epoch_start", like=self.rng.bit_generator)
        self.rng.bit_generator.state = trial.state
        self._new_epoch()
        self.position = position


class SequenceTask:
    """A seeded generator of batches for one task, plus its fixed held-out set.

    task: "reverse" | "copy" | "sort". vocab_size: total ids including PAD/BOS/EOS (>= 5).
    min_len, max_len: source lengths, drawn uniformly in [min_len, max_len] (max_len
    defaults to min_len: fixed length). eos: append EOS to targets (default: only when
    lengths vary). seed: seeds the training stream and, independently, the held-out set.
    heldout_size: distinct held-out sequences, at most a quarter of the possible ones. Raises
    TypeError / ValueError naming a bad argument.
    """

    def __init__(self, task: str = "reverse", vocab_size: int = 20, min_len: int = 6, max_len: int | None = None,
                 eos: bool | None = None, seed: int | None = 0, heldout_size: int = 1000):
        if task not in TASKS:
            raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
        owner = "SequenceTask"
        vocab_size = check_int(vocab_size, "vocab_size (PAD, BOS, EOS and at least 2 symbols)", owner,
                               at_least=NUM_SPECIAL + 2)
        min_len = check_int(min_len, "min_len", owner, at_least=1)
        max_len = min_len if max_len is None else check_int(max_len, "max_len", owner, at_least=1)
        if max_len < min_len:
            raise ValueError(f"{owner}: expected min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        heldout_size = check_int(heldout_size, "heldout_size", owner, at_least=0)
        self.task, self.vocab_size = task, vocab_size
        self.min_len, self.max_len = min_len, max_len
        self.eos = self.min_len != self.max_len if eos is None else check_bool(eos, "eos", owner)
        self.seed = None if seed is None else check_int(seed, "seed", owner, at_least=0)
        n_symbols = self.vocab_size - NUM_SPECIAL
        possible = sum(n_symbols ** n for n in range(self.min_len, self.max_len + 1))
        if heldout_size > possible // 4:
            raise ValueError(f"heldout_size: expected at most a quarter of the {possible} possible sequences "
                             f"(vocab_size={vocab_size}, lengths {min_len}..{max_len}), got {heldout_size}")
        train_seed, heldout_seed = np.random.SeedSequence(seed).spawn(2)
        self.rng = np.random.default_rng(train_seed)
        self.heldout = self._draw_distinct(np.random.default_rng(heldout_seed), heldout_size)
        self._heldout_keys = {self._key(s) for s in self.heldout}

    # -- sizes --------------------------------------------------------------------------
    @property
    def max_target_len(self) -> int:
        """Longest target, EOS included: the decoding budget."""
        return self.max_len + self.eos

    @property
    def num_symbols(self) -> int:
        """The number of symbols (vocab_size minus PAD, BOS and EOS)."""
        return self.vocab_size - NUM_SPECIAL

    # -- sequences ----------------------------------------------------------------------
    @staticmethod
    def _key(seq):
        return np.asarray(seq, dtype=np.int64).tobytes()

    def _draw(self, rng, n):
        """n source sequences (lists of ids), lengths uniform in [min_len, max_len]."""
        lengths = rng.integers(self.min_len, self.max_len + 1, size=n)
        ids = rng.integers(NUM_SPECIAL, self.vocab_size, size=(n, self.max_len))
        return [row[:length] for row, length in zip(ids, lengths)]

    def _draw_distinct(self, rng, n):
        seqs, keys = [], set()
        while len(seqs) < n:
            for s in self._draw(rng, n - len(seqs)):
                if self._key(s) not in keys:
                    keys.add(self._key(s))
                    seqs.append(s)
        return seqs

    def sample(self, n: int) -> list[np.ndarray]:
        """n training source sequences from the task's stream, none of them held out."""
        seqs = []
        while len(seqs) < n:
            seqs += [s for s in self._draw(self.rng, n - len(seqs)) if self._key(s) not in self._heldout_keys]
        return seqs

    def target(self, seq: Sequence[int] | np.ndarray) -> np.ndarray:
        """The target of one source sequence (ids, without EOS)."""
        seq = np.asarray(seq, dtype=np.int64)
        return {"reverse": seq[::-1], "copy": seq, "sort": np.sort(seq)}[self.task]

    # -- batches ------------------------------------------------------------------------
    def collate(self, seqs: Sequence[Sequence[int] | np.ndarray]) -> Batch:
        """A Batch of source sequences (lists or arrays of ids), padded to the longest, with their
        targets (EOS appended when the task uses it) and decoder inputs. ValueError for no sequence or
        an id outside the symbols' (3..vocab_size-1: `encode` makes them), TypeError for one that is
        not an integer."""
        if not len(seqs):
            raise ValueError("seqs: expected at least one sequence")
        for i, row in enumerate(np.asarray(s) for s in seqs):
            if row.ndim != 1 or (row.size and row.dtype.kind not in "iu"):
                raise TypeError(f"seqs[{i}]: expected a sequence of integer ids, got {row!r:.80}")
            if row.size and not (NUM_SPECIAL <= row.min() and row.max() < self.vocab_size):
                raise ValueError(f"seqs[{i}]: expected symbol ids in {NUM_SPECIAL}..{self.vocab_size - 1} "
                                 f"(task.encode makes them from symbols), got {row.tolist()!r:.80}")
        n, src_len = len(seqs), max(len(s) for s in seqs)
        tgt_len = src_len + self.eos
        src = np.full((n, src_len), PAD, dtype=np.int64)
        tgt_out = np.full((n, tgt_len), PAD, dtype=np.int64)
        for i, s in enumerate(seqs):
            src[i, :len(s)] = s
            tgt_out[i, :len(s)] = self.target(s)
            if self.eos:
                tgt_out[i, len(s)] = EOS
        # decoder input = BOS + target[:-1]; an EOS shifted in from a shorter row becomes PAD
        tgt_in = np.concatenate([np.full((n, 1), BOS, dtype=np.int64), tgt_out[:, :-1]], axis=1)
        tgt_in[tgt_in == EOS] = PAD
        return Batch(src, tgt_in, tgt_out)

    def batch(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Batch:
        """A fresh training batch (advances the task's random stream). With world_size > 1:
        rank's share of the global batch of batch_size sequences (see `shard`)."""
        batch_size = check_int(batch_size, "batch_size", "SequenceTask.batch", at_least=1)
        return self.collate(self.sample(batch_size)[shard(batch_size, rank, world_size)])

    def heldout_batches(self, batch_size: int = 500) -> Iterator[Batch]:
        """The held-out set as Batches, always in the same order."""
        batch_size = check_int(batch_size, "batch_size", "SequenceTask.heldout_batches", at_least=1)
        for start in range(0, len(self.heldout), batch_size):
            yield self.collate(self.heldout[start:start + batch_size])

    # -- scoring ------------------------------------------------------------------------
    @staticmethod
    def score(predicted: Any, tgt_out: np.ndarray) -> tuple[int, int, int]:
        """(exact-sequence matches, correct tokens, target tokens) of decoded ids against targets.

        predicted: (B, T') ids from a decoder, PAD after EOS. A sequence is exact when its
        tokens match the target everywhere, EOS included, and nothing follows. ValueError for
        arrays that are not (B, T') and (B, T).
        """
        predicted, tgt_out = np.asarray(predicted), np.asarray(tgt_out)
        if predicted.ndim != 2 or tgt_out.ndim != 2 or len(predicted) != len(tgt_out):
            raise ValueError(f"score: expected predicted (B, T') and tgt_out (B, T) of one batch, got shapes "
                             f"{predicted.shape} and {tgt_out.shape}")
        n, t = tgt_out.shape
        width = max(t, predicted.shape[1])
        pred = np.full((n, width), PAD, dtype=np.int64)
        pred[:, :predicted.shape[1]] = predicted
        target = np.full((n, width), PAD, dtype=np.int64)
        target[:, :t] = tgt_out
        valid = target != PAD
        exact = int((pred == target).all(axis=1).sum())
        correct = int(((pred == target) & valid).sum())
        return exact, correct, int(valid.sum())

    # -- user-facing symbols ------------------------------------------------------------
    def encode(self, symbols: Sequence[int]) -> list[int]:
        """Symbols 1..V-3 (what people type) -> ids 3..V-1; raises TypeError for a symbol that is
        not an integer (a bool, a float, a str), ValueError for one out of range."""
        symbols = list(symbols)
        wrong = [s for s in symbols if not is_integer(s)]
        if wrong:
            raise TypeError(f"symbols: expected integers in 1..{self.num_symbols}, got {wrong!r:.80} (not integers)")
        symbols = [int(s) for s in symbols]
        bad = [s for s in symbols if not 1 <= s <= self.num_symbols]
        if bad:
            raise ValueError(f"symbols: expected integers in 1..{self.num_symbols} for vocab_size "
                             f"{self.vocab_size}, got {bad}")
        return [s + NUM_SPECIAL - 1 for s in symbols]

    def decode(self, ids: Any) -> list[int]:
        """ids -> symbols, stopping at EOS and skipping PAD/BOS."""
        out = []
        for i in np.asarray(ids).tolist():
            if i == EOS:
                break
            if i >= NUM_SPECIAL:
                out.append(i - NUM_SPECIAL + 1)
        return out

    # -- state --------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The constructor arguments: SequenceTask(**task.config()) rebuilds the task."""
        return {"task": self.task, "vocab_size": self.vocab_size, "min_len": self.min_len, "max_len": self.max_len,
                "eos": self.eos, "seed": self.seed, "heldout_size": len(self.heldout)}

    def state_dict(self) -> dict[str, Any]:
        """The training stream's position and the task's config (JSON-serialisable); the
        held-out set is rebuilt from the seed."""
        return {"rng": self.rng.bit_generator.state, "config": self.config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the training stream of `state`; ValueError if it was made by another task or
        is not what state_dict returns (the stream is then unchanged)."""
        owner = "SequenceTask.load_state_dict"
        if not isinstance(state, dict) or "rng" not in state or not isinstance(state.get("config"), (dict, type(None))):
            raise ValueError(f"{owner}: expected a dict with 'rng' and 'config' (a dict), got {state!r:.80}")
        saved = state.get("config")
        if saved is not None and saved != self.config():
            differ = {k: (saved.get(k), v) for k, v in self.config().items() if saved.get(k) != v}
            raise ValueError("state: saved by a different task (saved vs this one: "
                             + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differ.items()) + ")")
        self.rng.bit_generator.state = bit_generator(state["rng"], f"{owner}: rng", like=self.rng.bit_generator).state

    def __repr__(self):
        return (f"SequenceTask({self.task!r}, vocab_size={self.vocab_size}, lengths {self.min_len}.."
                f"{self.max_len}, eos={self.eos}, heldout={len(self.heldout)})")
