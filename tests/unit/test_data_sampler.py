"""The elastic shard sampler: every sample of an epoch once, each rank reading whole shards,
whatever the world sizes; every rank computes the same state without talking."""

from __future__ import annotations

import copy
import random

import pytest

from hvd_resilient.state.sampler import ElasticDataSampler, ElasticShardSampler


def run_epoch(s: ElasticShardSampler, sizes: list[int], batch: int,
              per_rank: dict[int, list[int]] | None = None) -> list[int]:
    used: list[int] = []
    i = 0
    while not s.epoch_done():
        size = sizes[i % len(sizes)]
        slices = [s.next_slice(r, size, batch) for r in range(size)]
        assert len({x.global_count for x in slices}) == 1
        assert sum(len(x.indices) for x in slices) == slices[0].global_count
        for r, x in enumerate(slices):
            assert len(x.indices) <= batch
            used.extend(x.indices)
            if per_rank is not None:
                per_rank.setdefault(r, []).extend(x.indices)
        s.advance(slices[0].global_count)
        i += 1
    return used


SIZES = [[1], [2], [3, 1, 4], [4, 2, 7, 1], [2, 3, 2]]


@pytest.mark.parametrize("shards", [[100] * 10, [1, 50, 0, 7, 300, 2], [5] * 40, [1000]])
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_per_epoch_across_resizes(shards, sizes, shuffle):
    s = ElasticShardSampler(shards, shuffle=shuffle, seed=5)
    for epoch in range(2):
        used = run_epoch(s, sizes, 8)
        assert sorted(used) == list(range(sum(shards))), f"epoch {epoch}"
        s.set_epoch(s.epoch + 1)


def test_a_rank_reads_whole_shards_not_every_shards_every_wth_sample():
    """At a fixed world size, rank r's ids come from few shards, each read to its end by that
    rank (the point of the split: a rank fetches about 1/W of the data)."""
    shards = [200] * 12
    s = ElasticShardSampler(shards, shuffle=True, seed=1)
    per_rank: dict[int, list[int]] = {}
    run_epoch(s, [3], 16, per_rank)
    readers: dict[int, set[int]] = {}
    for r, ids in per_rank.items():
        for i in ids:
            readers.setdefault(i // 200, set()).add(r)
    assert all(len(v) == 1 for v in readers.values()), readers
    assert sorted(len({i // 200 for i in ids}) for ids in per_rank.values()) == [4, 4, 4]


def test_shrinking_parks_the_cursors_of_the_lost_slots_and_finishes_them_later():
    s = ElasticShardSampler([100] * 6, shuffle=False)
    for _ in range(3):  # 3 ranks, 10 each: three shards opened, 30 read of each
        s.next_slice(0, 3, 10)
        s.advance(30)
    assert [c[1] for c in s.slots] == [30, 30, 30]
    s.next_slice(0, 1, 10)
    s.advance(10)
    assert [c[1] for c in s.parked] == [30, 30], "slots 1 and 2 went away mid-shard"
    # the survivor finishes its shard, then takes the parked ones before opening new shards
    seen: list[int] = []
    while not s.epoch_done():
        sl = s.next_slice(0, 1, 50)
        seen.extend(sl.indices)
        s.advance(sl.global_count)
    assert seen[:60] == list(range(40, 100)), "its own shard first"
    assert seen[60:130] == list(range(130, 200)), "then the first parked one, from offset 30"
    assert seen[130:200] == list(range(230, 300)), "then the second"


def test_every_rank_computes_the_same_state_and_a_state_round_trip_continues_identically():
    shards = [37, 64, 5, 120, 99]
    a = ElasticShardSampler(shards, seed=2)
    replicas = [copy.deepcopy(a) for _ in range(3)]
    rng = random.Random(0)
    for _ in range(15):
        size = rng.choice([1, 2, 3])
        for r, rep in enumerate(replicas):  # each rank plans only its own slice
            sl = rep.next_slice(r % size, size, 6)
            rep.advance(sl.global_count)
    states = [rep.state_dict() for rep in replicas]
    assert states[0] == states[1] == states[2]
    b = ElasticShardSampler(shards, seed=2)
    b.load_state_dict(states[0])
    assert b.position() == replicas[0].position()
    assert run_epoch(b, [2], 7) == run_epoch(replicas[0], [2], 7)


def test_a_state_from_other_shards_or_another_sampler_is_refused():
    s = ElasticShardSampler([10, 10])
    with pytest.raises(ValueError, match="same shards"):
        s.load_state_dict(ElasticShardSampler([10, 11]).state_dict())
    with pytest.raises(ValueError, match="streamed shards"):
        s.load_state_dict(ElasticDataSampler(20).state_dict())
    with pytest.raises(ValueError, match="no samples"):
        ElasticShardSampler([0, 0])


def test_advance_applies_only_the_planned_step():
    s = ElasticShardSampler([10, 10], shuffle=False)
    with pytest.raises(RuntimeError, match="next_slice"):
        s.advance(4)
    sl = s.next_slice(0, 2, 2)
    with pytest.raises(ValueError, match="planned step"):
        s.advance(sl.global_count + 1)
    s.advance(sl.global_count)
    assert s.consumed == 4


def test_epochs_are_shuffled_differently_and_deterministically():
    def order(epoch: int) -> list[int]:
        s = ElasticShardSampler([20] * 5, seed=9)
        s.set_epoch(epoch)
        return run_epoch(s, [1], 20)

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(1)) == list(range(100))


def test_positions_tell_steps_apart():
    a = ElasticDataSampler(50)
    p0 = a.position()
    a.advance(a.next_slice(0, 2, 4).global_count)
    assert a.position() != p0 and hash(a.position()) is not None
    s = ElasticShardSampler([10, 10])
    q0 = s.position()
    s.advance(s.next_slice(0, 2, 3).global_count)
    assert s.position() != q0 and hash(s.position()) is not None
