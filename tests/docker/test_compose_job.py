"""docker/compose.yaml for real: the job trains to the end with S3 checkpoints; a long job
lives through every docker/chaos/*.sh against its live containers; after `down` and `up` it
resumes from its newest checkpoint and finishes. The tests run in file order and share one
compose project (the session's `cluster`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker

CHAOS = Path(__file__).resolve().parents[2] / "docker" / "chaos"
CHAOS_RUN = "chaos"
# The chaos job: long enough never to finish by itself, a checkpoint every 50 steps, and
# survivors that give up on a silent peer after 15 s instead of 30.
CHAOS_ENV = {"RUN_ID": CHAOS_RUN, "EPOCHS": "100000", "CHECKPOINT_EVERY": "50",
             "GLOO_TIMEOUT_SECONDS": "15"}


def names(events: list[dict]) -> list[str]:
    return [e["event"] for e in events]


@pytest.mark.timeout(900)
def test_job_trains_to_the_end_with_s3_checkpoints(cluster):
    env = {"RUN_ID": "e2e", "EPOCHS": "3", "CHECKPOINT_EVERY": "20"}
    cluster.dc("up", "-d", env=env, timeout=600)
    code = cluster.wait_exit("driver", timeout=600)
    assert code == 0, cluster.logs("driver")
    events = cluster.events("e2e")
    done = [e for e in events if e["event"] == "done"]
    saved = sorted({e["ckpt_step"] for e in events if e["event"] == "checkpoint_saved"})
    assert done and done[0]["step"] == saved[-1], (done, saved)
    assert len(saved) >= 2 and saved[0] == 20, saved
    assert "accuracy" in cluster.shared("cat", "/shared/runs/e2e/result.json")
    # every commit also reached the workers' memory tier (shm_size in compose.yaml)
    tier = [e["event"] for e in events if e["event"].startswith("memory_")]
    assert "memory_commit" in tier and not {"memory_commit_failed", "memory_tier_full"} & set(
        tier), sorted(set(tier))
    # The checkpoints are in SeaweedFS (S3), listed by the project's own CLI.
    listing = cluster.dc("run", "--rm", "--no-deps", "-T", "driver", "hvd-resilient", "ckpt",
                         "list", "s3://ckpt/e2e", env=env, timeout=120).stdout
    listed = {int(ln.split()[0]) for ln in listing.splitlines() if ln.split()[:1] != ["STEP"]
              and ln.split() and ln.split()[0].isdigit()}
    assert saved[-1] in listed, listing


@pytest.mark.timeout(900)
def test_chaos_job_starts(cluster):
    cluster.dc("up", "-d", "driver", env=CHAOS_ENV, timeout=600)
    cluster.wait_event(CHAOS_RUN, "commit", timeout=600)


def run_chaos(cluster, script: str, *args: str, timeout: float = 840) -> str:
    n = len(cluster.events(CHAOS_RUN))
    r = subprocess.run([str(CHAOS / script), *args], capture_output=True, text=True,
                       timeout=timeout, env={**cluster.env, **CHAOS_ENV, "CHAOS_TIMEOUT": "300"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out + cluster.logs("driver")
    assert "FAIL" not in r.stdout and "ok: '" in r.stdout, out
    # The job lived through it: still running, nothing fatal, training went on afterwards.
    assert cluster.running("driver"), cluster.logs("driver")
    after = cluster.events(CHAOS_RUN)[n:]
    assert "fatal" not in names(after), [e for e in after if e["event"] == "fatal"]
    cluster.wait_event(CHAOS_RUN, "commit", timeout=120, after=len(cluster.events(CHAOS_RUN)))
    return r.stdout


@pytest.mark.timeout(900)
def test_chaos_stop_worker(cluster):
    out = run_chaos(cluster, "stop-worker.sh", "worker-2")
    assert re.search(r"ok: 'reset'.*\"new_size\": ?2", out), out
    assert re.search(r"ok: 'reset'.*\"new_size\": ?3", out), out


@pytest.mark.timeout(900)
def test_chaos_kill_worker(cluster):
    out = run_chaos(cluster, "kill-worker.sh", "worker-1")
    for event in ("failure_detected", "restore", "reset"):
        assert f"ok: '{event}'" in out, out


@pytest.mark.timeout(900)
def test_chaos_disconnect_worker(cluster):
    out = run_chaos(cluster, "disconnect-worker.sh", "worker-3")
    assert re.search(r"ok: 'reset'.*\"new_size\": ?2", out), out
    assert re.search(r"ok: 'reset'.*\"new_size\": ?3", out), out


@pytest.mark.timeout(900)
def test_chaos_edit_hosts(cluster):
    out = run_chaos(cluster, "edit-hosts.sh", "worker-3")
    assert "ok: 'hosts_changed'" in out, out
    assert re.search(r"ok: 'reset'.*\"new_size\": ?4", out), out  # the spare joined


@pytest.mark.timeout(900)
def test_chaos_s3_outage(cluster):
    out = run_chaos(cluster, "s3-outage.sh", "10")
    for event in ("checkpoint_failed", "commit", "checkpoint_saved"):
        assert f"ok: '{event}'" in out, out


@pytest.mark.timeout(900)
def test_down_and_up_resumes_from_the_newest_checkpoint(cluster):
    cluster.down(volumes=False)  # keeps the shared volume and the S3 data
    before = cluster.events(CHAOS_RUN)
    saved = [e for e in before if e["event"] == "checkpoint_saved"]
    assert saved, "no checkpoint before down"
    newest = max(saved, key=lambda e: e["ckpt_step"])
    # Up again, now with an end in sight: two epochs past the checkpoint.
    env = {**CHAOS_ENV, "EPOCHS": str(newest["epoch"] + 2)}
    cluster.dc("up", "-d", env=env, timeout=600)
    assert cluster.wait_exit("driver", timeout=840) == 0, cluster.logs("driver")
    after = cluster.events(CHAOS_RUN)[len(before):]
    resumes = [e for e in after if e["event"] == "resume"]
    assert resumes and {e["from_step"] for e in resumes} == {newest["ckpt_step"]}, (resumes, newest)
    done = [e for e in after if e["event"] == "done"]
    assert done and done[0]["epoch"] == newest["epoch"] + 2, done
