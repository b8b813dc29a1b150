"""The exact-once sampler: every sample of an epoch used once, whatever the resizes."""

from __future__ import annotations

import random

import pytest

from hvd_resilient.state.sampler import ElasticDataSampler


def run_epoch(sampler: ElasticDataSampler, sizes: list[int], batch: int) -> list[int]:
    """Simulates steps with the world size changing between steps; returns the ids used."""
    used: list[int] = []
    i = 0
    while not sampler.epoch_done():
        size = sizes[i % len(sizes)]
        slices = [sampler.next_slice(r, size, batch) for r in range(size)]
        assert len({s.global_count for s in slices}) == 1
        for s in slices:
            used.extend(s.indices)
        sampler.advance(slices[0].global_count)
        i += 1
    return used


@pytest.mark.parametrize("n,batch", [(100, 7), (1, 4), (33, 1), (1000, 32)])
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4], [4, 2, 7, 1]])
def test_every_sample_once_per_epoch_across_resizes(n, batch, sizes):
    s = ElasticDataSampler(n, seed=3)
    used = run_epoch(s, sizes, batch)
    assert sorted(used) == list(range(n))


def test_state_round_trip_mid_epoch_continues_identically():
    a = ElasticDataSampler(500, seed=1)
    for _ in range(5):
        a.advance(a.next_slice(0, 3, 10).global_count)
    b = ElasticDataSampler(500, seed=1)
    b.load_state_dict(a.state_dict())
    assert run_epoch(a, [2], 10) == run_epoch(b, [2], 10)


def test_epochs_are_shuffled_differently_and_deterministically():
    s1, s2 = ElasticDataSampler(50, seed=0), ElasticDataSampler(50, seed=0)
    e0 = s1.permutation()[:]
    s1.set_epoch(1)
    assert s1.permutation() != e0
    s2.set_epoch(1)
    assert s2.permutation() == s1.permutation()
    assert ElasticDataSampler(50, shuffle=False).permutation() == list(range(50))


def test_last_step_with_fewer_samples_than_ranks_gives_some_ranks_none():
    s = ElasticDataSampler(3, shuffle=False)
    slices = [s.next_slice(r, 4, 8) for r in range(4)]
    assert [len(x.indices) for x in slices] == [1, 1, 1, 0]
    assert slices[0].global_count == 3


def test_resume_with_other_dataset_size_is_refused():
    s = ElasticDataSampler(10)
    with pytest.raises(ValueError, match="same data set"):
        ElasticDataSampler(11).load_state_dict(s.state_dict())


def test_random_resize_schedules():
    rnd = random.Random(7)
    for _ in range(50):
        n = rnd.randint(1, 300)
        s = ElasticDataSampler(n, seed=rnd.randint(0, 9))
        sizes = [rnd.randint(1, 8) for _ in range(rnd.randint(1, 5))]
        assert sorted(run_epoch(s, sizes, rnd.randint(1, 16))) == list(range(n))
