"""state.agreement on threads standing in for ranks (a real barrier-backed exchange): what is
sent, what is left alone, a repair, and the stop when ranks cannot be made equal. The same
protocol on real launchers: tests/integration/test_sync_agreement.py."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hvd_resilient.state.agreement import (
    Component,
    SyncDivergenceError,
    agree,
    broadcast_tree,
    digest_tree,
)


class ThreadCollectives:
    """`Collectives` over threads of one process: every call is a barrier-backed exchange."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self._rank, self.shared = rank, shared

    def rank(self) -> int:
        return self._rank

    def _exchange(self, value: Any) -> list[Any]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self._rank] = value
        barrier.wait(timeout=10)
        out = list(slots)
        barrier.wait(timeout=10)
        return out

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._exchange(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return self._exchange(obj)[0]

    def broadcast_bytes_(self, buffers: Sequence[torch.Tensor], tag: str) -> None:
        root = self._exchange([b.clone() for b in buffers])[0]
        for b, r in zip(buffers, root, strict=True):
            b.copy_(r)


SEEDING = threading.Lock()  # torch's default generator is one per process, not per thread


def seeded_linear(seed: int) -> torch.nn.Linear:
    with SEEDING:
        torch.manual_seed(seed)
        return torch.nn.Linear(3, 2)


def on_ranks(n: int, fn: Callable[[Any], Any],
             make: type[ThreadCollectives] = ThreadCollectives) -> list[Any]:
    shared = {"slots": [None] * n, "barrier": threading.Barrier(n)}
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(make(r, shared))
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_digest_sees_bytes_dtype_shape_and_structure_not_addresses():
    t = torch.arange(6, dtype=torch.float32)
    assert digest_tree({"a": t}) == digest_tree({"a": t.clone()})
    assert digest_tree({"a": t}) != digest_tree({"a": t.to(torch.float64)})
    assert digest_tree({"a": t}) != digest_tree({"a": t.reshape(2, 3)})
    bumped = t.clone()
    bumped[3] = torch.nextafter(bumped[3], torch.tensor(100.0))
    assert digest_tree({"a": t}) != digest_tree({"a": bumped})  # one ulp
    assert digest_tree({"a": 1, "b": 2}) == digest_tree({"b": 2, "a": 1})
    assert digest_tree({"f": object()}) == digest_tree({"f": object()})
    assert digest_tree({"b": torch.ones(2, dtype=torch.bfloat16)}) != \
        digest_tree({"b": torch.zeros(2, dtype=torch.bfloat16)})


def test_only_differing_components_are_sent_and_a_newcomer_gets_rank0s_optimizer():
    def rank(coll: ThreadCollectives) -> Any:
        model = seeded_linear(0 if coll.rank() < 2 else 7)  # rank 2 is a newcomer
        opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
        if coll.rank() < 2:
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
        comps = [Component("model", model.state_dict, model.load_state_dict),
                 Component("optimizer", opt.state_dict, opt.load_state_dict),
                 Component("counter", lambda: {"n": 5}, lambda _: None)]
        found = agree(comps, coll)
        return found, digest_tree(model.state_dict()), digest_tree(opt.state_dict())

    results = on_ranks(3, rank)
    assert not [r for r in results if isinstance(r, BaseException)], results
    found = results[0][0]
    assert sorted(found.sent) == ["model", "optimizer"] and found.ranks == [2], found
    assert found.repaired == []
    assert len({r[1] for r in results}) == 1 and len({r[2] for r in results}) == 1


def test_survivors_that_already_agree_send_nothing():
    def rank(coll: ThreadCollectives) -> Any:
        model = seeded_linear(0)
        return agree([Component("model", model.state_dict, model.load_state_dict)], coll)

    assert all(r.sent == [] for r in on_ranks(2, rank))


def test_a_component_that_takes_rank0s_values_only_the_second_time_is_repaired():
    def rank(coll: ThreadCollectives) -> Any:
        value = {"x": torch.full((2,), float(coll.rank()))}
        puts = []

        def put(tree: Any) -> None:
            puts.append(1)
            if len(puts) > 1:  # the first load is lost (a handler bug, say)
                value["x"] = tree["x"].clone()

        get = lambda: {"x": value["x"].clone()}  # noqa: E731 (a copy: no in-place receive)
        return agree([Component("c", get, put)], coll), value["x"]

    results = on_ranks(2, rank)
    found, x = results[1]
    assert found.repaired == ["c"] and torch.equal(x, torch.zeros(2))


def test_ranks_that_cannot_be_made_equal_stop_with_one_line():
    def rank(coll: ThreadCollectives) -> Any:
        value = {"x": torch.full((2,), float(coll.rank()))}
        get = lambda: {"x": value["x"].clone()}  # noqa: E731 (a copy: no in-place receive)
        return agree([Component("stubborn", get, lambda _: None)], coll)

    results = on_ranks(2, rank)
    assert all(isinstance(r, SyncDivergenceError) for r in results), results
    message = str(results[0])
    assert "stubborn" in message and "rank(s) 1" in message and "\n" not in message


def test_broadcast_tree_receives_in_place_where_it_can():
    def rank(coll: ThreadCollectives) -> Any:
        mine = {"w": torch.full((3,), float(coll.rank())), "step": coll.rank()}
        w = mine["w"]
        if coll.rank() == 1:
            mine["extra"] = torch.ones(1)
        got = broadcast_tree(mine, coll, tag="t")
        return got, w

    (root, _), (got, w) = on_ranks(2, rank)
    assert got["w"] is w and torch.equal(w, torch.zeros(3)), "not received in place"
    assert got["step"] == 0 and "extra" not in got


class CountingCollectives(ThreadCollectives):
    """Counts the collectives one rank takes part in."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        super().__init__(rank, shared)
        self.calls = 0

    def _exchange(self, value: Any) -> list[Any]:
        self.calls += 1
        return super()._exchange(value)


def test_a_newcomers_sync_costs_the_same_few_collectives_whatever_its_components():
    """A newcomer differs in every component; the whole world waits for its sync in a scale-up,
    so every differing component goes in one batch: digests, the batch (its structure, its
    bytes), digests again. Four exchanges for six components (it was fourteen)."""
    def rank(coll: CountingCollectives) -> Any:
        comps = [Component(f"c{i}", (lambda i=i: {"x": torch.full((2,), float(coll.rank() + i))}),
                           lambda _: None) for i in range(6)]
        kept: dict[str, Any] = {}
        comps = [Component(c.name, c.get, (lambda t, n=c.name: kept.__setitem__(n, t)))
                 for c in comps]
        if coll.rank() == 1:  # a component that takes what it is sent
            def unless_sent(n: str) -> Any:
                return kept.get(n) or {"x": torch.full((2,), -1.0)}

            comps = [Component(c.name, (lambda n=c.name: unless_sent(n)), c.put) for c in comps]
        found = agree(comps, coll)
        return found, coll.calls

    results = on_ranks(2, rank, CountingCollectives)
    assert not [r for r in results if isinstance(r, BaseException)], results
    (found, calls), (_, calls1) = results
    assert found.sent == [f"c{i}" for i in range(6)] and found.repaired == []
    assert calls == calls1 == 4


def test_the_rider_arrives_with_the_first_digests_before_anything_is_sent():
    """What a (re)start must exchange anyway (the detectors' offers, rank 0's committed
    attributes) rides in the first allgather: every rank sees every rider, by rank, before the
    send, and what the callback puts in a component is sent and proven like the rest."""
    def rank(coll: CountingCollectives) -> Any:
        value = {"step": 0 if coll.rank() else 7}
        seen: list[Any] = []

        def take(everyone: list[Any]) -> None:
            seen.extend(everyone)
            value["step"] = everyone[0]["committed"]  # rank 0's, as ObjectState.sync takes it

        comp = Component("attributes", lambda: dict(value), value.update)
        found = agree([comp], coll, rider={"committed": 5, "me": coll.rank()} if coll.rank() == 0
                      else {"me": coll.rank()}, on_riders=take)
        return found, seen, value["step"], coll.calls

    results = on_ranks(3, rank, CountingCollectives)
    assert not [r for r in results if isinstance(r, BaseException)], results
    for found, seen, step, calls in results:
        assert [s["me"] for s in seen] == [0, 1, 2]
        assert step == 5
        # what differed before the riders is still sent (the digests were taken then), and
        # proven equal after
        assert found.sent == ["attributes"] and found.repaired == [] and calls == 4
