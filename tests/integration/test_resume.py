"""A job killed outright (SIGKILL to every process) resumes from its newest durable checkpoint
(the memory tier off: tests/integration/test_memory_tier.py covers the resume from memory), and
with the same world size and seed ends bit-identical to a run that was never killed."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.jobs import PYTHON, events, kill_job, wait_for
from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
DIGITS = str(ROOT / "examples" / "digits.py")
HOROVODRUN = str(Path(PYTHON).parent / "horovodrun")


def digits_cmd(run: Path, url: str | None = None) -> list[str]:
    """The durable path: the memory tier is off, so the restart reads the store."""
    cmd = [HOROVODRUN, "-np", "2", "--gloo", "--network-interface", "lo", PYTHON, DIGITS,
           "--run-id", "r", "--run-dir", str(run), "--epochs", "25", "--commit-every", "5",
           "--checkpoint-every", "20", "--seed", "3", "--no-memory-tier-enabled"]
    return cmd + (["--checkpoint-url", url] if url else [])


def done_digests(run: Path) -> set[str]:
    return {e["params_sha256"] for e in events(run / "events.jsonl") if e["event"] == "done"}


def saved_steps(run: Path) -> list[int]:
    return [e["ckpt_step"] for e in events(run / "events.jsonl")
            if e["event"] == "checkpoint_saved"]


def check_kill_and_resume(tmp_path: Path, jobs, url_for) -> None:
    ref = tmp_path / "ref"
    job = jobs.start(digits_cmd(ref, url_for("ref")), name="ref")
    assert job.wait(240) == 0, job.output()[-3000:]
    (reference,) = done_digests(ref)

    run = tmp_path / "run"
    job = jobs.start(digits_cmd(run, url_for("run")), name="first")
    wait_for(lambda: any(s >= 100 for s in saved_steps(run)), 180, "a checkpoint at step >= 100",
             job)
    kill_job(job)
    assert not done_digests(run), "the job finished before it could be killed"
    last_saved = max(saved_steps(run))

    job = jobs.start(digits_cmd(run, url_for("run")), name="second")
    assert job.wait(240) == 0, job.output()[-3000:]
    resumes = [e for e in events(run / "events.jsonl") if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["from_step"] >= last_saved - 20, resumes
    assert done_digests(run) == {reference}, "resumed run is not bit-identical to the reference"


def test_sigkill_whole_job_resumes_bit_identical_file_store(tmp_path, jobs):
    check_kill_and_resume(tmp_path, jobs, lambda name: (tmp_path / name / "ckpt").as_uri())


@pytest.mark.extended  # the file store's variant runs in make test; S3 resumes in test_launch
def test_sigkill_whole_job_resumes_bit_identical_s3(tmp_path, jobs, s3_url, s3_server):
    jobs.extra_env.update(s3_server.env())  # every launch talks to the test's SeaweedFS
    check_kill_and_resume(tmp_path, jobs, lambda name: f"{s3_url}/{name}")


def test_s3_outage_during_training_is_reported_and_training_goes_on(tmp_path, jobs, s3_url,
                                                                    s3_server):
    jobs.extra_env.update(s3_server.env())
    run = tmp_path / "run"
    cmd = [HOROVODRUN, "-np", "2", "--gloo", "--network-interface", "lo", PYTHON, DIGITS,
           "--run-id", "o", "--run-dir", str(run), "--epochs", "2000", "--commit-every", "5",
           "--checkpoint-every", "50", "--checkpoint-url", f"{s3_url}/o"]
    job = jobs.start(cmd, name="outage")
    evs = lambda: events(run / "events.jsonl")  # noqa: E731
    wait_for(lambda: saved_steps(run), 180, "a first checkpoint", job)
    s3_server.stop()
    try:
        failed = wait_for(lambda: [e for e in evs() if e["event"] == "checkpoint_failed"], 120,
                          "a failed checkpoint while S3 is down", job)
        step_at_failure = max(e["step"] for e in evs() if e["event"] == "progress")
    finally:
        s3_server.start()
    wait_for(lambda: any(s > failed[0]["ckpt_step"] for s in saved_steps(run)), 120,
             "a checkpoint saved after S3 came back", job)
    assert job.proc.poll() is None, "training stopped during the outage"
    workers = [p for p in job.processes() if p.cmdline()[1:2] == [DIGITS]]
    for p in workers:
        p.send_signal(signal.SIGUSR1)
    job.wait(120)
    final = evs()
    assert any(e["event"] == "preempted" for e in final)
    assert max(e["step"] for e in final if e["event"] == "progress") > step_at_failure
    assert s3_server.secret_key not in (run / "events.jsonl").read_text()


def test_resume_at_another_world_size_continues_the_epoch(tmp_path, jobs):
    """Saved at 2 workers, resumed at 1, then at 3: the sampler position carries over, so the
    epoch goes on where it stopped; the random streams fall back to derived seeds."""
    run = tmp_path / "run"

    def launch(np: int, max_steps: int) -> None:
        job = jobs.start([HOROVODRUN, "-np", str(np), "--gloo", "--network-interface", "lo",
                          PYTHON, DIGITS, "--run-id", "w", "--run-dir", str(run), "--epochs",
                          "50", "--max-steps", str(max_steps), "--checkpoint-every", "10",
                          "--seed", "4"], name=f"np{np}")
        assert job.wait(240) == 0, job.output()[-3000:]

    launch(2, 40)
    launch(1, 70)
    launch(3, 90)
    evs = events(run / "events.jsonl")
    resumes = [e for e in evs if e["event"] == "resume"]
    assert [(e["from_step"], e["saved_world_size"], e["size"]) for e in resumes] == [
        (40, 2, 1), (70, 1, 3)]
    saved = {e["ckpt_step"]: e for e in evs if e["event"] == "checkpoint_saved"}
    assert max(saved) == 90
    # Exact-once across the size changes: every sample counted so far is where the sampler
    # stands (epoch * N + position in the epoch), in every checkpoint that is kept.
    from hvd_resilient.checkpoint.manager import CheckpointManager
    from hvd_resilient.checkpoint.split import decode_file, join_state

    manager = CheckpointManager((run / "checkpoints").as_uri())
    kept = manager.list()
    assert kept and kept[-1].step == 90
    for info in kept:
        sd = join_state(manager.load(info, decode_file))
        n, sampler = sd["sampler"]["num_samples"], sd["sampler"]
        assert sd["counters"]["samples"] == sampler["epoch"] * n + sampler["consumed"], info.step
    done = [e for e in evs if e["event"] == "done" and e["size"] == 3]
    assert len(done) == 3 and len({e["params_sha256"] for e in done}) == 1
