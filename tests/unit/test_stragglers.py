"""The straggler rule, the observer's exchange and eviction, the `slow` fault, and the report's
straggler section, in process (the real jobs are in tests/integration/test_stragglers.py)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest

from hvd_resilient.config import ObservabilityOptions, TrainConfig
from hvd_resilient.errors import ConfigError
from hvd_resilient.observability import Observer
from hvd_resilient.observability.stragglers import (
    RankTiming,
    StragglerDetector,
    StragglerRule,
    compare,
)
from hvd_resilient.report import analyze
from hvd_resilient.report.text import render
from hvd_resilient.training.faults import FaultPlan

RULE = StragglerRule(window_steps=20, ratio=1.3, windows=3, min_seconds=0.005)


def window(computes: list[float], steps: int = 20, hosts: list[str] | None = None
           ) -> list[RankTiming]:
    hosts = hosts or [f"h{r}" for r in range(len(computes))]
    return [RankTiming(r, hosts[r], 100 + r, steps, c, 0.0) for r, c in enumerate(computes)]


def test_a_rank_slow_for_k_windows_is_reported_once_with_its_ratio() -> None:
    det = StragglerDetector(RULE)
    verdicts = [det.judge(window([0.02, 0.05, 0.021])) for _ in range(5)]
    assert [v.reported for v in verdicts[:2]] == [[], []]  # two windows are not persistence
    (t,) = verdicts[2].reported
    assert t.rank == 1 and t.host == "h1"
    assert verdicts[2].ratios[1] == pytest.approx(0.05 / 0.0205)
    assert verdicts[3].reported == [] and verdicts[4].flagged == [1]  # reported once


def test_one_fast_window_starts_the_count_again_and_clears_a_report() -> None:
    det = StragglerDetector(RULE)
    slow, fast = window([0.02, 0.05]), window([0.02, 0.021])
    assert [bool(det.judge(w).reported) for w in (slow, slow, fast, slow, slow)] == [False] * 5
    assert det.judge(slow).reported  # the third in a row
    v = det.judge(fast)
    assert [t.rank for t in v.cleared] == [1] and v.flagged == []


def test_two_ranks_compare_with_the_other_not_with_the_mean() -> None:
    ratios, others = compare(window([0.01, 0.03]))
    assert ratios == {0: pytest.approx(1 / 3), 1: pytest.approx(3.0)}
    assert others == {0: 0.03, 1: 0.01}


def test_a_large_ratio_between_tiny_steps_is_noise() -> None:
    det = StragglerDetector(RULE)
    for _ in range(10):  # 2.5x, but only 3 ms: below min_seconds
        v = det.judge(window([0.002, 0.005, 0.002]))
        assert v.evaluated and v.reported == [] and v.ratios[1] > 2


def test_noisy_healthy_ranks_are_never_reported() -> None:
    """Medians of jittery steps with rare 10x spikes, 3 and 8 ranks, 2000 windows each."""
    rng = random.Random(7)
    for n in (3, 8):
        det = StragglerDetector(RULE)
        for _ in range(2000):
            medians = []
            for _r in range(n):
                steps = [0.02 * rng.lognormvariate(0, 0.25) * (10 if rng.random() < 0.03 else 1)
                         for _ in range(20)]
                medians.append(sorted(steps)[10])
            assert det.judge(window(medians)).reported == []


def test_a_window_cut_short_by_a_reset_is_not_judged() -> None:
    det = StragglerDetector(RULE)
    for _ in range(2):
        det.judge(window([0.02, 0.05]))
    v = det.judge(window([0.02, 0.05], steps=5))  # < half the window
    assert not v.evaluated and v.reported == []
    assert det.streaks["h1:101"] == 2  # neither counted nor reset
    assert det.judge(window([0.02, 0.05])).reported


def test_a_process_is_followed_across_renumbering_and_forgotten_when_gone() -> None:
    det = StragglerDetector(RULE)
    det.judge(window([0.02, 0.05, 0.02]))
    det.judge(window([0.02, 0.05, 0.02]))
    # rank 0 left; the slow process (h1:101) is rank 0 now, the other rank 1
    renumbered = [RankTiming(0, "h1", 101, 20, 0.05, 0.0), RankTiming(1, "h2", 102, 20, 0.02, 0.0)]
    (t,) = det.judge(renumbered).reported
    assert (t.rank, t.key) == (0, "h1:101")
    assert "h0:100" not in det.streaks


def test_record_starts_the_window_afresh_after_a_restore_or_resize() -> None:
    det = StragglerDetector(RULE)
    for step in range(1, 11):
        det.record(step, 2, 0.01, 0.0)
    det.record(8, 2, 0.02, 0.0)  # a restore went back to step 7
    assert det.summary(0, "h", 1).steps == 1
    for step in range(9, 13):
        det.record(step, 2, 0.01, 0.0)
    det.record(13, 3, 0.01, 0.0)  # a reset to 3 ranks
    assert det.summary(0, "h", 1).steps == 1
    assert [det.due(s, 2) for s in (19, 20, 40)] == [False, True, True]
    assert not det.due(20, 1) and not StragglerDetector(StragglerRule(0)).due(20, 2)


class FakeBackend:
    """Hands every rank's window to `allgather_object`, as a real exchange would."""

    name = "fake"

    def __init__(self, rank: int, others: list[float]) -> None:
        self._rank = rank
        self.others = others
        self.gathers = 0

    def rank(self) -> int:
        return self._rank

    def allgather_object(self, mine: RankTiming) -> list[RankTiming]:
        self.gathers += 1
        out = [RankTiming(r, f"peer{r}", 1000 + r, mine.steps, c, 0.01)
               for r, c in enumerate(self.others)]
        out[mine.rank] = mine
        return out


def _observer(rank: int, others: list[float], evict: bool, sleep_s: float
              ) -> tuple[Observer, FakeBackend, list[tuple[str, dict]], list[bool]]:
    import time

    options = ObservabilityOptions(straggler_window_steps=4, straggler_windows=2,
                                   straggler_evict=evict)
    backend = FakeBackend(rank, others)
    emitted: list[tuple[str, dict]] = []
    evicted: list[bool] = []
    obs = Observer(options, backend=backend, emit=lambda ev, **f: emitted.append((ev, f)),
                   events_path=None, on_evict=lambda: evicted.append(True))
    for step in range(1, 9):
        t0 = time.perf_counter()
        time.sleep(sleep_s)  # this rank's compute
        obs.step_end(step, t0, step * 8, len(others))
    return obs, backend, emitted, evicted


def test_the_straggler_reports_itself_and_is_evicted_only_when_asked(
        caplog: pytest.LogCaptureFixture) -> None:
    obs, backend, emitted, evicted = _observer(1, [0.0001, 0.0, 0.0001], True, 0.03)
    assert backend.gathers == 2  # one exchange per window of 4 steps, never per step
    assert [e for e, _ in emitted] == ["straggler", "straggler_evicted"] and evicted == [True]
    fields = emitted[0][1]
    assert fields["ratio"] > 100 and fields["windows"] == 2 and fields["pid"] == obs.pid
    _, _, emitted, evicted = _observer(1, [0.0001, 0.0, 0.0001], False, 0.03)
    assert [e for e, _ in emitted] == ["straggler"] and evicted == []
    with caplog.at_level(logging.WARNING, logger="hvd_resilient.observability"):
        _, _, emitted, evicted = _observer(0, [0.0, 0.05, 0.0001], True, 0.0)
    # rank 1 is the straggler: it reports itself; rank 0 records what each window showed
    assert [e for e, _ in emitted] == ["step_times", "step_times"] and evicted == []
    window2 = emitted[1][1]
    assert window2["judged"] and window2["stragglers"] == [1] and window2["ratios"][1] > 100
    assert "straggler: rank 1 on peer1" in caplog.text


def test_slow_fault_sticks_to_the_process_that_claimed_it(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("hvd_resilient.training.faults.time.sleep", slept.append)
    spec = "slow:rank=1:step=5:seconds=0.25"
    first, second = FaultPlan.parse(spec, str(tmp_path)), FaultPlan.parse(spec, str(tmp_path))
    for step in range(8):
        first.maybe_fire(1 if step < 6 else 0, step)  # renumbered to rank 0 at step 6
        second.maybe_fire(1, step)
    assert slept == [0.25, 0.25, 0.25]  # the first process, steps 5, 6 and 7, whatever its rank
    assert len(list(tmp_path.glob(".fault-0-slow-r1-s5"))) == 1
    with pytest.raises(ConfigError):
        FaultPlan.parse("slow:rank=1", str(tmp_path))


def test_settings_validate_and_name_their_flag() -> None:
    o = ObservabilityOptions()
    assert (o.metrics_port, o.straggler_window_steps, o.straggler_ratio, o.straggler_windows,
            o.straggler_evict) == (0, 50, 1.3, 3, False)
    for bad, flag in [({"straggler_ratio": 1.0}, "--observability-straggler-ratio"),
                      ({"straggler_window_steps": 2}, "--observability-straggler-window-steps"),
                      ({"metrics_port": 70000}, "--observability-metrics-port")]:
        with pytest.raises(ConfigError, match=flag):
            ObservabilityOptions(**bad)
    cfg = TrainConfig.from_sources(env={"HVD_RESILIENT_OBSERVABILITY_STRAGGLER_EVICT": "1"},
                                   observability={"metrics_port": 9400})
    assert cfg.observability.straggler_evict and cfg.observability.metrics_port == 9400


def _ev(ts: float, event: str, rank: int = 0, size: int = 3, step: int = 0, **f: Any) -> dict:
    return {"ts": ts, "event": event, "rank": rank, "size": size, "step": step, **f}


def _straggler_log() -> list[dict]:
    config = {"observability": {"straggler_window_steps": 20, "straggler_ratio": 1.3,
                                "straggler_windows": 3, "straggler_min_seconds": 0.005,
                                "straggler_evict": True}, "batch_size": 16}
    evs = [_ev(100.0 + r * 0.01, "start", rank=r, config=config if r == 0 else None)
           for r in range(3)]
    evs += [_ev(101.0, "sync"), _ev(102.0, "commit", step=10, seconds=0.001),
            _ev(103.0, "step_times", step=60, judged=True, ratios=[0.9, 3.3, 1.0],
                compute_seconds=[0.015, 0.05, 0.016], wait_seconds=[0.04, 0.001, 0.039]),
            _ev(104.0, "straggler", rank=1, step=80, host="n1", pid=41, ratio=3.4,
                compute_seconds=0.052, others_seconds=0.0153),
            _ev(104.01, "straggler_evicted", rank=1, step=80, host="n1", pid=41, ratio=3.4),
            _ev(104.2, "failure_detected", rank=0, step=80, peer_hangup="rank 1"),
            _ev(104.6, "reset", rank=0, size=2, step=80, old_size=3, new_size=2, seconds=0.4),
            _ev(104.8, "sync", rank=0, size=2, step=80),
            _ev(106.0, "commit", size=2, step=90, seconds=0.001),
            _ev(107.0, "done", size=2, step=100)]
    return evs


def test_report_has_a_straggler_section_and_series(tmp_path: Path) -> None:
    r = analyze(_straggler_log())
    (s,) = r.stragglers
    assert (s["rank"], s["host"], s["ratio"], s["evicted"], s["at"]) == (1, "n1", 3.4, True, 4.0)
    assert r.series["stragglers"] == [[4.0, 1, 3.4, True]]
    assert r.straggler_rule and r.straggler_rule["evict"] is True
    text = render(r)
    assert ("stragglers    1 report (rank 1), 1 evicted; rule 1.3x for 3 windows of 20 steps, "
            "eviction on") in text
    assert "rank 1 on n1 (pid 41): 3.40x the others' compute (0.0520 s vs 0.0153 s)" in text
    assert "windows: 1 of 1 judged, highest ratio 3.30x (rank 1 at 3.00 s)" in text
    quiet = analyze([e for e in _straggler_log() if not e["event"].startswith("straggler")])
    assert "stragglers    none reported; rule 1.3x" in render(quiet)
    old = analyze([dict(e, config=None) for e in _straggler_log()
                   if not e["event"].startswith(("straggler", "step_times"))])
    assert "stragglers" not in render(old)  # a log from before detection existed


def test_plot_marks_stragglers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from hvd_resilient.report import plot

    out = plot.write_png(analyze(_straggler_log()), tmp_path / "r.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
