"""Toy task generators: layout, teacher-forcing shift, padding, held-out disjointness, seeding."""
import numpy as np
import pytest

from npformer.data import BOS, EOS, PAD, SequenceTask


def _rows(batch):
    """(source, target-with-EOS, decoder input) per row, without padding."""
    for src, tgt_in, tgt_out in zip(batch.src, batch.tgt_in, batch.tgt_out):
        yield src[src != PAD], tgt_out[tgt_out != PAD], tgt_in[tgt_in != PAD]


def test_fixed_length_matches_the_seed_layout():
    task = SequenceTask("reverse", vocab_size=20, min_len=6)
    b = task.batch(64)
    assert b.src.shape == b.tgt_in.shape == b.tgt_out.shape == (64, 6)
    assert b.src.dtype == b.tgt_in.dtype == b.tgt_out.dtype == np.int64
    assert not task.eos and task.max_target_len == 6
    np.testing.assert_array_equal(b.tgt_out, b.src[:, ::-1])  # torch.flip(src, dims=[1])
    np.testing.assert_array_equal(b.tgt_in[:, 0], BOS)
    np.testing.assert_array_equal(b.tgt_in[:, 1:], b.tgt_out[:, :-1])
    assert b.src.min() >= 3 and b.src.max() <= 19
    assert not b.src_padding_mask.any() and not b.tgt_padding_mask.any() and b.n_tokens == 64 * 6


@pytest.mark.parametrize("kind", ["reverse", "copy", "sort"])
def test_variable_lengths_with_eos_and_padding(kind):
    task = SequenceTask(kind, vocab_size=12, min_len=3, max_len=9, seed=1)
    assert task.eos and task.max_target_len == 10
    b = task.batch(200)
    lengths = (b.src != PAD).sum(axis=1)
    assert lengths.min() == 3 and lengths.max() == 9 == b.src.shape[1]
    assert b.tgt_out.shape == b.tgt_in.shape == (200, 10)
    expected = {"reverse": lambda s: s[::-1], "copy": lambda s: s, "sort": np.sort}[kind]
    for (src, tgt, dec_in), n in zip(_rows(b), lengths):
        assert len(src) == n  # padding only after the sequence, never inside
        np.testing.assert_array_equal(tgt[:-1], expected(src))
        assert tgt[-1] == EOS
        np.testing.assert_array_equal(dec_in, np.concatenate([[BOS], tgt[:-1]]))
    # padding is exactly where the masks say, and never inside a sequence
    np.testing.assert_array_equal(b.src_padding_mask, np.arange(9) >= lengths[:, None])
    np.testing.assert_array_equal(b.tgt_padding_mask, np.arange(10) > lengths[:, None])
    assert b.n_tokens == int(lengths.sum() + 200)


def test_heldout_is_distinct_and_never_trained_on():
    # 5 symbols, lengths 2..5: 3900 possible sequences, 900 held out, so a training batch
    # would contain held-out sequences constantly without the rejection
    task = SequenceTask("reverse", vocab_size=8, min_len=2, max_len=5, seed=3, heldout_size=900)
    held = {tuple(s) for s in task.heldout}
    assert len(task.heldout) == len(held) == 900
    seen = set()
    for _ in range(50):
        for src, _, _ in _rows(task.batch(100)):
            seen.add(tuple(src))
    assert len(seen) > 1000 and not seen & held
    # the held-out batches cover the held-out set exactly, in a fixed order
    rows = [tuple(src) for b in task.heldout_batches(256) for src, _, _ in _rows(b)]
    assert rows == [tuple(s) for s in task.heldout]


def test_seeding_and_state():
    a, b = SequenceTask(min_len=2, max_len=8, seed=5), SequenceTask(min_len=2, max_len=8, seed=5)
    for _ in range(3):
        np.testing.assert_array_equal(a.batch(16).src, b.batch(16).src)
    c = SequenceTask(min_len=2, max_len=8, seed=6)
    assert not np.array_equal(a.batch(16).src, c.batch(16).src)
    # the held-out set does not depend on how many training batches were drawn
    assert [list(s) for s in a.heldout] == [list(s) for s in SequenceTask(min_len=2, max_len=8, seed=5).heldout]
    state = a.state_dict()
    first = a.batch(8)
    a.load_state_dict(state)
    np.testing.assert_array_equal(a.batch(8).tgt_in, first.tgt_in)
    assert SequenceTask(**a.config()).config() == a.config()
    with pytest.raises(ValueError, match="seed 5 vs 6"):
        c.load_state_dict(state)


def test_score_counts_exact_sequences_and_tokens():
    task = SequenceTask(vocab_size=10, min_len=2, max_len=4, heldout_size=10)
    b = task.collate([[3, 4, 5], [6, 7]])  # targets [5 4 3 EOS], [7 6 EOS PAD]
    perfect = b.tgt_out
    assert task.score(perfect, b.tgt_out) == (2, 7, 7)
    wrong = np.array([[5, 4, 9, EOS, PAD], [7, 6, 3, EOS, PAD]])  # a bad token; a missing EOS
    assert task.score(wrong, b.tgt_out) == (0, 5, 7)
    longer = np.array([[5, 4, 3, EOS, PAD, PAD], [7, 6, EOS, PAD, PAD, PAD]])
    assert task.score(longer, b.tgt_out) == (2, 7, 7)


def test_encode_decode_symbols():
    task = SequenceTask(vocab_size=20, min_len=6)
    ids = task.encode([3, 7, 1, 5])
    assert ids == [5, 9, 3, 7]
    assert task.decode(ids + [EOS, 4]) == [3, 7, 1, 5]
    with pytest.raises(ValueError, match="1..17"):
        task.encode([0, 18])


@pytest.mark.parametrize("kwargs,match", [
    (dict(task="shuffle"), "task"), (dict(vocab_size=4), "vocab_size"),
    (dict(min_len=5, max_len=3), "min_len"), (dict(vocab_size=5, min_len=3, heldout_size=1000), "heldout_size")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SequenceTask(**kwargs)


def test_encode_refuses_what_is_not_an_integer_symbol():
    task = SequenceTask(vocab_size=20, min_len=6)
    assert task.encode(np.array([3, 7])) == [5, 9] and task.encode([np.int64(1)]) == [3]  # numpy integers are integers
    for bad in ([1.7], [True], ["3"], [None]):  # were truncated to 1, taken as 1, parsed as 3, a deep TypeError
        with pytest.raises(TypeError, match=r"symbols: expected integers in 1..17, got \[.*\] \(not integers\)"):
            task.encode(bad)


def test_eos_must_be_a_bool_or_none():
    assert SequenceTask(min_len=2, max_len=4, heldout_size=10, eos=np.bool_(False)).eos is False
    with pytest.raises(TypeError, match="SequenceTask: eos must be True or False, got 'no' of type str"):
        SequenceTask(min_len=2, heldout_size=10, eos="no")  # was truthy: targets got an EOS


def test_score_refuses_arrays_that_are_not_batches():
    with pytest.raises(ValueError, match=r"score: expected predicted \(B, T'\) and tgt_out \(B, T\) of one batch, "
                                         r"got shapes \(2,\) and \(1, 2\)"):
        SequenceTask.score(np.array([3, 4]), np.array([[3, 4]]))


def test_shard_checks_the_number_of_items():
    from npformer.data import shard
    assert shard(np.int64(4), 1, 2) == slice(2, 4)
    with pytest.raises(TypeError, match=r"shard: n must be an integer >= 0, got 4.5 of type float"):
        shard(4.5, 0, 2)  # was slice(0.0, 2.0): a TypeError deep inside numpy later
    with pytest.raises(TypeError, match=r"shard: n must be an integer >= 0, got True \(a bool"):
        shard(True, 0, 1)


def test_random_batches_refuse_a_bad_state_and_change_nothing():
    from npformer.data import RandomBatches
    stream = RandomBatches(np.arange(10), batch_size=3, seed=1)
    next(stream)
    good = stream.state_dict()
    for bad, error, words in [
            ({**good, "position": -5}, ValueError, r"position must be an integer in \[0, 10\], got -5"),
            ({**good, "position": 3.7}, TypeError, "position must be an integer"),
            ({**good, "position": True}, TypeError, "position must be an integer"),
            ({**good, "position": "x"}, TypeError, "position must be an integer"),
            ({**good, "epoch_start": {"bit_generator": "PCG64", "state": "x"}}, ValueError, "epoch_start"),
            ({**good, "epoch_start": {**good["epoch_start"], "state": {"state": -1, "inc": 1}}}, ValueError,
             r"epoch_start/state/state: expected an int in \[0, "),
            ({**good, "epoch_start": np.random.MT19937(0).state}, ValueError,
             "epoch_start: a MT19937 state for a PCG64 generator"),
            ({"position": 1}, ValueError, r"expected a dict with the keys \['epoch_start', 'position'\]"),
            ([1], ValueError, "expected a dict")]:
        state = stream.state_dict()
        with pytest.raises(error, match=f"RandomBatches.load_state_dict: {words}"):
            stream.load_state_dict(bad)
        assert stream.state_dict() == state  # unchanged
    fresh = RandomBatches(np.arange(10), batch_size=3, seed=7)
    fresh.load_state_dict({**good, "position": np.int64(good["position"])})
    np.testing.assert_array_equal(next(fresh), next(stream))


def test_sequence_task_refuses_a_bad_state_and_changes_nothing():
    """A checkpoint's data state is untrusted: what is wrong is a ValueError naming it (the Trainer's
    all-or-nothing load expects one), not an AttributeError or KeyError, and the stream is unchanged."""
    task = SequenceTask(min_len=2, max_len=4, heldout_size=10, seed=3)
    good = task.state_dict()
    for bad, words in [([1], "expected a dict with 'rng' and 'config'"), ({}, "expected a dict with 'rng'"),
                       ({**good, "config": [1]}, r"expected a dict with 'rng' and 'config' \(a dict\)"),
                       ({**good, "rng": "x"}, "rng: a generator state must be a dict"),
                       ({**good, "rng": {"bit_generator": "PCG64", "state": "x"}}, "rng: expected a dict with the keys")]:
        with pytest.raises(ValueError, match=f"SequenceTask.load_state_dict: {words}"):
            task.load_state_dict(bad)
        assert task.state_dict() == good
    first = task.batch(4)
    task.load_state_dict(good)
    np.testing.assert_array_equal(task.batch(4).src, first.src)


def test_collate_refuses_ids_that_are_not_symbols():
    """Floats were truncated (3.7 -> 3) and PAD/BOS/EOS or ids past the vocabulary went into the
    source silently (a PAD inside a sequence reads as padding)."""
    task = SequenceTask(vocab_size=10, min_len=2, max_len=4, heldout_size=10)
    assert task.collate([np.array([3, 9], np.uint8), [4]]).src.tolist() == [[3, 9], [4, PAD]]
    assert task.collate([[], [4]]).src.tolist() == [[PAD], [4]]
    for bad, error, words in [([[3, 4], [3.7]], TypeError, r"seqs\[1\]: expected a sequence of integer ids"),
                              ([[True, False]], TypeError, "integer ids"), ([["3"]], TypeError, "integer ids"),
                              ([[[3, 4]]], TypeError, "integer ids"),
                              ([[3, PAD, 4]], ValueError, r"seqs\[0\]: expected symbol ids in 3..9 .*got \[3, 0, 4\]"),
                              ([[5], [10]], ValueError, r"seqs\[1\]: expected symbol ids in 3..9")]:
        with pytest.raises(error, match=words):
            task.collate(bad)
