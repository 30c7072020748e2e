"""npformer.runtime.random: Philox4x32-10 against the published known-answer vectors (Random123's
kat_vectors), the stream's offsets and state, and the statistics of the 16-bit values."""
import os
import threading

import numpy as np
import pytest

import autograd
from npformer.runtime import random, threads

from helpers import child_exit_code

# counter (4 words), key (2 words) -> output (4 words), from Random123's kat_vectors
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox4x32_10_matches_the_published_known_answers(counter, key, expected, device):
    xp = autograd.backend.module_for(device)
    words = random.philox4x32([xp.asarray([c], dtype="uint64") for c in counter], key)
    assert [int(w[0]) for w in words] == list(expected)


def test_bits16_are_the_halves_of_the_philox_words_in_order():
    """Counter n (as two words) under key (seed low, seed high): value 8n + 2m is the low half
    of word m, 8n + 2m + 1 its high half."""
    seed, n = (0xa4093822 << 32) | 0x299f31d0, 3
    words = random.philox4x32([np.array([n], dtype=np.uint64), np.zeros(1, np.uint64),
                               np.zeros(1, np.uint64), np.zeros(1, np.uint64)], (seed & 0xFFFFFFFF, seed >> 32))
    expected = [h for w in words for h in (int(w[0]) & 0xFFFF, int(w[0]) >> 16)]
    assert random.bits16(seed, 8 * n, 8).tolist() == expected


def test_any_slice_of_the_stream_can_be_drawn_alone_on_any_device_and_thread_count(device):
    whole = random.bits16(7, 0, 9000)
    saved = threads.get_num_threads()
    try:
        threads.set_num_threads(2)
        for offset, n in ((0, 5000), (3, 1), (13, 4000), (4999, 1), (8 * 1000 + 5, 17)):
            part = autograd.backend.as_numpy(random.bits16(7, offset, n, device))
            np.testing.assert_array_equal(part, whole[offset:offset + n])
    finally:
        threads.set_num_threads(saved)


def test_the_stream_advances_by_whole_counters_and_its_state_is_two_ints():
    stream = random.Philox(seed=11)
    assert stream.take(5) == 0 and stream.offset == 8       # every draw starts on a fresh counter
    first = stream.bits16(20)
    assert stream.offset == 8 + 24
    np.testing.assert_array_equal(first, random.bits16(11, 8, 20))
    state = stream.state_dict()
    assert state == {"seed": 11, "offset": 32}
    again = random.Philox()
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.bits16(9), stream.bits16(9))


def test_manual_seed_makes_the_dropout_stream_reproducible():
    random.manual_seed(3)
    a = random.dropout_stream().bits16(100)
    random.manual_seed(3)
    np.testing.assert_array_equal(random.dropout_stream().bits16(100), a)
    random.manual_seed(4)
    assert (random.dropout_stream().bits16(100) != a).any()


def takes_in_threads(take, count=4, each=2000):
    """The offsets that `count` threads started together get from `each` calls of take(8) each."""
    start = threading.Barrier(count)
    offsets = [[] for _ in range(count)]

    def work(mine):
        start.wait()
        mine.extend(take(8) for _ in range(each))
    workers = [threading.Thread(target=work, args=(mine,)) for mine in offsets]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return [offset for mine in offsets for offset in mine]


def test_threads_sharing_a_stream_never_get_the_same_values(frequent_switches):
    """Two threads dropping out with one stream (the global one: two models trained side by side)
    reserve disjoint values, like torch's generator (it holds a lock): otherwise both could read
    the same offset and draw the same mask. The first use after manual_seed too, which seeds it."""
    stream = random.Philox(5)
    offsets = takes_in_threads(stream.take)
    assert len(set(offsets)) == len(offsets) and stream.offset == 8 * len(offsets)
    for _ in range(20):
        random.manual_seed(5)
        offsets = takes_in_threads(lambda n: random.dropout_stream().take(n), each=1)
        assert sorted(offsets) == list(range(0, 8 * len(offsets), 8))


def test_threads_first_using_the_global_generator_share_one(monkeypatch):
    """Two threads initialising models at once after manual_seed: both draw from the one global
    generator (torch's default generator), not from two identically seeded copies, which would give
    both models the same weights and leave the global generator's stream depending on timing."""
    both_inside = threading.Barrier(2, timeout=1)
    make = random.default_rng

    def slow_default_rng(*args):                  # both threads making the generator at once, if they can
        try:
            both_inside.wait()
        except threading.BrokenBarrierError:      # the other thread waits for this one: as it should
            pass
        return make(*args)
    monkeypatch.setattr(random, "default_rng", slow_default_rng)
    random.manual_seed(0)
    got = [None, None]

    def first_use(i):
        got[i] = random.global_rng("cpu")
    workers = [threading.Thread(target=first_use, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    assert got[0] is got[1] is random.global_rng("cpu")


def test_a_child_forked_while_another_thread_draws_can_draw():
    """os.fork (multiprocessing's "fork" start method) while another thread holds the streams' lock
    (reserving dropout values, seeding): the child has no such thread, so the lock must not stay
    held there, or the child's first dropout waits forever."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        with random._streams_lock:
            holding.set()
            release.wait(10)
    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    pid = os.fork()
    if pid == 0:                                  # the child: never returns into pytest
        code = 1
        try:
            random.manual_seed(3)
            code = 0 if random.Philox(1).take(8) == 0 and random.dropout_stream().take(8) == 0 else 3
        finally:
            os._exit(code)
    release.set()
    holder.join(10)
    assert child_exit_code(pid, 10, "the forked child hung on the lock held by a thread of the parent") == 0


def test_the_values_are_uniform_and_independent():
    """1e6 values: each of 16 bins holds 1/16 (chi-square, 15 dof, p > 1e-6), the mean of the
    keep test at p = 0.1 is within 5 sigma, and neighbouring values are uncorrelated."""
    values = random.bits16(2024, 0, 1_000_000).astype(np.float64)
    counts = np.bincount((values // 4096).astype(int), minlength=16)
    expected = values.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 58.0          # chi2(15) quantile at 1 - 1e-6
    keep = values >= round(0.1 * 2**16)
    sigma = np.sqrt(0.1 * 0.9 / values.size)
    assert abs((1 - keep.mean()) - 0.1) < 5 * sigma
    centred = values - values.mean()
    for lag in (1, 2, 8):
        correlation = (centred[:-lag] * centred[lag:]).mean() / centred.var()
        assert abs(correlation) < 5 / np.sqrt(values.size)
