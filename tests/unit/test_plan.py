"""`hvd-resilient plan`: the simulation's arithmetic, its calibration from an event log, and
the command. Small jobs and short horizons: the whole file runs in seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hvd_resilient.cli import main as cli_main
from hvd_resilient.errors import FATAL_EXIT_CODE, ConfigError
from hvd_resilient.report.checkpoints import young_interval
from hvd_resilient.report.plan import measured
from hvd_resilient.report.plan.calibrate import calibrate
from hvd_resilient.report.plan.cli import parser
from hvd_resilient.report.plan.model import CLASSES, Inputs, Job
from hvd_resilient.report.plan.simulate import (
    build_timeline,
    evaluate,
    plan_strategy,
    simulate,
)
from hvd_resilient.report.plan.strategies import STRATEGIES, Strategy, build

ROOT = Path(__file__).resolve().parents[2]
NO_FAILURES = {f"rate_{c}": 0.0 for c in CLASSES}


def only(cls: str, rate: float, **kw: float) -> Inputs:
    """Inputs with a single failure class at `rate` per 1000 GPU-days."""
    return Inputs.defaults({**NO_FAILURES, f"rate_{cls}": rate, **kw})


# -- the simulation ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
def test_ettr_falls_with_cluster_size_at_fixed_intervals(name):
    inp = Inputs.defaults({"checkpoint_gb": 0.5, "step_s": 1.0})
    ettr = [plan_strategy(name, Job(gpus=g, horizon_s=10 * 86400, seeds=4), inp,
                          commit_every_s=60.0, checkpoint_every_s=1800.0).ettr_mean
            for g in (64, 1024, 16384, 100_000)]
    assert all(a > b for a, b in zip(ettr, ettr[1:], strict=False)), ettr
    assert 0.5 < ettr[-1] < ettr[0] <= 1.0


def test_no_failures_leaves_exactly_the_checkpoint_overhead():
    inp = Inputs.defaults({**NO_FAILURES, "ckpt_sync_s": 20.0, "commit_s": 0.5,
                           "ckpt_async_stall_s": 2.0, "ckpt_upload_s": 30.0})
    job = Job(gpus=1024, horizon_s=10 * 86400, seeds=2, include_startup=False)
    d = 1000.0
    torchrun = plan_strategy("torchrun", job, inp, checkpoint_every_s=d)
    assert torchrun.ettr_mean == pytest.approx(d / (d + 20.0), abs=2e-4)
    assert torchrun.lost_by_cause["checkpoint"] == pytest.approx(20.0 / (d + 20.0), abs=2e-4)
    ours = plan_strategy("ours", job, inp, commit_every_s=100.0, checkpoint_every_s=d)
    # ten commits (100 s + 0.5 s stall each), then an async checkpoint stall of 2 s
    assert ours.ettr_mean == pytest.approx(1000.0 / (10 * 100.5 + 2.0), abs=2e-4)
    assert ours.ettr_sd == 0.0


@pytest.mark.parametrize("name", STRATEGIES)
def test_lost_time_by_cause_adds_up_to_the_horizon(name):
    r = plan_strategy(name, Job(gpus=16384, horizon_s=5 * 86400, seeds=3),
                      Inputs.defaults())
    assert r.ettr_mean + sum(r.lost_by_cause.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(v >= -1e-12 for v in r.lost_by_cause.values()), r.lost_by_cause
    assert sum(r.lost_by_class.values()) <= 1.0 - r.ettr_mean + 1e-9


def test_durable_optimum_is_near_young_daly_in_the_simple_case():
    # one class, restart-all, a 10 s blocking checkpoint, MTBF of the job 1 h, cheap restart
    gpus = 1000
    rate = 1000.0 * 24.0 / gpus  # per 1000 GPU-days: 24 failures a day for the job
    inp = only("crash", rate, ckpt_sync_s=10.0, torchrun_restart_s=1.0, restore_s=0.0,
               step_s=1.0)
    r = plan_strategy("torchrun", Job(gpus=gpus, horizon_s=30 * 86400, seeds=20), inp)
    young = young_interval(10.0, 3600.0)
    assert r.young_daly["durable"]["young_s"] == pytest.approx(young, rel=1e-3)
    assert r.checkpoint_every_s == pytest.approx(young, rel=0.25)
    # ...and Young's interval is as good as the searched one, within the noise
    assert r.young_daly["ettr_at_pair"] == pytest.approx(r.ettr_mean, abs=2e-3)
    # first-order expected loss at Young's interval: C/T + T/(2 MTBF) = sqrt(2C/M)
    assert 1 - r.ettr_mean == pytest.approx(math.sqrt(2 * 10.0 / 3600.0), rel=0.15)


def test_elastic_rework_is_half_a_commit_interval_per_failure():
    inp = only("crash", 5.0, commit_s=0.0, step_s=1.0, ours_rejoin_s=60.0)
    job = Job(gpus=1000, horizon_s=20 * 86400, seeds=5, include_startup=False)
    r = plan_strategy("ours", job, inp, commit_every_s=120.0, checkpoint_every_s=86400.0)
    per_failure = r.lost_by_cause["rework"] * job.horizon_s / (
        r.failures_per_day["crash"] * job.horizon_s / 86400)
    assert per_failure == pytest.approx(60.0, rel=0.12)


def test_restart_rolls_back_to_the_last_uploaded_checkpoint():
    """One failure 100 s in; checkpoints every 30 s that take 20 s to upload: the one of 90 s
    is still uploading, so the job goes back to the one of 60 s (40 s redone)."""
    inp = only("crash", 0.0, ckpt_async_stall_s=0.0, ckpt_upload_s=20.0, step_s=1.0)
    st = build("ours-torchrun", inp)
    job = Job(gpus=8, horizon_s=200.0, seeds=1, include_startup=False)
    tl = build_timeline(st, job, inp, np.random.default_rng(0), np.array([100.0]))
    ev = evaluate([tl], st, job, np.array([30.0]), np.array([1.0]))
    redo = ev.lost[5, 0, 0]  # CAUSES.index("rework")
    assert redo == pytest.approx(40.0)
    restart = tl.down[:, 3].sum()  # the relaunch after it
    assert ev.work[0, 0] == pytest.approx(200.0 - 40.0 - restart)


def test_a_failure_during_vanillas_gloo_wait_ends_a_job_nobody_restarts():
    inp = only("crash", 0.0, vanilla_giveup=0.0)
    st = Strategy(**{**build("vanilla-horovod", inp).__dict__, "restartable": False})
    job = Job(gpus=3, gpus_per_host=1, horizon_s=240.0, seeds=1, include_startup=False,
              capacity="time")
    tl = build_timeline(st, job, inp, np.random.default_rng(0), np.array([30.0, 50.0]))
    assert tl.b.max() == pytest.approx(50.0)  # nothing trains after the second fault
    assert tl.down.sum() == pytest.approx(240.0 - 30.0)


def test_bad_inputs_raise_config_errors():
    with pytest.raises(ConfigError, match="rate-crash"):
        Inputs.defaults({"rate_crash": -1.0})
    with pytest.raises(ConfigError, match="gpus"):
        Job(gpus=0)
    with pytest.raises(ConfigError, match="strategy"):
        simulate(Job(gpus=8, seeds=1, horizon_s=86400), Inputs.defaults(), ("nope",))


# -- calibration from an event log -----------------------------------------------------------


def write_log(folder: Path, failures: bool = True) -> Path:
    """A hand-written run: 3 ranks, 5 steps/s, commits every 10 steps; one worker killed
    (noticed at 20.0 s, training again at 20.8 s), back at 35.0 s (a join that stalls 0.5 s);
    one async checkpoint of 2 GB."""
    t0 = 1_000_000.0
    ev: list[dict] = []

    def e(t: float, event: str, rank: int = 0, size: int = 3, step: int = 0, **kw) -> None:
        ev.append({"ts": t0 + t, "event": event, "rank": rank, "size": size, "step": step,
                   **kw})

    for r in range(3):
        e(0.0, "start", rank=r, config={"stack": "ours", "batch_size": 4, "commit_every": 10}
          if r == 0 else None)
    for r in range(3):
        e(0.5, "sync", rank=r)
    t, step = 0.5, 0
    while step < 90:
        t, step = t + 2.0, step + 10
        e(t, "commit", step=step, seconds=0.02)
    e(t + 0.2, "checkpoint_saved", step=step, ckpt_step=step, seconds=4.0, stall_seconds=0.3,
      upload_seconds=3.7, bytes=2_000_000_000)
    if failures:
        base = t + 1.0
        e(base, "failure_detected", rank=1, step=step + 5)
        e(base + 0.01, "restore", rank=1, step=step, from_step=step + 5, to_step=step,
          lost_steps=5)
        e(base + 0.5, "reset", rank=1, size=2, step=step, old_size=3, new_size=2, seconds=0.5)
        e(base + 0.8, "sync", rank=1, size=2, step=step)
        e(base + 0.8, "sync", rank=0, size=2, step=step)
        t = base + 0.8
        for _ in range(3):
            t, step = t + 2.0, step + 10
            e(t, "commit", size=2, step=step, seconds=0.04)
        e(base + 5.0, "peer_silent", rank=0, size=2, step=step, ranks=[2], silent_seconds=1.7)
        e(base + 6.0, "hang_detected", rank=2, size=2, step=step, idle_seconds=42.0,
          budget_seconds=40.0)
        join = base + 15.0
        e(join, "hosts_changed", rank=0, size=2, step=step)
        e(join + 0.3, "reset", rank=0, size=3, step=step, old_size=2, new_size=3, seconds=0.3)
        e(join + 0.5, "sync", rank=0, size=3, step=step)
        t = join + 0.5
        for _ in range(3):
            t, step = t + 2.0, step + 10
            e(t, "commit", step=step, seconds=0.02)
    e(t + 0.1, "done", step=step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ev))
    return folder


def test_calibration_reads_a_synthetic_event_log(tmp_path):
    cal = calibrate(write_log(tmp_path / "run"))
    m = cal.measured
    assert cal.stack == "ours"
    assert m["ours_recover_s"].value == pytest.approx(0.8)
    assert m["ours_join_stall_s"].value == pytest.approx(0.5)
    assert m["ours_rejoin_s"].value == pytest.approx(15.0)
    assert m["step_s"].value == pytest.approx(0.2)  # 10 steps per 2 s at full size
    assert m["commit_s"].value == pytest.approx((12 * 0.02 + 3 * 0.04) / 15)
    assert m["checkpoint_gb"].value == pytest.approx(2.0)
    assert m["ckpt_async_stall_s"].value == pytest.approx(0.3)
    assert m["ckpt_upload_s"].value == pytest.approx(3.7)
    assert m["ours_silent_detect_s"].value == pytest.approx(1.7)
    assert m["ours_hang_detect_s"].value == pytest.approx(42.0)
    assert "ours_detect_s" not in m  # an event log cannot tell when the fault happened
    assert all(v.source.startswith("measured:") for v in m.values())
    assert cal.capacity_by_size[3] == pytest.approx(1.0)
    assert cal.capacity_by_size[2] == pytest.approx(2 / 3)  # same steps/s, 2 of 3 ranks
    inp = Inputs.defaults(measured=m)
    assert inp.source("ours_recover_s").startswith("measured:")
    assert inp.samples("ours_recover_s") == pytest.approx((0.8,))


# -- the command -------------------------------------------------------------------------------

FAST = ["--days", "2", "--seeds", "2", "--sizes", "8,1024", "--scale-seeds", "2", "--no-plot"]


def test_cli_plans_from_a_tiny_run_folder(tmp_path, capsys):
    folder = write_log(tmp_path / "run")
    assert cli_main(["plan", str(folder), "--gpus", "16384", "--json", *FAST]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in doc["results"]] == list(STRATEGIES)
    assert {"ours_recover_s", "ours_join_stall_s", "checkpoint_gb"} <= set(doc["measured"])
    assert [row["gpus"] for row in doc["scale"]] == [8, 1024]
    kinds = {d["name"]: d["kind"] for d in doc["inputs"]}
    assert kinds["rate_crash"] == "published" and kinds["ours_recover_s"] == "measured"
    assert kinds["replace_s"] == "assumption"
    for r in doc["results"]:
        assert 0.0 < r["ettr_mean"] <= 1.0


def test_cli_run_without_failures_still_plans_and_says_what_is_default(tmp_path, capsys):
    folder = write_log(tmp_path / "quiet", failures=False)
    assert cli_main(["plan", str(folder), *FAST]) == 0
    out = capsys.readouterr().out
    assert "no in-process failure in this log: recovery costs are defaults" in out
    assert "measured inputs from" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("ours_")}
    assert " M " in lines["ours_detect_s"]  # the recovery benchmark's, not this log's
    assert measured.FROM["kills"] in lines["ours_recover_s"]


def test_cli_writes_the_plot_into_the_run_folder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder = write_log(tmp_path / "run")
    args = [a for a in FAST if a != "--no-plot"]
    assert cli_main(["plan", str(folder), "--strategy", "ours", *args]) == 0
    assert (folder / "plan.png").stat().st_size > 1000
    assert "plot: " in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--gpus", "many"], "invalid int value"),
    (["--rate-hang", "-2"], "--rate-hang must be a number >= 0"),
    (["--ours-giveup", "1.5"], "<= 1"),
    (["--sizes", "8,lots"], "--sizes"),
    (["--strategy", "slurm"], "invalid choice"),
    (["/no/such/run"], "no event log at /no/such/run"),
    (["--commit-every", "0"], "--commit-every must be a positive"),
])
def test_bad_input_is_one_line_and_no_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", *argv, "--no-scale"])
    assert exc.value.code == FATAL_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert "Traceback" not in err


def test_help_explains_every_option_with_its_default():
    p = parser()
    text = p.format_help()
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.dest
        for flag in action.option_strings:
            assert flag in text
    assert "Llama 3" in text and "assumption" in text


def test_measured_defaults_are_the_benchmarks_results():
    """`measured.py` is generated from bench/results; a re-run benchmark must regenerate it."""
    import importlib.util

    path = ROOT / "bench" / "plan_constants.py"
    spec = importlib.util.spec_from_file_location("bench_plan_constants", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    files, held = module.generated()
    assert files == measured.FROM
    assert module.derive(**files) == held
    page = (ROOT / "docs" / "planner.md").read_text()
    assert [row for row in module.markdown(held) if row not in page] == []
