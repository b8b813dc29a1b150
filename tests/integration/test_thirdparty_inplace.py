"""PyTorch's DDP tutorial script under `hvd-resilient run --launcher inplace`, with only the
lines docs/inplace-ddp.md tells a user to add (`pytorch_ddp_tutorial/inplace.patch`, after the
CPU patch), and without them.

Adopted: a worker SIGKILLed mid-run is dropped, the two survivors go on in the processes they
were launched as (their pids before and after), finish every epoch, exit 0, and end with the
same DDP parameters (the probe's digests at `destroy_process_group()`). Not adopted: one line
that says what to add, exit 78, no relaunch, no traceback.

And the hazard the adapter exists for, on a script whose every gradient is known
(tests/scripts/ddp_shrink_job.py): the first step after a shrink 3 -> 2 averages over the new
world (1.5), where a DDP reducer left on the old group fails (torch 2.13: the group is
destroyed) or divides by the old size (1.0: torch's in-place reconfigure).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from tests.support.jobs import PYTHON, VENV_BIN, events, wait_for
from tests.support.paths import SCRIPTS
from tests.support.thirdparty import prepare, probe_env, probed_digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
EPOCHS = 40


def run_tutorial(jobs, tmp: Path, patches: tuple[str, ...], name: str, epochs: int = EPOCHS):
    script = prepare("pytorch_ddp_tutorial", tmp / "script", patches)
    run = tmp / "run"
    cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace", "--np", "3",
           "--run-id", name, "--run-dir", str(run), "--max-restarts", "2", "--",
           PYTHON, "multigpu_torchrun.py", str(epochs), "1000"]
    env = probe_env(jobs.env(), tmp / "probe")
    return jobs.start(cmd, env=env, cwd=script, name=name), run


def test_the_adapted_tutorial_loses_a_worker_and_the_survivors_go_on_in_their_processes(
        tmp_path, jobs):
    job, run = run_tutorial(jobs, tmp_path, ("cpu.patch", "inplace.patch"), "tutorial-kill")
    log = run / "events.jsonl"

    def commits() -> int:
        return len([e for e in events(log) if e["event"] == "commit"]) if log.exists() else 0

    wait_for(lambda: commits() >= 3, 150, "three epochs committed", job)
    pids = {e["rank"]: e["pid"] for e in events(log) if e["event"] == "start"}
    assert sorted(pids) == [0, 1, 2], pids
    psutil.Process(pids[1]).kill()
    assert job.wait(180) == 0, job.output()[-4000:]

    evs = events(log)
    starts = [e for e in evs if e["event"] == "start"]
    assert len(starts) == 3, f"a worker was (re)started: {starts}"
    resets = [e for e in evs if e["event"] == "reset"]
    assert resets and {e["new_size"] for e in resets} == {2}, resets
    done = {e["rank"]: e for e in evs if e["event"] == "done"}
    assert sorted(done) == [0, 1], done
    # the survivors are the launch's ranks 0 and 2, each still in its own process
    assert {e["pid"] for e in evs if e["event"] == "first_step"} == {pids[0], pids[2]}, evs
    # The probe records at every destroy_process_group(): the backend's own at the reset
    # (rank2.json, the launch's rank 2 leaving generation 0) and the script's last line on
    # ranks 0 and 1 of the final world.
    probe = {json.loads(f.read_text())["pid"] for f in (tmp_path / "probe").glob("rank*.json")}
    assert probe == {pids[0], pids[2]}, (probe, pids)
    digests = {r: d for r, d in probed_digests(tmp_path / "probe").items() if r < 2}
    assert sorted(digests) == [0, 1] and len(set(digests.values())) == 1, digests
    assert done[0]["digests"] == done[1]["digests"], done
    epochs = [e for e in evs if e["event"] == "commit"]
    assert len({e["step"] for e in epochs}) >= EPOCHS, "an epoch went missing"
    out = job.output()
    assert out.count("Epoch 39 |") == 2, out[-3000:]  # the last epoch, on both survivors
    assert "Steps: 32" in out, "the sampler was not re-planned for 2 ranks (2048 / 2 / 32)"


def test_the_tutorial_without_the_adapter_is_refused_with_one_line(tmp_path, jobs):
    job, run = run_tutorial(jobs, tmp_path, ("cpu.patch",), "tutorial-unadopted", epochs=2)
    assert job.wait(120) == 78, job.output()[-4000:]
    out = job.output()
    assert "Traceback" not in out and "ValueError" not in out, out[-4000:]
    said = [line for line in out.splitlines() if "inplace.init_process_group" in line]
    assert len(said) == 1, out[-4000:]
    assert "docs/inplace-ddp.md" in said[0] and "not restarting" in said[0], said
    launches = [e for e in events(run / "events.jsonl") if e["event"] == "launch"]
    assert len(launches) == 1, f"relaunched: {launches}"


def test_the_first_ddp_step_after_a_shrink_averages_over_the_new_world(tmp_path, jobs):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [PYTHON, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", "3", "--",
           PYTHON, str(SCRIPTS / "ddp_shrink_job.py"), "--out", str(out), "--steps", "12",
           "--die-member", "1", "--die-at", "4"]
    job = jobs.start(cmd, env=jobs.env(HVD_RESILIENT_RUN_DIR=str(tmp_path / "run")),
                     name="ddp-shrink")
    assert job.wait(150) == 0, job.output()[-4000:]
    lines = [json.loads(x) for x in (out / "grads.jsonl").read_text().splitlines()]
    before = [x for x in lines if x["size"] == 3]
    after = [x for x in lines if x["size"] == 2]
    assert before and all(x["grad"] == [2.0] * 4 for x in before), before[:3]
    assert {x["member"] for x in after} == {0, 2}, after[:3]
    first = min(x["step"] for x in after)
    assert first <= 4, f"the survivors redid nothing up to the fault? {first}"
    wrong = [x for x in after if x["grad"] != [x["expected"]] * 4]
    assert not wrong, f"averaged over the old world after the shrink: {wrong[:3]}"
    finals = [json.loads(f.read_text()) for f in sorted(out.glob("final-*.json"))]
    assert [f["member"] for f in finals] == [0, 2] and len({f["digest"] for f in finals}) == 1
