"""The Prometheus endpoint: scraped over HTTP and parsed with prometheus_client's own parser,
from an endpoint over a hand-written log (exact numbers) and from a real three-worker job that
loses a worker; the Grafana dashboard in docs/ queries only metrics the endpoint serves."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hvd_resilient.observability.metrics import EventTally, MetricsEndpoint, RunCollector
from hvd_resilient.observability.observer import LiveStats
from hvd_resilient.observability.stragglers import RankTiming, Verdict
from tests.support.jobs import PYTHON, free_port, horovodrun_elastic, wait_for, write_discovery
from tests.support.paths import ROOT
from tests.support.runs import assert_faults_fired

DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
DIGITS = str(ROOT / "examples" / "digits.py")


def scrape(url: str) -> tuple[dict[str, dict[tuple, float]], set[str]]:
    """{sample name: {sorted label items: value}} and every family and sample name served."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        for s in family.samples:
            names.add(s.name)
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples, names


def value(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float | None:
    return samples.get(name, {}).get(tuple(sorted(labels.items())))


def _ev(ts: float, event: str, rank: int = 0, size: int = 3, step: int = 0, **f: Any) -> dict:
    return {"ts": ts, "event": event, "rank": rank, "size": size, "step": step, **f}


def hand_written_log() -> list[dict]:
    """A hang-up failure (3 -> 2), a host added back (2 -> 3), a hung rank, a straggler evicted,
    then a full restart by the supervisor."""
    evs = [_ev(100.0 + r / 100, "start", rank=r, config={"batch_size": 8} if r == 0 else None)
           for r in range(3)]
    evs += [
        _ev(100.5, "sync"), _ev(101.0, "commit", step=10, seconds=0.001),
        # `step`: the training step when the upload of the checkpoint of step 10 ended
        _ev(101.5, "checkpoint_saved", step=11, ckpt_step=10, seconds=0.2, stall_seconds=0.01,
            bytes=100),
        _ev(102.0, "failure_detected", rank=1, step=12, peer_hangup="rank 2 hung up"),
        _ev(102.01, "failure_detected", rank=0, step=12, peer_hangup="rank 2 hung up"),
        _ev(102.02, "restore", rank=0, step=10, from_step=12, to_step=10, lost_steps=2),
        _ev(102.4, "reset", rank=1, size=2, step=10, old_size=3, new_size=2, seconds=0.4),
        _ev(102.4, "reset", rank=0, size=2, step=10, old_size=3, new_size=2, seconds=0.39),
        _ev(102.7, "sync", rank=0, size=2, step=10),  # recovery 0.7 s
        _ev(103.0, "commit", size=2, step=20, seconds=0.001),
        _ev(104.0, "hosts_changed", rank=0, size=2, step=20, removed_only=False),
        _ev(105.0, "reset", rank=0, size=3, step=20, old_size=2, new_size=3, seconds=1.0),
        _ev(105.5, "sync", rank=0, size=3, step=20),  # 1.5 s
        _ev(106.0, "commit", step=30, seconds=0.001),
        _ev(107.0, "hang_detected", rank=2, step=33, section="step", exit_code=77),
        _ev(107.2, "failure_detected", rank=0, step=33, peer_hangup="rank 2 hung up"),
        _ev(107.5, "reset", rank=0, size=2, step=30, old_size=3, new_size=2, seconds=0.3),
        _ev(110.0, "sync", rank=0, size=2, step=30),  # 3.0 s from the hang report
        _ev(111.0, "commit", size=2, step=40, seconds=0.001),
        _ev(112.0, "straggler", rank=1, size=2, step=45, host="n1", pid=7, ratio=2.0),
        _ev(112.0, "straggler_evicted", rank=1, size=2, step=45, host="n1", pid=7, ratio=2.0),
        _ev(112.1, "failure_detected", rank=0, size=2, step=45, peer_hangup=None),
        _ev(113.0, "restart", rank=-1, size=0, step=-1, attempt=2, delay=1.0, exit_code=1),
    ]
    return evs


def _write(path: Path, evs: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in evs) + tail)
    return path


def test_run_totals_are_read_incrementally_and_classified(tmp_path: Path) -> None:
    evs = hand_written_log()
    log = tmp_path / "events.jsonl"
    _write(log, evs[:8], tail='{"ts": 102.4, "event": "re')  # a torn line: left for later
    tally = EventTally(log)
    tally.refresh()
    assert tally.events["failure_detected"] == 2 and tally.resets["failure"] == 0
    _write(log, evs)
    tally.refresh()
    assert tally.events["failure_detected"] == 4 and tally.events["start"] == 3
    assert dict(tally.resets) == {"failure": 2, "hosts_changed": 1}
    assert dict(tally.failures) == {"hang": 1, "straggler": 1, "silent": 0, "hangup": 1,
                                    "collective": 0}
    assert tally.restarts == 1
    assert tally.recovery_s == pytest.approx([0.7, 1.5, 3.0])
    assert tally.last == {"memory": (111.0, 40), "durable": (101.5, 10)}


def test_endpoint_serves_parseable_metrics_and_the_dashboard_fits(tmp_path: Path) -> None:
    log = _write(tmp_path / "events.jsonl", hand_written_log())
    live = LiveStats()
    for i in range(5):
        live.add(step=40 + i, samples=320 + 16 * i, size=2, rank=0, compute_s=0.01, wait_s=0.002)
    live.samples = type(live.samples)([(0.0, 320), (2.0, 384)], maxlen=200)  # 32 samples/s
    live.timings = [RankTiming(0, "n0", 5, 20, 0.01, 0.02), RankTiming(1, "n1", 7, 20, 0.03, 0.0)]
    live.verdict = Verdict(evaluated=True, ratios={0: 1 / 3, 1: 3.0}, flagged=[1])
    endpoint = MetricsEndpoint(0, "127.0.0.1", RunCollector(log, live, run_id="r1",
                                                            backend="horovod", host="n0"))
    endpoint.start()
    try:
        host, port = endpoint.address  # type: ignore[misc]
        url = f"http://{host}:{port}/metrics"
        samples, names = scrape(url)
        assert value(samples, "hvd_resilient_goodput_ratio") is None  # its report is running
        again = wait_for(lambda: _with_goodput(url), 60, "goodput from the report's child")
    finally:
        endpoint.stop()
    assert value(samples, "hvd_resilient_step") == 44
    assert value(samples, "hvd_resilient_world_size") == 2
    assert value(samples, "hvd_resilient_samples_per_second") == pytest.approx(32.0)
    assert value(samples, "hvd_resilient_failures_total", **{"class": "hang"}) == 1
    assert value(again, "hvd_resilient_failures_total", **{"class": "hangup"}) == 1
    assert value(again, "hvd_resilient_resets_total", cause="hosts_changed") == 1
    assert value(samples, "hvd_resilient_restarts_total") == 1
    assert value(samples, "hvd_resilient_events_total", event="failure_detected") == 4
    assert value(again, "hvd_resilient_recovery_seconds_count") == 3
    assert value(samples, "hvd_resilient_recovery_seconds_bucket", le="1.0") == 1
    assert value(samples, "hvd_resilient_recovery_seconds_bucket", le="2.0") == 2
    assert value(samples, "hvd_resilient_recovery_seconds_sum") == pytest.approx(5.2)
    assert value(samples, "hvd_resilient_checkpoint_step", tier="durable") == 10
    assert value(samples, "hvd_resilient_checkpoint_age_seconds", tier="memory") > 1e6
    assert value(samples, "hvd_resilient_straggler_ratio", rank="1", host="n1") == 3.0
    assert value(samples, "hvd_resilient_rank_wait_seconds", rank="0", host="n0") == 0.02
    assert value(samples, "hvd_resilient_stragglers") == 1
    assert value(samples, "hvd_resilient_straggler_reports_total") == 1
    assert value(samples, "hvd_resilient_straggler_evictions_total") == 1
    from hvd_resilient.report import analyze

    expected = analyze(hand_written_log())  # the same arithmetic as `hvd-resilient report`
    assert value(again, "hvd_resilient_goodput_ratio") == pytest.approx(expected.goodput)
    assert 0 < expected.goodput < 1
    assert value(again, "hvd_resilient_lost_seconds", category="recovery") == pytest.approx(
        expected.lost_s["recovery"])
    assert value(samples, "hvd_resilient_run_info", run_id="r1", backend="horovod", host="n0",
                 pid=str(__import__("os").getpid())) == 1
    missing = sorted(dashboard_metrics() - names)
    assert not missing, f"the dashboard queries metrics the endpoint does not serve: {missing}"


def _with_goodput(url: str) -> dict[str, dict[tuple, float]] | None:
    """A scrape that has goodput: each scrape only polls the report's child process."""
    samples, _ = scrape(url)
    return samples if value(samples, "hvd_resilient_goodput_ratio") is not None else None


def dashboard_metrics() -> set[str]:
    """Every hvd_resilient_* name in the dashboard's queries (the file must be valid JSON)."""
    doc = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query", "definition") and isinstance(v, str):
                    exprs.append(v)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert len(exprs) >= 10, "the dashboard has hardly any queries"
    return {m for e in exprs for m in re.findall(r"\bhvd_resilient_[a-z_]+", e)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_job_is_scraped_through_a_failure(tmp_path: Path, jobs) -> None:
    """Three digits workers under the project's driver; rank 2 is killed at step 40. rank 0
    serves the endpoint throughout; the scrape after the recovery shows it."""
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:3")
    port = free_port()
    cmd = horovodrun_elastic(discover, 3, 2, 3, "--gloo-timeout-seconds", "120",
                             "--blacklist-cooldown-range", "600", "600")
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    # Long enough that a fast (idle) machine is still training when the endpoint has seen the
    # recovery, a goodput analysis and a straggler window at the new size.
    cmd += [PYTHON, DIGITS, "--run-dir", str(run), "--epochs", "45", "--batch-size", "16",
            "--commit-every", "5", "--observability-metrics-port", str(port),
            "--observability-metrics-addr", "127.0.0.1",
            "--observability-straggler-window-steps", "20"]
    job = jobs.start(cmd, env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=2:step=40"), name="metrics")
    url = f"http://127.0.0.1:{port}/metrics"

    def recovered() -> tuple[dict, set[str]] | None:
        try:
            samples, names = scrape(url)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None  # not listening yet (rank 0 starts it after Horovod's init)
        done = (value(samples, "hvd_resilient_recovery_seconds_count") or 0) >= 1
        step = value(samples, "hvd_resilient_step") or 0
        ratios = samples.get("hvd_resilient_straggler_ratio", {})
        sized = value(samples, "hvd_resilient_world_size") == 2 and len(ratios) == 2
        # goodput is recomputed every few seconds: 0 while the last analysis saw start-up only
        productive = (value(samples, "hvd_resilient_goodput_ratio") or 0) > 0
        return (samples, names) if done and sized and step >= 60 and productive else None

    samples, names = wait_for(recovered, 240, "a scrape after the recovery", job=job, poll=0.5)
    assert job.wait(420) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    failures = {dict(k)["class"]: v for k, v in samples["hvd_resilient_failures_total"].items()}
    assert sum(failures.values()) == 1 and failures["hangup"] + failures["collective"] == 1, \
        failures
    assert value(samples, "hvd_resilient_resets_total", cause="failure") == 1
    assert 0 < value(samples, "hvd_resilient_recovery_seconds_sum") < 60
    assert value(samples, "hvd_resilient_samples_per_second") > 0
    assert value(samples, "hvd_resilient_events_total", event="start") >= 3
    assert value(samples, "hvd_resilient_checkpoint_age_seconds", tier="memory") is not None
    assert value(samples, "hvd_resilient_checkpoint_age_seconds", tier="durable") is not None
    assert 0 < value(samples, "hvd_resilient_goodput_ratio") <= 1
    assert value(samples, "hvd_resilient_straggler_reports_total") == 0
    missing = sorted(dashboard_metrics() - names)
    assert not missing, missing
