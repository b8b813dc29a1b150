"""`hvd-resilient report`: the arithmetic on hand-written logs (expected numbers worked out here
from the logs' timestamps), the structure of two real logs in tests/data, and the command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hvd_resilient.report import cli
from hvd_resilient.report.analysis import analyze
from hvd_resilient.report.checkpoints import daly_interval, young_interval
from hvd_resilient.report.timeline import normalize, split_launches
from tests.support.paths import DATA

CONFIG = {"run_id": "t", "commit_every": 10, "checkpoint": {"every": 50}, "batch_size": 8}


def ev(ts: float, event: str, rank: int = 0, size: int = 2, step: int = 0,
       **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "event": event, "rank": rank, "size": size, "step": step, **fields}


def starts(ts: float, size: int, run_id: str = "t") -> list[dict[str, Any]]:
    return [ev(ts, "start", r, size, 0, pid=100 + r, host="h", run_id=run_id,
               config=CONFIG if r == 0 else None) for r in range(size)]


def write(path: Path, events: list[dict[str, Any]], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)
    return path


def clean_run() -> list[dict[str, Any]]:
    """2 workers; training from t=1; a commit each second, 10 steps each; one checkpoint."""
    evs = starts(0.0, 2) + [ev(1.0, "sync", r) for r in (0, 1)]
    evs += [ev(1.0 + i, "commit", step=10 * i, seconds=0.01) for i in range(1, 10)]
    evs.append(ev(6.0, "checkpoint_saved", step=50, ckpt_step=50, seconds=0.5, stall_seconds=0.2,
                  upload_seconds=0.4, bytes=1000, url="file:///c/step-50"))
    evs += [ev(10.5, "done", r, step=90, params_sha256="x", loss=0.1) for r in (0, 1)]
    return evs


def one_failure_run() -> list[dict[str, Any]]:
    """3 workers; rank 2 dies after the commit of step 40; 2 survivors restore and go on."""
    evs = starts(0.0, 3) + [ev(1.0, "sync", r, 3) for r in (0, 1, 2)]
    evs += [ev(1.0 + i, "commit", size=3, step=10 * i, seconds=0.0) for i in range(1, 5)]
    evs.append(ev(3.5, "checkpoint_saved", size=3, step=20, ckpt_step=20, seconds=0.4,
                  stall_seconds=0.1, bytes=900, url="u"))
    evs += [
        ev(6.5, "failure_detected", 0, 3, 47, error="HorovodInternalError: x"),
        ev(6.55, "restore", 0, 3, 40, from_step=47, to_step=40, lost_steps=7),
        ev(6.6, "failure_detected", 1, 3, 47, error="HorovodInternalError: x"),
        ev(6.65, "restore", 1, 3, 40, from_step=47, to_step=40, lost_steps=7),
        ev(8.0, "reset", 0, 2, 40, old_size=3, new_size=2, seconds=1.5),
        ev(8.1, "reset", 1, 2, 40, old_size=3, new_size=2, seconds=1.5),
        ev(8.3, "sync", 0, 2, 40, seconds=0.2),
        ev(8.4, "sync", 1, 2, 40, seconds=0.3),
        ev(9.4, "commit", 0, 2, 50, seconds=0.0),
        ev(9.8, "checkpoint_saved", 0, 2, 50, ckpt_step=50, seconds=0.2, stall_seconds=0.05,
           bytes=900, url="u"),
        ev(10.4, "commit", 0, 2, 60, seconds=0.0),
        ev(11.0, "done", 0, 2, 60),
        ev(11.0, "done", 1, 2, 60),
    ]
    return evs


def restart_run() -> list[dict[str, Any]]:
    """Launch 1 dies silently after step 30; launch 2 resumes from the checkpoint of step 20."""
    evs = starts(0.0, 2) + [ev(0.5, "sync", r) for r in (0, 1)]
    evs += [ev(0.5 + i, "commit", step=10 * i, seconds=0.0) for i in range(1, 4)]
    evs.append(ev(2.8, "checkpoint_saved", step=20, ckpt_step=20, seconds=0.2, stall_seconds=0.0,
                  bytes=5, url="u"))
    later = starts(10.0, 2)
    later[0]["ts"] = 10.1  # rank 1 writes its start first: the launch still begins at 10.0
    evs += later + [
        ev(10.6, "resume", step=20, from_step=20, epoch=0, saved_world_size=2),
        ev(11.0, "sync", 0, step=20), ev(11.0, "sync", 1, step=20),
        ev(12.0, "commit", step=30, seconds=0.0), ev(13.0, "commit", step=40, seconds=0.0),
        ev(13.3, "checkpoint_saved", step=40, ckpt_step=40, seconds=0.2, stall_seconds=0.0,
           bytes=5, url="u"),
        ev(13.5, "done", 0, step=40), ev(13.5, "done", 1, step=40),
    ]
    return evs


# -- analysis ---------------------------------------------------------------------------------


def test_clean_run() -> None:
    r = analyze(clean_run())
    assert (r.status, r.launches, r.failures, r.resets, r.restarts) == ("finished", 1, [], 0, [])
    wall = 10.5
    startup = 1.0  # first event -> last sync
    stall = 0.2  # async: [6.0 - 0.5 - 0.2, 6.0 - 0.5], inside no other window
    commits = 9 * 0.01
    assert r.wall_s == pytest.approx(wall)
    assert r.lost_s["startup"] == pytest.approx(startup)
    assert r.lost_s["checkpoint_stall"] == pytest.approx(stall)
    assert r.lost_s["commit"] == pytest.approx(commits)
    assert r.goodput == pytest.approx((wall - startup - stall - commits) / wall)
    assert r.step_rate == pytest.approx(10.0)
    assert r.samples_per_s == pytest.approx(10.0 * 2 * 8)
    assert r.checkpoints["newest_step"] == 50 and r.checkpoints["bytes_last"] == 1000
    assert r.checkpoints["upload_s"]["max"] == pytest.approx(0.4)
    # Dying at the last event (step 90) loses the steps since the checkpoint of step 50, whose
    # commit was at t=6.0.
    assert r.at_risk["steps"] == 40 and r.at_risk["seconds"] == pytest.approx(10.5 - 6.0)
    assert r.young_daly.mtbf_source == "none" and r.young_daly.young_s is None
    assert r.young_daly.configured_every_steps == 50
    assert r.young_daly.configured_every_s == pytest.approx(5.0)


def checkpoint_run(old: bool) -> list[dict[str, Any]]:
    """`clean_run` with a checkpoint of each kind, as this version writes them or (`old`) as
    versions before `ckpt_step` did: then `step` was the checkpoint's own."""
    def ckpt(ts: float, event: str, step: int, ckpt_step: int, **fields: Any) -> dict[str, Any]:
        if old:
            return ev(ts, event, step=ckpt_step, **fields)
        return ev(ts, event, step=step, ckpt_step=ckpt_step, **fields)

    superseded = ckpt(7.0, "checkpoint_superseded", 62, 60, by_step=70)
    published = ckpt(8.0, "checkpoint_already_published", 71, 70, url="u")
    evs = [e for e in clean_run() if e["event"] != "checkpoint_saved"] + [
        # the upload of step 50 ended 3 steps later: training went on meanwhile
        ckpt(6.0, "checkpoint_saved", 53, 50, seconds=0.5, stall_seconds=0.2,
             upload_seconds=0.4, bytes=1000, url="file:///c/step-50"),
        superseded, published,
        ckpt(9.0, "checkpoint_failed", 84, 80, error="store down"),
        ckpt(9.5, "checkpoint_skipped", 85, 30, reason="state.pt xxh3_128 mismatch", url="u"),
    ]
    return sorted(evs, key=lambda e: e["ts"])


def test_checkpoint_events_of_this_and_older_versions_read_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new, old = analyze(checkpoint_run(old=False)), analyze(checkpoint_run(old=True))
    # step 70 was published already (by an earlier rank 0): the newest checkpoint there is
    want = {"saved": 1, "failed": 1, "failed_steps": [80], "newest_step": 70, "superseded": 1,
            "already_published": 1, "skipped": {"state.pt xxh3_128 mismatch": 1}}
    assert {k: new.checkpoints[k] for k in want} == want
    assert new.checkpoints == old.checkpoints
    assert new.at_risk == old.at_risk and new.at_risk["steps"] == 90 - 70
    assert new.series["checkpoints"] == old.series["checkpoints"] == [
        [6.0, 50, "saved"], [9.0, 80, "failed"]]
    lines = []
    for which in (False, True):
        path = write(tmp_path / f"{which}.jsonl", checkpoint_run(old=which))
        assert cli.main([str(path), "--no-plot"]) == 0
        lines.append([ln for ln in capsys.readouterr().out.splitlines() if "checkpoints" in ln])
    assert lines[0] == lines[1] and len(lines[0]) == 1
    assert ("1 failed; 1 superseded; 1 published already; skipped 1 state.pt xxh3_128 mismatch"
            in lines[0][0]), lines


def test_one_failure_restored_on_two_ranks() -> None:
    r = analyze(one_failure_run())
    assert len(r.failures) == 1 and r.resets == 1 and r.launches == 1
    f = r.failures[0]
    commit_40, detected, reset_done, synced = 5.0, 6.5, 8.1, 8.4
    assert f.kind == "elastic" and f.steps_lost == 47 - 40
    assert f.detect_s == pytest.approx(detected - commit_40) and f.detect_is_upper_bound
    assert f.reset_s == pytest.approx(1.5)
    assert f.restore_s == pytest.approx(synced - reset_done)
    assert f.total_s == pytest.approx(synced - commit_40)
    assert (f.old_size, f.new_size) == (3, 2)
    assert f.at == pytest.approx(detected)
    wall = 11.0
    startup = 1.0
    rollback = detected - commit_40
    recovery = synced - detected
    stall = 0.1 + 0.05  # [3.0, 3.1] and [9.55, 9.6]: outside the failure windows
    assert r.lost_s["rollback"] == pytest.approx(rollback)
    assert r.lost_s["recovery"] == pytest.approx(recovery)
    assert r.lost_s["checkpoint_stall"] == pytest.approx(stall)
    assert r.productive_s == pytest.approx(wall - startup - rollback - recovery - stall)
    assert r.goodput == pytest.approx(r.productive_s / wall)
    assert r.mttr["total"].median == pytest.approx(3.4) == r.mttr["total"].max
    assert r.steps_lost == 7 and r.world_sizes == [2, 3]
    # 10 steps/s throughout; 3 x 8 samples per step for 4 s, then 2 x 8 for 2 s
    assert r.step_rate == pytest.approx(10.0)
    assert r.samples_per_s == pytest.approx((4 * 240 + 2 * 160) / 6)
    assert r.series["world_size"][:2] == [[0.0, 3], [8.1, 2]]
    # Young: C = median(0.1, 0.05), MTBF = 11 s / 1 failure
    c, mtbf = 0.075, 11.0
    assert r.young_daly.checkpoint_cost_s == pytest.approx(c)
    assert r.young_daly.mtbf_s == pytest.approx(mtbf)
    assert r.young_daly.young_s == pytest.approx(math.sqrt(2 * c * mtbf))
    assert r.young_daly.young_steps == pytest.approx(10.0 * math.sqrt(2 * c * mtbf))
    assert r.young_daly.restart_failures == 0


def test_full_restart_with_a_gap() -> None:
    r = analyze(restart_run())
    assert r.launches == 2 and r.resumes == 1 and r.status == "finished"
    last_commit, old_end, new_start, new_train = 3.5, 3.5, 10.0, 11.0
    (rs,) = r.restarts
    assert rs["reason"] == "crash" and rs["from_step"] == 20 and rs["steps_lost"] == 10
    assert rs["down_s"] == pytest.approx(new_start - old_end)
    assert rs["startup_s"] == pytest.approx(new_train - new_start)
    (f,) = r.failures
    assert f.kind == "restart" and f.steps_lost == 30 - 20
    assert f.total_s == pytest.approx(new_train - last_commit)
    commit_20 = 2.5
    assert r.lost_s["rollback"] == pytest.approx(old_end - commit_20)
    assert r.lost_s["restart"] == pytest.approx(new_train - old_end)
    assert r.lost_s["startup"] == pytest.approx(0.5)
    assert r.goodput == pytest.approx((13.5 - 1.0 - 7.5 - 0.5) / 13.5)
    assert [p[1] for p in r.series["world_size"]] == [2, 0, 2, 2]


def test_worker_joining_during_recovery_is_not_a_new_launch() -> None:
    evs = starts(0.0, 2) + [ev(0.5, "sync", r) for r in (0, 1)] + [
        ev(1.5, "commit", step=10),
        ev(2.0, "hosts_changed", 0, 2, 10, removed_only=False),
        ev(2.0, "hosts_changed", 1, 2, 10, removed_only=False),
        # the newcomer happens to get rank 0 of the new world of 3; only it starts
        ev(2.5, "start", 0, 3, 0, pid=9, host="h2", run_id="t", config=CONFIG),
        ev(2.6, "reset", 1, 3, 10, old_size=2, new_size=3, seconds=0.6),
        ev(2.6, "reset", 2, 3, 10, old_size=2, new_size=3, seconds=0.6),
        ev(2.7, "sync", 0, 3, 10), ev(3.5, "commit", 0, 3, 20),
    ]
    assert len(split_launches(normalize(evs))) == 1
    r = analyze(evs)
    assert r.failures == [] and r.resets == 1 and r.lost_s["rollback"] == 0
    assert r.lost_s["recovery"] == pytest.approx(2.7 - 2.0)
    assert r.world_sizes == [2, 3]


def test_launcher_lines_before_the_first_start_are_that_launch_s() -> None:
    """The driver writes as rank -1 (its warm pool ready, 4 s of imports before any worker
    starts): that is the launch's start-up, not a launch that died and restarted."""
    evs = [ev(-4.0, "warm_pool_ready", -1, -1, seconds=4.0)] + clean_run()
    assert len(split_launches(normalize(evs))) == 1
    r = analyze(evs)
    assert (r.launches, r.failures, r.restarts) == (1, [], [])
    assert r.lost_s["startup"] == pytest.approx(5.0)


def test_still_running_run() -> None:
    evs = [e for e in clean_run() if e["event"] != "done"]
    r = analyze(evs, now=20.0)
    assert r.status == "unfinished" and r.since_last_event_s == pytest.approx(20.0 - 10.0)
    assert r.at_risk["seconds_now"] == pytest.approx(20.0 - 6.0)
    assert r.failures == []  # a run that may still be going is not a failure
    assert r.silent_s is None and r.goodput_to_now is None  # 10 s quiet: not yet suspicious


def test_silent_run_counts_the_silence_as_lost(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose launcher was killed writes nothing more: the report must not keep quoting
    the goodput up to its last event as if nothing happened."""
    evs = [e for e in clean_run() if e["event"] != "done"]
    r = analyze(evs, now=10.0 + 120.0)
    assert r.usual_gap_s == pytest.approx(1.0)
    assert r.silent_s == pytest.approx(120.0)
    assert r.goodput_to_now == pytest.approx(r.productive_s / 130.0)
    assert r.goodput_to_now < r.goodput / 10
    assert cli.main([str(write(tmp_path / "events.jsonl", evs)), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "SILENT for" in out and "to now, the silence counted as lost" in out


def test_crash_while_recovering_then_restart_is_one_failure() -> None:
    r = analyze(json.loads(line) for line in (DATA / "events_crash_restart.jsonl").open())
    assert r.launches == 2 and r.resumes == 1 and len(r.failures) == 1
    assert r.failures[0].kind == "restart" and r.restarts[0]["from_step"] == 40
    assert r.steps_lost == 10 and r.status == "finished"
    assert r.productive_s + sum(r.lost_s.values()) == pytest.approx(r.wall_s)


def test_real_elastic_kill_log() -> None:
    r = analyze(json.loads(line) for line in (DATA / "events_elastic_kill.jsonl").open())
    assert r.launches == 1 and r.resets == 1 and len(r.failures) == 1
    f = r.failures[0]
    assert f.kind == "elastic" and f.steps_lost == 5 and (f.old_size, f.new_size) == (2, 1)
    assert 0 < f.total_s == pytest.approx(f.detect_s + f.reset_s + f.restore_s, abs=0.02)
    assert r.world_sizes == [1, 2] and 0 < r.goodput < 1


def test_young_daly_known_values() -> None:
    assert young_interval(50.0, 10_000.0) == pytest.approx(1000.0)
    # Daly: sqrt(2CM) * (1 + sqrt(x)/3 + x/9) - C with x = C / 2M = 0.0025
    assert daly_interval(50.0, 10_000.0) == pytest.approx(1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50)
    assert daly_interval(30.0, 10.0) == 10.0  # C >= 2M: checkpoint once per MTBF
    r = analyze(one_failure_run(), mtbf_s=600.0)
    assert r.young_daly.mtbf_source == "given"
    assert r.young_daly.young_s == pytest.approx(math.sqrt(2 * 0.075 * 600.0))
    assert r.young_daly.young_steps == pytest.approx(10 * math.sqrt(90.0))


def test_cost_falls_back_to_seconds_without_stalls() -> None:
    evs = [dict(e, stall_seconds=0.0) if e["event"] == "checkpoint_saved" else e
           for e in one_failure_run()]
    yd = analyze(evs).young_daly
    assert yd.cost_source == "seconds" and yd.checkpoint_cost_s == pytest.approx(0.3)


# -- the command ------------------------------------------------------------------------------


def test_torn_last_line_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "run" / "events.jsonl", one_failure_run(), tail='{"ts": 12.0, "event": "co')
    assert cli.main([str(tmp_path / "run"), "--json", "--no-plot"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["last_event_at"] == 11.0 and len(doc["failures"]) == 1


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "events.jsonl", restart_run())
    assert cli.main([str(path), "--json", "--no-plot"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("run_id", "status", "wall_s", "productive_s", "goodput", "lost_s", "failures",
                "resets", "mttr", "steps_lost", "checkpoints", "at_risk", "restarts",
                "young_daly", "series", "world_sizes", "step_rate", "config", "plot"):
        assert key in doc, key
    assert doc["launches"] == 2 and doc["plot"] is None
    assert doc["mttr"]["total"]["max"] == pytest.approx(7.5)
    assert doc["young_daly"]["configured_every_steps"] == 50


def test_text_report_and_default_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    write(run / "events.jsonl", one_failure_run())
    assert cli.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "goodput 58.6 %" in out  # (11 - 1 - 1.5 - 1.9 - 0.15) / 11
    assert "elastic" in out and "Young/Daly" in out and str(run / "report.png") in out
    data = (run / "report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_unfinished_run_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shift = time.time() - 11.0  # the last event a second ago: a run that may be going
    evs = [dict(e, ts=e["ts"] + shift) for e in clean_run() if e["event"] != "done"]
    assert cli.main([str(write(tmp_path / "events.jsonl", evs)), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "still running or crashed" in out and "plot" not in out and "SILENT" not in out


@pytest.mark.parametrize(
    "content", [None, "", '{"ts": 1, "event": "sta', '{"ts": "x", "event": "start"}\n'])
def test_missing_or_empty_log_is_one_line_and_exit_2(tmp_path: Path, content: str | None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if content is not None:
        (tmp_path / "events.jsonl").write_text(content)
    assert cli.main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and str(tmp_path) in err


def test_the_module_runs_and_never_shows_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "hvd_resilient.report", str(tmp_path / "no")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"hvd-resilient report: no event log at {tmp_path / 'no'}"


def test_odd_field_values_do_not_break_it(capsys: pytest.CaptureFixture[str]) -> None:
    evs = one_failure_run() + [
        {"ts": "soon", "event": "commit"}, {"ts": 3.0, "event": 7}, {"ts": math.nan, "event": "x"},
        ev(3.2, "commit", step="ten", seconds="fast"),  # type: ignore[arg-type]
        ev(3.3, "checkpoint_saved", step=20, seconds=None, stall_seconds="?", bytes="big"),
        ev(3.4, "progress", samples_per_s=True), ev(3.4, "memory", rss_bytes=5, cuda_bytes=7),
    ]
    r = analyze(evs)
    assert len(r.failures) == 1 and r.memory == {"rss_bytes": 5, "cuda_bytes": 7}
    assert json.dumps(cli._finite(r.to_dict()), allow_nan=False)


def test_long_throughput_series_is_coarsened_for_the_plot() -> None:
    from hvd_resilient.report.plot import coarsen

    segs = [[float(i), i + 1.0, 1.0 if i % 2 else 3.0, None, 2] for i in range(1000)]
    segs.append([2000.0, 2001.0, 5.0, None, 2])  # after a gap: never merged across it
    out = coarsen(segs, 2, most=100)
    assert 50 < len(out) <= 101
    assert sum((s[1] - s[0]) * s[2] for s in out) == pytest.approx(1000 * 2.0 + 5.0)
    assert out[-1] == [2000.0, 2001.0, 5.0, None]


def test_preemption_restart_is_not_a_failure() -> None:
    evs = starts(0.0, 2) + [ev(0.5, "sync", r) for r in (0, 1)] + [
        ev(1.5, "commit", step=10), ev(2.5, "commit", step=20),
        # the final, blocking checkpoint: it stalls training throughout
        ev(2.9, "checkpoint_saved", step=20, ckpt_step=20, seconds=0.3, stall_seconds=0.3,
           bytes=5, url="u"),
        ev(3.0, "preempted", 0, step=20, seconds=0.4, exit_code=143),
        ev(3.0, "preempted", 1, step=20, seconds=0.4, exit_code=143),
        *starts(5.0, 2),
        ev(5.2, "resume", step=20, from_step=20, epoch=0, saved_world_size=2),
        ev(5.5, "sync", 0, step=20), ev(5.5, "sync", 1, step=20),
        ev(6.5, "commit", step=30), ev(7.0, "done", 0, step=30), ev(7.0, "done", 1, step=30),
    ]
    r = analyze(evs)
    assert r.launches == 2 and r.failures == [] and r.resumes == 1
    assert r.restarts[0]["reason"] == "preempted" and r.restarts[0]["steps_lost"] == 0
    assert r.lost_s["rollback"] == 0.0
    assert r.lost_s["checkpoint_stall"] == pytest.approx(0.3)
    assert r.lost_s["restart"] == pytest.approx(5.5 - 3.0)


def test_fatal_error_is_the_status() -> None:
    evs = starts(0.0, 2) + [ev(0.5, "fatal", error="step 20: missing key", restartable=False)]
    r = analyze(evs)
    assert r.status == "failed" and r.fatal_error == "step 20: missing key"


def test_without_matplotlib(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    from hvd_resilient.report import plot

    monkeypatch.setattr(plot, "available", lambda: False)
    path = write(tmp_path / "events.jsonl", clean_run())
    assert cli.main([str(path), "--plot", str(tmp_path / "x.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert cli.main([str(path)]) == 0  # the default plot is skipped, with a word why
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "report.png").exists()
