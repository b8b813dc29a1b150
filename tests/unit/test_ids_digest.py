"""The digest of consumed sample ids (hvd_resilient/state/ids_digest.py) and the samplers' tally
of it: order-independent, a duplicated or a missing sample changes it and is named, and the
tally survives restores, resizes and checkpoints like the position it is committed with."""

from __future__ import annotations

import copy
import io
import random
from functools import reduce

import pytest
import torch

from hvd_resilient.state import ids_digest as d
from hvd_resilient.state.sampler import ElasticDataSampler, ElasticShardSampler

N = 500


def test_mix_is_a_bijection_that_unmix_inverts() -> None:
    rng = random.Random(7)
    for i in [0, 1, 2, N, 2**32, 2**63, d.MASK, *(rng.getrandbits(64) for _ in range(500))]:
        assert d.unmix(d.mix(i)) == i
    hashes = {d.mix(i) for i in range(20_000)}
    assert len(hashes) == 20_000


def test_vectorised_digest_equals_the_plain_one() -> None:
    rng = random.Random(1)
    ids = [rng.randrange(10**9) for _ in range(3000)]
    assert d.digest_array(ids) == d.digest(ids)
    assert d.digest_array([]) == d.digest([]) == 0
    assert d.digest_range(0, 12_345) == d.digest(range(12_345))
    assert d.digest_range(10, 10) == 0


def test_the_digest_does_not_depend_on_the_order() -> None:
    ids = list(range(N))
    shuffled = ids[:]
    random.Random(3).shuffle(shuffled)
    assert d.digest(shuffled) == d.digest(ids) == d.digest_range(0, N)
    # nor on how the ids are split into steps (the samplers add one step at a time)
    steps = [shuffled[i:i + 37] for i in range(0, N, 37)]
    assert reduce(lambda acc, s: (acc + d.digest_array(s)) & d.MASK, steps, 0) == d.digest(ids)


def test_a_duplicated_sample_is_detected_and_named() -> None:
    ids = list(range(N))
    twice = ids + [123]
    assert d.digest(twice) != d.digest(ids)
    assert d.single_id(d.digest(twice) - d.digest(ids), N) == 123
    # Used three times: XOR of the hashes cannot see it (it counts parity), the sum can.
    thrice = ids + [123, 123]
    xor = reduce(lambda a, b: a ^ b, map(d.mix, ids))
    assert reduce(lambda a, b: a ^ b, map(d.mix, thrice)) == xor
    assert d.digest(thrice) != d.digest(ids)


def test_a_missing_sample_is_detected_and_named() -> None:
    ids = [i for i in range(N) if i != 321]
    assert d.digest(ids) != d.digest_range(0, N)
    assert d.single_id(d.digest_range(0, N) - d.digest(ids), N) == 321
    # one missing and another used twice: the count is right, the digest is not
    swapped = [*ids, 5]
    assert len(swapped) == N and d.digest(swapped) != d.digest_range(0, N)


def test_a_difference_of_several_samples_names_none() -> None:
    diff = d.mix(3) + d.mix(4)
    assert d.single_id(diff, N) is None


def test_hex_round_trip() -> None:
    assert d.from_hex(d.to_hex(d.MASK)) == d.MASK
    assert d.to_hex(5) == "0000000000000005"
    for bad in (None, 5, "xyz", "00000000000000zz", "0" * 15):
        assert d.from_hex(bad) is None


# -- the samplers' tally ------------------------------------------------------------------------


def data_sampler() -> ElasticDataSampler:
    return ElasticDataSampler(N, seed=4)


def shard_sampler() -> ElasticShardSampler:
    return ElasticShardSampler([50, 120, 0, 30, 200, 100], seed=4)


def step(s, size: int, batch: int = 7) -> list[int]:
    ids = [i for r in range(size) for i in s.next_slice(r, size, batch).indices]
    s.advance(s.next_slice(0, size, batch).global_count)
    return ids


def assert_exactly_once(record: dict) -> None:
    assert record["samples"] == record["expected_samples"] == N
    assert record["ids_digest"] == record["expected_ids_digest"] == d.to_hex(d.digest_range(0, N))
    assert record["digest"] == d.METHOD


@pytest.mark.parametrize("make", [data_sampler, shard_sampler], ids=["map", "shards"])
def test_the_tally_of_an_epoch_with_a_rollback_and_resizes_is_the_data_set(make) -> None:
    s = make()
    used: list[int] = []
    for _ in range(10):
        used += step(s, 3)
    commit = copy.deepcopy(s.state_dict())
    committed = len(used)
    for _ in range(6):  # trained, then a rank died: undone
        used += step(s, 3)
    s.load_state_dict(copy.deepcopy(commit))
    del used[committed:]
    sizes = [2, 4, 1]
    k = 0
    while not s.epoch_done():
        used += step(s, sizes[k % 3])
        k += 1
    assert sorted(used) == list(range(N))
    rec = s.epoch_record()
    assert rec["epoch"] == 0
    assert_exactly_once(rec)
    s.set_epoch(1)
    assert s.epoch_record()["samples"] == 0


@pytest.mark.parametrize("make", [data_sampler, shard_sampler], ids=["map", "shards"])
def test_a_restore_that_keeps_the_tally_but_not_the_position_is_caught(make) -> None:
    """What the event exists for: consumed ids and position must come back together."""
    s = make()
    for _ in range(10):
        step(s, 2)
    commit = copy.deepcopy(s.state_dict())
    for _ in range(5):
        step(s, 2)
    stale = {**commit, "ids_count": s.ids_count, "ids_digest": s.ids_digest}
    s.load_state_dict(stale)  # the position rolled back, the tally did not: 5 steps twice
    while not s.epoch_done():
        step(s, 2)
    rec = s.epoch_record()
    assert rec["samples"] == N + 5 * 2 * 7
    assert rec["ids_digest"] != rec["expected_ids_digest"]


@pytest.mark.parametrize("make", [data_sampler, shard_sampler], ids=["map", "shards"])
def test_the_tally_travels_in_a_checkpoint(make) -> None:
    """torch.save / torch.load(weights_only=True), as durable checkpoints and the memory tier
    store the sampler: a digest above 2**63 included."""
    s = make()
    for _ in range(9):
        step(s, 3)
    s.ids_digest = d.MASK - 3  # the largest values must survive too
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    other = make()
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert (other.ids_count, other.ids_digest) == (s.ids_count, d.MASK - 3)
    assert other.position() == s.position()


@pytest.mark.parametrize("make", [data_sampler, shard_sampler], ids=["map", "shards"])
def test_a_state_from_before_the_tally_leaves_that_epoch_unknown(make) -> None:
    s = make()
    for _ in range(4):
        step(s, 2)
    old = {k: v for k, v in s.state_dict().items() if not k.startswith("ids_")}
    other = make()
    other.load_state_dict(old)
    while not other.epoch_done():
        step(other, 2)
    rec = other.epoch_record()
    assert rec["samples"] is None and rec["ids_digest"] is None
    other.set_epoch(1)  # the next epoch counts again
    while not other.epoch_done():
        step(other, 2)
    assert_exactly_once(other.epoch_record())
    # an older state at an epoch's start has consumed nothing: known to be empty
    fresh = make()
    fresh.load_state_dict({k: v for k, v in make().state_dict().items()
                           if not k.startswith("ids_")})
    assert (fresh.ids_count, fresh.ids_digest) == (0, 0)


def test_a_planning_copy_does_not_count() -> None:
    """The loader's plan runs a copy of the sampler ahead; only the real one keeps a tally."""
    from hvd_resilient.config import DataOptions
    from hvd_resilient.data.loader import ElasticLoader

    s = ElasticDataSampler(64, shuffle=False)
    data = [torch.tensor([float(i)]) for i in range(64)]
    with ElasticLoader(data, s, batch_size=8, options=DataOptions(num_workers=0)) as loader:
        while not s.epoch_done():
            b = loader.next_batch(0, 1)
            s.advance(b.global_count)
        plan = loader._sync_plan
        assert plan is not None and plan.sampler.track_ids is False
        assert plan.sampler.ids_count == 0  # it ran ahead, counting nothing
    rec = s.epoch_record()
    assert rec["samples"] == 64 and rec["ids_digest"] == d.to_hex(d.digest_range(0, 64))
