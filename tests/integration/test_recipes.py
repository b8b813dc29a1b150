"""The recipe conformance matrix: the guarantees on the recipes people train with.

Recipes (tests/scripts/recipe_job.py, the Trainer with `--recipe-*` flags): AdamW with weight
decay, warmup + cosine, clipping, accumulation 4, bf16 autocast and an EMA; Adam with
OneCycleLR, fp16 with a GradScaler, an EMA and clipping; SGD with Nesterov momentum and weight
decay under a warmup LambdaLR with --deterministic; every recipe with parameter groups, a frozen
layer and tied weights (tests/support/recipes.py). Every optimizer class on its own:
test_sync_agreement.py.

Guarantees, each asserted from the run's own records:
(a) every rank identical (parameters, buffers, optimizer state, scheduler, sampler, scaler,
    EMA: the per-component digests of the `done` event) after a kill, a readmission, a join
    and a leave, under Horovod Elastic with slot hosts;
(b) a resume from the memory tier and from the durable checkpoint restores every component:
    the `resume` event's digests equal the ones rank 0 recorded at that step;
(c) with --deterministic, a run killed and resumed ends bit-identical to one never killed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import (
    PYTHON,
    events,
    free_port,
    horovodrun_elastic,
    set_hosts,
    wait_for,
    write_discovery,
)
from tests.support.paths import SCRIPTS
from tests.support.runs import assert_faults_fired

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
JOB = str(SCRIPTS / "recipe_job.py")
HVD = str(Path(PYTHON).parent / "hvd-resilient")
RECIPES = {
    "adamw-warmup-cosine": ["--recipe-grad-accum", "4", "--recipe-clip-grad-norm", "1.0",
                            "--recipe-precision", "bf16", "--recipe-ema-decay", "0.999"],
    "adam-onecycle": ["--recipe-precision", "fp16", "--recipe-ema-decay", "0.99",
                      "--recipe-clip-grad-norm", "0.5"],
}


def recorded(run: Path) -> dict[int, dict[str, str]]:
    """step -> the component digests rank 0 recorded at that commit step (the last record
    of a step wins: a step redone after a restore is recorded again)."""
    out = {}
    for line in (run / "digests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["digests"]
    return out


def done_digests(run: Path) -> dict[int, dict[str, str]]:
    return {e["rank"]: e["digests"] for e in events(run / "events.jsonl")
            if e["event"] == "done"}


def assert_ranks_identical(run: Path, n: int) -> None:
    done = done_digests(run)
    assert len(done) == n, sorted(done)
    first = done[0]
    assert {"model", "optimizer", "sampler", "scheduler"} <= set(first), first
    differ = {r: sorted(k for k in d if d[k] != first[k]) for r, d in done.items()
              if d != first}
    assert not differ, f"ranks differ from rank 0 in: {differ}"


def resets(run: Path) -> list[int]:
    return [e["new_size"] for e in events(run / "events.jsonl") if e["event"] == "reset"
            and e["rank"] == 0]


def commit_steps(run: Path) -> int:
    path = run / "digests.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_rank_identical_after_a_kill_a_join_and_a_leave(tmp_path, jobs, recipe):
    """Slot hosts on one machine (what `hvd-resilient run` starts): 2 -> 1 (rank 1 killed)
    -> 2 (readmitted after the cooldown) -> 3 (a slot added) -> 2 (removed). The newcomers'
    optimizers start empty, which is where Horovod's own sync moved AdamW's parameters."""
    run = tmp_path / "run"
    run.mkdir()
    hosts, discover = write_discovery(tmp_path, "localhost:2")
    stop = tmp_path / "stop"
    cmd = horovodrun_elastic(discover, 2, 1, 3, "--gloo-timeout-seconds", "45",
                             "--blacklist-cooldown-range", "1", "2")
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    job = jobs.start(cmd + [
        PYTHON, JOB, "--recipe", recipe, *RECIPES[recipe], "--run-id", recipe,
        "--run-dir", str(run), "--batch-size", "8", "--commit-every", "5", "--epochs", "1000",
        "--checkpoint-every", "1000", "--step-time", "0.02", "--stop-file", str(stop)],
        env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=12"), name=recipe)
    wait_for(lambda: resets(run)[:2] == [1, 2], 240, "the kill and the readmission", job)
    set_hosts(hosts, "localhost:3")
    wait_for(lambda: 3 in resets(run), 240, "the added slot's join", job)
    set_hosts(hosts, "localhost:2")
    wait_for(lambda: resets(run)[-1:] == [2] and resets(run).count(2) >= 2, 240,
             "the removed slot's leave", job)
    seen = commit_steps(run)
    wait_for(lambda: commit_steps(run) >= seen + 2, 120, "two commits at size 2", job)
    stop.touch()
    assert job.wait(180) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    assert resets(run) == [1, 2, 3, 2], resets(run)
    left = [e["slot"] for e in events(run / "events.jsonl") if e["event"] == "left_job"]
    assert left == ["localhost+2:0"], left  # the removed slot's worker said so and exited 0
    assert "removed from elastic job" not in job.output(), "the removed worker aborted"
    assert_ranks_identical(run, 2)
    checks = [e for e in events(run / "events.jsonl") if e["event"] == "sync_check"]
    joined = [c for c in checks if c["sent"]]
    assert joined and all({"model", "optimizer"} <= set(c["sent"]) for c in joined), checks
    assert not any(c["repaired"] for c in checks), checks


def mpi_job(jobs, tmp: Path, name: str, steps: int, fault: str = "",
            extra: tuple[str, ...] = ()):
    run = tmp / name
    env = jobs.env(HVD_RESILIENT_FAULT=fault) if fault else jobs.env()
    job = jobs.start([HVD, "run", "--launcher", "mpi", "--np", "2", "--run-id", name,
                      "--run-dir", str(run), "--max-restarts", "2",
                      "--checkpoint", f"file://{tmp}/ckpt-{name}", "--", PYTHON, JOB,
                      "--run-id", name, "--run-dir", str(run), "--max-steps", str(steps),
                      "--batch-size", "8", "--commit-every", "5", "--checkpoint-every", "20",
                      "--epochs", "100",
                      *extra], env=env, name=name)
    return run, job


def resume_events(run: Path) -> list[dict]:
    return [e for e in events(run / "events.jsonl") if e["event"] == "resume"]


def test_resume_restores_every_component_from_memory_and_durable(tmp_path, jobs):
    """mpirun (a static world: a dead rank ends the job, the supervisor relaunches it): the
    relaunch resumes from the memory tier, a later launch from the durable checkpoint; each
    resume holds exactly the components recorded at its step, the GradScaler and EMA too."""
    flags = ("--recipe", "adam-onecycle", *RECIPES["adam-onecycle"],
             "--recipe-grad-accum", "2")
    run, job = mpi_job(jobs, tmp_path, "fp16", 50, fault="kill:rank=1:step=33", extra=flags)
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    (memory,) = resume_events(run)
    assert memory["source"] == "memory" and memory["from_step"] == 30, memory
    assert memory["digests"] == recorded(run)[30], "the memory tier lost a component"
    assert {"scaler", "ema"} <= set(memory["digests"])
    assert_ranks_identical(run, 2)

    job = jobs.start([HVD, "run", "--launcher", "mpi", "--np", "2", "--run-id", "fp16",
                      "--run-dir", str(run), "--checkpoint", f"file://{tmp_path}/ckpt-fp16",
                      "--", PYTHON, JOB, "--run-id", "fp16", "--run-dir", str(run),
                      "--max-steps", "60", "--batch-size", "8", "--commit-every", "5",
                      "--epochs", "100",
                      "--checkpoint-every", "20", *flags], env=jobs.env(), name="again")
    assert job.wait(300) == 0, job.output()[-3000:]
    durable = resume_events(run)[-1]
    assert durable["source"] == "durable" and durable["from_step"] == 50, durable
    assert durable["digests"] == recorded(run)[50], "the durable checkpoint lost a component"


def test_deterministic_recipe_killed_and_resumed_ends_bit_identical(tmp_path, jobs):
    """(c) under torchrun: SGD with Nesterov momentum and weight decay, a warmup LambdaLR,
    accumulation 2 and clipping, --deterministic; a worker killed at step 23 (torchrun
    restarts every worker, the memory tier resumes them) ends exactly where a run never
    killed ends."""
    flags = ["--recipe", "sgd-nesterov-lambda", "--recipe-grad-accum", "2",
             "--recipe-clip-grad-norm", "1.0", "--deterministic", "--max-steps", "40",
             "--batch-size", "8", "--commit-every", "5", "--checkpoint-every", "1000"]
    finals = []
    for name, fault in (("ref", ""), ("killed", "kill:rank=1:step=23")):
        run = tmp_path / name
        env = jobs.env(HVD_RESILIENT_FAULT=fault) if fault else jobs.env()
        job = jobs.start([HVD, "run", "--launcher", "torchrun", "--np", "2", "--run-id", name,
                          "--run-dir", str(run), "--checkpoint", f"file://{tmp_path}/c-{name}",
                          "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                          "--torchrun-restarts", "2", "--", PYTHON, JOB, "--run-id", name,
                          "--run-dir", str(run), *flags], env=env, name=name)
        assert job.wait(300) == 0, job.output()[-3000:]
        assert_ranks_identical(run, 2)
        finals.append(done_digests(run)[0])
    assert_faults_fired(tmp_path / "killed", 1)
    (resume,) = resume_events(tmp_path / "killed")
    assert resume["source"] == "memory" and resume["from_step"] == 20, resume
    assert resume["digests"] == recorded(tmp_path / "killed")[20]
    assert finals[0] == finals[1], "the resumed run is not bit-identical to the one never killed"
