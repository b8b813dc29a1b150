"""The start and the end of a run never lose or overwrite checkpoints, and never report success
that did not happen.

Each test is a fault at the worst moment for one guarantee: a resume that fails on rank 0 while
the other ranks could train from scratch over the run's checkpoints; a store that is down when
the job is relaunched; rank 0 killed after a checkpoint's files are stored and before its
manifest is published (mid-run, and for the final checkpoint).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from hvd_resilient.checkpoint.fence import FENCE_KEY
from hvd_resilient.errors import FATAL_EXIT_CODE
from tests.support.jobs import (
    PYTHON,
    events,
    free_port,
    horovodrun_elastic,
    wait_for,
    write_discovery,
)
from tests.support.paths import ROOT
from tests.support.runs import assert_faults_fired

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
DIGITS = str(ROOT / "examples" / "digits.py")
HVD = str(Path(PYTHON).parent / "hvd-resilient")
HOROVODRUN = str(Path(PYTHON).parent / "horovodrun")


def tree_digest(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder`` but the run's fence (each launch raises it to its lease
    epoch: not a checkpoint): content digest and modification time (ns)."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                         p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != FENCE_KEY}


def run_cmd(backend: str, tmp: Path, run: Path, ckpt: str, *train: str) -> list[str]:
    """`hvd-resilient run` with two one-slot workers on this machine, no restarts."""
    if backend == "horovod":
        _, discover = write_discovery(tmp, "localhost:1,127.0.0.1:1")
        launch = ["--discovery", str(discover), "--min-np", "2", "--max-np", "2",
                  "--network-interface", "lo"]
    else:
        launch = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--torchrun-restarts", "2"]
    return [HVD, "run", "--launcher", backend, "--np", "2", "--run-id", "r", "--run-dir",
            str(run), "--checkpoint", ckpt, "--max-restarts", "0", *launch, "--", PYTHON,
            DIGITS, *train]


@pytest.mark.parametrize("backend", ["horovod", "torchrun"])
def test_a_checkpoint_that_does_not_fit_stops_every_rank_and_rewrites_nothing(
        backend, tmp_path, jobs):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    common = ["--max-steps", "5", "--checkpoint-every", "5", "--commit-every", "5"]
    job = jobs.start(run_cmd(backend, tmp_path, run, ckpt.as_uri(), *common, "--hidden", "32"),
                     name="first")
    assert job.wait(240) == 0, job.output()[-3000:]
    before = tree_digest(ckpt)
    assert any(k.startswith("step-0000000005/") for k in before), before

    n_events = len(events(run / "events.jsonl"))
    job = jobs.start(run_cmd(backend, tmp_path, run, ckpt.as_uri(), *common, "--hidden", "48"),
                     name="second")
    code = job.wait(240)
    out = job.output()
    assert code != 0, "a run that could not resume must not report success\n" + out[-3000:]
    assert "finished (exit 0)" not in out
    assert tree_digest(ckpt) == before, "the run's checkpoints were written again"
    second = events(run / "events.jsonl")[n_events:]
    fatal = [e for e in second if e["event"] == "fatal"]
    assert fatal and "cannot be loaded into this model" in fatal[0]["error"], second
    trained = [e for e in second if e["event"] in ("commit", "checkpoint_saved", "progress")]
    assert not trained, f"ranks trained after a failed resume: {trained}"
    starts = [e for e in second if e["event"] == "start" and e["rank"] >= 0]
    assert len(starts) == 2, f"the workers were restarted into the same error: {starts}"


def bare_env() -> dict[str, str]:
    """No settings from this shell, but the test's own memory tier folder (conftest)."""
    return {"PYTHONPATH": str(ROOT), "PATH": str(Path(PYTHON).parent) + ":/usr/bin:/bin",
            "HVD_RESILIENT_MEMORY_TIER_DIR": os.environ["HVD_RESILIENT_MEMORY_TIER_DIR"]}


def test_no_resume_over_existing_checkpoints_refuses_to_start(tmp_path):
    run = tmp_path / "run"
    cmd = [PYTHON, DIGITS, "--run-dir", str(run), "--max-steps", "4", "--checkpoint-every", "2"]
    env = bare_env()
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    before = tree_digest(run / "checkpoints")
    again = subprocess.run(cmd + ["--no-checkpoint-resume"], capture_output=True, text=True,
                           timeout=180, env=env)
    assert again.returncode == FATAL_EXIT_CODE, again.stderr[-3000:]
    errors = [line for line in again.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "checkpoints exist at" in errors[0], again.stderr
    assert "newest step 4" in errors[0] and "Traceback" not in again.stderr
    assert tree_digest(run / "checkpoints") == before


def test_checkpoints_that_all_fail_verification_are_not_trained_over(tmp_path):
    """Resume skips a bad checkpoint for an older one; when none is left it must not start from
    scratch and write its own steps over the evidence."""
    run = tmp_path / "run"
    cmd = [PYTHON, DIGITS, "--run-dir", str(run), "--max-steps", "4", "--checkpoint-every", "2"]
    env = bare_env()
    assert subprocess.run(cmd, capture_output=True, timeout=180, env=env).returncode == 0
    for part in (run / "checkpoints").glob("step-*/*"):
        if part.name != "manifest.json":
            data = bytearray(part.read_bytes())
            data[len(data) // 2] ^= 0x01
            part.write_bytes(bytes(data))
    before = tree_digest(run / "checkpoints")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert again.returncode == FATAL_EXIT_CODE, again.stderr[-3000:]
    assert "none of them verifies" in again.stderr and "Traceback" not in again.stderr
    assert tree_digest(run / "checkpoints") == before


def test_store_down_at_relaunch_waits_within_a_bound_and_never_trains_from_scratch(
        tmp_path, jobs, s3_url, s3_server):
    jobs.extra_env.update(s3_server.env())
    run, url = tmp_path / "run", f"{s3_url}/down"

    def horovod(*extra: str) -> list[str]:
        return [HOROVODRUN, "-np", "2", "--gloo", "--network-interface", "lo", PYTHON, DIGITS,
                "--run-dir", str(run), "--checkpoint-url", url, "--epochs", "50",
                "--checkpoint-every", "10", "--commit-every", "5", *extra]

    def saved(since: int) -> list[int]:
        return [e["ckpt_step"] for e in events(run / "events.jsonl")[since:]
                if e["event"] == "checkpoint_saved"]

    assert jobs.start(horovod("--max-steps", "20"), name="first").wait(240) == 0
    assert saved(0) == [10, 20]

    s3_server.stop()
    try:
        # Down for longer than the bound: the job stops with a fatal error, having trained nothing.
        n = len(events(run / "events.jsonl"))
        job = jobs.start(horovod("--max-steps", "40", "--checkpoint-store-wait-seconds", "2"),
                         name="down")
        assert job.wait(240) not in (0, None), job.output()[-3000:]
        evs = events(run / "events.jsonl")[n:]
        assert [e for e in evs if e["event"] == "fatal" and "unreachable" in e["error"]], evs
        assert not [e for e in evs if e["event"] in ("commit", "progress")], evs

        # Down briefly: the relaunch waits, then resumes from step 20 once the store is back.
        n = len(events(run / "events.jsonl"))
        job = jobs.start(horovod("--max-steps", "40", "--checkpoint-store-wait-seconds", "120"),
                         name="brief")
        wait_for(lambda: "unreachable at start" in job.output(), 120, "the wait for the store",
                 job)
    finally:
        s3_server.start()
    assert job.wait(240) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")[n:]
    assert [e["from_step"] for e in evs if e["event"] == "resume"] == [20]
    assert saved(n) == [30, 40], "steps 10 and 20 must never be written again"


@pytest.mark.parametrize("kill_step", [30, 60], ids=["mid-run", "final"])
def test_rank0_killed_between_files_and_manifest_the_checkpoint_is_redone(
        kill_step, tmp_path, jobs):
    """Rank 0 dies after storing a checkpoint's files, before its manifest: the survivors must
    not count it as saved; the next rank 0 writes it, and the run ends only once its final
    checkpoint is published."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:3")
    cmd = horovodrun_elastic(discover, 3, 2, 3, "--gloo-timeout-seconds", "45",
                             "--blacklist-cooldown-range", "30", "40")
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    job = jobs.start(cmd + [PYTHON, DIGITS, "--run-dir", str(run), "--checkpoint-url",
                            ckpt.as_uri(), "--epochs", "100", "--max-steps", "60",
                            "--checkpoint-every", "10", "--commit-every", "10",
                            "--checkpoint-keep-last", "10"],
                     env=jobs.env(HVD_RESILIENT_FAULT=f"kill:rank=0:step={kill_step}:at=upload"),
                     name="kill0")
    assert job.wait(360) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    (reset,) = [e for e in evs if e["event"] == "reset" and e["rank"] == 0]
    # The survivors restored the commit at or after the lost save (rank 0's main thread may
    # have trained on while its writer uploaded); that state is saved at once after the reset.
    restored = {e["to_step"] for e in evs if e["event"] == "restore"}
    assert len(restored) == 1 and restored.pop() >= kill_step
    redone = [e["ckpt_step"] for e in evs
              if e["event"] == "checkpoint_saved" and e["ts"] > reset["ts"]]
    assert redone and redone[0] == reset["step"], (redone, reset)
    assert (ckpt / f"step-{reset['step']:010d}" / "manifest.json").exists()
    assert (ckpt / "step-0000000060" / "manifest.json").exists(), "final checkpoint missing"
    done = [e for e in evs if e["event"] == "done"]
    assert done and {e["step"] for e in done} == {60}, done
