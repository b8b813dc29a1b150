"""The coordinator's decisions across hosts (`launch/inplace/decide.py`), from reports alone:
the rules that the agents carry out, without a process."""

from __future__ import annotations

from hvd_resilient.backends.inplace.membership import MEMBER_STRIDE, host_of
from hvd_resilient.launch.inplace.decide import Coordinator, HostReport

H1 = MEMBER_STRIDE  # host 1's first member


def nobody_at_the_door(g: int, members: list[int]) -> set[int]:
    return set()


def started(coord: Coordinator, reports: dict[int, HostReport]) -> None:
    d = coord.first(reports)
    assert d.publish == [0, 1, H1, H1 + 1]


def two_hosts() -> dict[int, HostReport]:
    return {0: HostReport(start=[0, 1], alive=[0, 1]),
            1: HostReport(start=[H1, H1 + 1], alive=[H1, H1 + 1])}


def test_member_ids_say_their_host():
    assert host_of(3) == 0 and host_of(H1 + 3) == 1 and host_of(2 * MEMBER_STRIDE) == 2


def test_generation_zero_is_every_hosts_first_workers_host_by_host():
    coord = Coordinator(4, 1, 60.0)
    started(coord, {1: HostReport(start=[H1 + 1, H1]), 0: HostReport(start=[1, 0])})


def test_a_host_no_longer_heard_from_costs_its_members_once_the_others_asked():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    survivors = {0: HostReport(alive=[0, 1], asked={0: 0})}
    assert coord.step(survivors, 1.0, nobody_at_the_door).publish is None  # 1 still training
    survivors[0].asked[1] = 0
    assert coord.step(survivors, 1.1, nobody_at_the_door).publish == [0, 1]


def test_survivors_keep_their_ranks_and_newcomers_come_after_them():
    """Rank 0 must hold the state the sync spreads: host 0's members all died, a replacement
    started there gets a lower id than host 1's survivors and must still not become rank 0."""
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    reports = {0: HostReport(alive=[2], ready=[2]),
               1: HostReport(alive=[H1, H1 + 1], asked={H1: 0, H1 + 1: 0})}
    d = coord.step(reports, 1.0, nobody_at_the_door)
    assert d.publish == [H1, H1 + 1, 2], d


def test_a_member_silent_to_its_peers_is_fenced_on_whichever_host():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    reports = two_hosts()
    reports[0].evict = {H1 + 1: "no heartbeat for 1.5s"}
    reports[0].asked = {0: 0, 1: 0}
    reports[1].asked = {H1: 0}
    d = coord.step(reports, 1.0, nobody_at_the_door)
    assert set(d.fence) == {H1 + 1} and "silent" in d.fence[H1 + 1]
    assert d.publish == [0, 1, H1]


def test_a_member_that_never_asks_is_fenced_at_the_last_call():
    coord = Coordinator(4, 1, 0.5)
    started(coord, two_hosts())
    reports = two_hosts()
    reports[0].asked = {0: 0, 1: 0}
    reports[1].asked = {H1: 0}
    assert coord.step(reports, 10.0, nobody_at_the_door).publish is None
    d = coord.step(reports, 10.6, nobody_at_the_door)
    assert d.publish == [0, 1, H1] and set(d.fence) == {H1 + 1}


def test_a_busy_member_is_waited_for_past_the_last_call():
    coord = Coordinator(4, 1, 0.5)
    started(coord, two_hosts())
    reports = two_hosts()
    reports[0].asked = {0: 0, 1: 0}
    reports[1].asked = {H1: 0}
    reports[1].busy = [H1 + 1]
    coord.step(reports, 10.0, nobody_at_the_door)
    d = coord.step(reports, 20.0, nobody_at_the_door)
    assert d.publish is None and not d.fence


def test_below_min_np_every_live_member_is_fenced_and_the_job_ends_1():
    coord = Coordinator(4, 3, 60.0)
    started(coord, two_hosts())
    d = coord.step({0: HostReport(alive=[0, 1], asked={0: 0, 1: 0})}, 1.0, nobody_at_the_door)
    assert d.end == 1 and set(d.fence) == {0, 1} and d.publish is None


def test_the_end_code_is_a_workers_own_never_a_signals():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    d = coord.step({0: HostReport(failed={0: -9, 1: 78}), 1: HostReport(failed={H1: 3})}, 1.0,
                   nobody_at_the_door)
    assert d.end == 78
    done = Coordinator(4, 1, 60.0)
    started(done, two_hosts())
    assert done.step({0: HostReport(finished=[0, 1]), 1: HostReport(finished=[H1, H1 + 1])},
                     1.0, nobody_at_the_door).end == 0


def test_a_finished_member_ends_the_run_without_a_new_generation():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    reports = two_hosts()
    reports[1] = HostReport(alive=[H1 + 1, H1 + 2], finished=[H1], ready=[H1 + 2])
    d = coord.step(reports, 1.0, nobody_at_the_door)
    assert d.finishing and d.publish is None


def test_members_at_the_door_count_as_asking_when_a_member_is_lost():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    reports = {0: HostReport(alive=[0, 1]), 1: HostReport(alive=[H1])}
    d = coord.step(reports, 1.0, lambda g, members: set(members))
    assert d.publish == [0, 1, H1]


def test_a_waiting_worker_joins_while_there_is_a_place():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    coord.step({0: HostReport(alive=[0, 1], asked={0: 0, 1: 0}),
                1: HostReport(alive=[H1], asked={H1: 0})}, 1.0, nobody_at_the_door)
    assert coord.members == [0, 1, H1]
    d = coord.step({0: HostReport(alive=[0, 1]), 1: HostReport(alive=[H1, H1 + 5],
                                                               ready=[H1 + 5])},
                   2.0, nobody_at_the_door)
    assert d.publish == [0, 1, H1, H1 + 5]


def test_a_late_hosts_slots_make_room_for_its_workers_and_no_more():
    """A host a discovery script added: its workers join at once, up to its slots; a standby
    of the first hosts gets no place beyond the job's size while nobody is lost."""
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    h2 = 2 * MEMBER_STRIDE
    reports = {**two_hosts(), 2: HostReport(alive=[h2, h2 + 1], ready=[h2, h2 + 1], slots=2,
                                            late=True)}
    reports[0].alive, reports[0].ready = [0, 1, 2], [2]  # host 0's standby
    d = coord.step(reports, 1.0, nobody_at_the_door)
    assert d.publish == [0, 1, H1, H1 + 1, h2, h2 + 1], d


def test_a_leaving_hosts_members_are_left_out_at_a_commit_and_nobody_is_fenced():
    coord = Coordinator(4, 2, 60.0)
    started(coord, two_hosts())
    reports = two_hosts()
    reports[0].leaving = True  # the coordinating host's own (rank 0 among them)
    d = coord.step(reports, 1.0, nobody_at_the_door)
    assert d.publish == [H1, H1 + 1] and not d.fence and d.end is None, d
    # once published, the leaving ones exit when they find themselves left out: no new one
    assert coord.step({1: HostReport(alive=[H1, H1 + 1])}, 2.0, nobody_at_the_door).publish \
        is None


def test_a_fault_while_a_host_leaves_keeps_its_members_out():
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    reports = {0: HostReport(alive=[0], asked={0: 0}, leaving=True),
               1: HostReport(alive=[H1, H1 + 1], asked={H1: 0, H1 + 1: 0})}
    assert coord.step(reports, 1.0, nobody_at_the_door).publish == [H1, H1 + 1]


def test_leaving_below_min_np_ends_the_job_for_a_relaunch():
    coord = Coordinator(4, 3, 60.0)
    started(coord, two_hosts())
    reports = two_hosts()
    reports[1].leaving = True
    d = coord.step(reports, 1.0, nobody_at_the_door)
    assert d.end == 1 and d.publish is None, d


def test_reports_cross_the_wire_unchanged():
    rep = HostReport(start=[0], alive=[0, H1], asked={H1: 3}, ready=[2], busy=[0],
                     finished=[5], failed={6: -9}, evict={H1: "silent"}, stopping=True,
                     unadopted=None, slots=2, late=True, leaving=True)
    assert HostReport.from_json(rep.to_json()) == rep


def test_every_survivor_names_the_same_successor_from_the_newest_record():
    from hvd_resilient.launch.inplace.decide import Record
    from hvd_resilient.launch.inplace.embedded import successor

    record = Record(3, [H1, 2 * MEMBER_STRIDE], "a:1", {0: "a:1", 2: "c:1", 1: "b:1"})
    assert successor(record, {0}) == 1 and successor(record, {1}) == 0
    assert successor(record, {0, 1}) == 2  # the first successor went too
    assert successor(Record(3, [0], "a:1", {0: "a:1"}), {0}) is None


def test_of_two_sides_of_any_cut_at_most_one_has_a_quorum():
    """Every split of 1..5 hosts into two sides: never both go on; with no host known to
    have exited, exactly one goes on unless neither holds half (then the job relaunches)."""
    from itertools import combinations

    from hvd_resilient.launch.inplace.decide import has_quorum

    for n in range(1, 6):
        base = set(range(n))
        for k in range(n + 1):
            for side in combinations(sorted(base), k):
                a, b = set(side), base - set(side)
                assert not (has_quorum(a, base) and has_quorum(b, base)), (a, b)
                if 2 * len(a) != len(base) or n == 0:
                    continue
                assert has_quorum(a, base) != has_quorum(b, base), (a, b)  # a tie: host 0's
    assert has_quorum({0}, {0, 1}) and not has_quorum({1}, {0, 1})
    assert has_quorum({1, 2}, {0, 1, 2}) and not has_quorum({0}, {0, 1, 2})
    assert has_quorum({1}, {1})  # the others exited (their connections closed)


def test_a_late_hosts_workers_join_together_or_after_a_bound():
    """One move for the members per host that joins, not one per newcomer: the first ready
    worker waits for its host's others (at most TOGETHER_S)."""
    from hvd_resilient.launch.inplace.decide import TOGETHER_S

    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    h2 = 2 * MEMBER_STRIDE

    def look(ready: list[int], now: float) -> list[int] | None:
        reports = {**two_hosts(), 2: HostReport(alive=[h2, h2 + 1], ready=ready, slots=2,
                                                late=True)}
        return coord.step(reports, now, nobody_at_the_door).publish

    assert look([h2 + 1], 1.0) is None
    assert look([h2 + 1, h2], 1.5) == [0, 1, H1, H1 + 1, h2, h2 + 1]
    coord = Coordinator(4, 1, 60.0)
    started(coord, two_hosts())
    assert look([h2], 1.0) is None
    assert look([h2], 1.0 + TOGETHER_S) == [0, 1, H1, H1 + 1, h2]
