"""FSDP2 on the in-place backend: a lost worker's shards come back from the memory tier, and the
survivors re-shard the model onto the smaller world in their own processes.

The job (tests/scripts/fsdp_job.py: AdamW with weight decay, a step schedule, uneven shards) runs
with accumulation, clipping and bf16 under the real agent; two workers are SIGKILLed one after
the other, the second before the smaller world's first commit, so both reloads come from the
4-rank commit. Right after each reload the gathered model AND optimizer state, the sampler, the
scheduler and the counters must equal what that commit held.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hvd_resilient.checkpoint import CheckpointManager
from hvd_resilient.errors import FATAL_EXIT_CODE
from tests.integration.test_fsdp import check_resumed_state
from tests.support.jobs import PYTHON, events
from tests.support.paths import SCRIPTS
from tests.support.runs import assert_faults_fired

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
JOB = str(SCRIPTS / "fsdp_job.py")
COMMIT_EVERY = 4


def agent_cmd(run: Path, nproc: int, max_steps: int, *agent_args: str) -> list[str]:
    return [PYTHON, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", str(nproc),
            *agent_args, "--", PYTHON, JOB, "--fsdp", "--run-id", "r", "--run-dir", str(run),
            "--checkpoint-url", (run.parent / "ckpt").as_uri(), "--checkpoint-every", "1000",
            "--commit-every", str(COMMIT_EVERY), "--batch-size", "8", "--epochs", "1000",
            "--max-steps", str(max_steps), "--log-every", "1000", "--dump-dir",
            str(run / "dumps"), "--recipe-grad-accum", "2", "--recipe-clip-grad-norm", "1.0",
            "--recipe-precision", "bf16"]


def test_fsdp_4_to_3_to_2_in_place_reloads_the_lost_shards_from_the_memory_tier(
        tmp_path, jobs, memory_tier_dir):
    run = tmp_path / "run"
    job = jobs.start(agent_cmd(run, 4, 30), name="inplace-fsdp",
                     env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=13,kill:rank=2:step=14"))
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 2)
    evs = events(run / "events.jsonl")
    assert len([e for e in evs if e["event"] == "start"]) == 4, "a worker was (re)started"
    resets = [e for e in evs if e["event"] == "reset" and e["rank"] == 0]
    assert [e["new_size"] for e in resets] == [3, 2], resets
    reloads = [e for e in evs if e["event"] == "resume"]
    assert [(e["source"], e["from_step"], e["saved_world_size"]) for e in reloads] == [
        ("memory", 12, 4), ("memory", 12, 4)], reloads
    restores = [e for e in evs if e["event"] == "restore"]
    assert restores and all(0 <= e["lost_steps"] <= COMMIT_EVERY for e in restores), restores
    check_resumed_state(run, 12, 4, 3)
    check_resumed_state(run, 12, 4, 2)
    done = [e for e in evs if e["event"] == "done" and "params_sha256" in e]
    assert sorted(e["rank"] for e in done) == [0, 1] and {e["size"] for e in done} == {2}
    assert len({e["params_sha256"] for e in done}) == 1, "ranks disagree after training on"
    final = CheckpointManager((tmp_path / "ckpt").as_uri()).latest()
    assert final is not None and (final.step, final.world_size) == (30, 2), final
    assert not list(Path(memory_tier_dir).rglob("step-*")), "commits left after the run"


def test_fsdp_in_place_refuses_replacement_workers_with_one_line(tmp_path, jobs):
    """A newcomer would need every shard of a model nobody holds whole: refused at start."""
    job = jobs.start(agent_cmd(tmp_path / "run", 2, 10, "--replace"), name="fsdp-replace")
    assert job.wait(120) == FATAL_EXIT_CODE, job.output()[-3000:]
    out = job.output()
    assert out.count("error: fsdp on the inplace backend takes no replacement or standby "
                     "workers yet (a newcomer would need every shard); drop --replace and "
                     "--standby") == 2, out[-3000:]
    assert "Traceback" not in out
