"""The torch-native path: the same digits script under torchrun (c10d rendezvous, Gloo on CPU).

torchrun restarts every worker after one dies; a plain restart hangs in Gloo process-group
creation here (the new round reads the dead round's addresses from the agent's store). These
tests kill a worker and require the job to finish, resumed from its last commit (the memory
tier), with parameters bit-identical to a run never killed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.jobs import PYTHON, events, free_port
from tests.support.paths import ROOT
from tests.support.runs import assert_faults_fired, resumed_from_last_commit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
HVD = str(Path(PYTHON).parent / "hvd-resilient")
DIGITS = str(ROOT / "examples" / "digits.py")
COMMON = ["--epochs", "6", "--checkpoint-every", "20", "--seed", "5"]


def launch(jobs, run: Path, *extra: str, env: dict | None = None):
    return jobs.start(
        [HVD, "run", "--launcher", "torchrun", "--np", "2", "--nnodes", "1:2",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-id", run.name,
         "--run-dir", str(run), *extra, "--", PYTHON, DIGITS, *COMMON],
        env=env, name=run.name,
    )


def test_torchrun_worker_killed_restarts_resumes_bit_identical_on_s3(tmp_path, jobs, s3_url,
                                                                     s3_server):
    jobs.extra_env.update(s3_server.env())
    ref = tmp_path / "ref"
    job = launch(jobs, ref)
    assert job.wait(240) == 0, job.output()[-3000:]
    ref_done = {e["params_sha256"] for e in events(ref / "events.jsonl") if e["event"] == "done"}
    assert len(ref_done) == 1

    run = tmp_path / "run"
    job = launch(jobs, run, "--checkpoint", f"{s3_url}/run",
                 env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=70"))
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    starts = [e for e in evs if e["event"] == "start" and e["rank"] >= 0]
    assert len(starts) == 4, "expected two rounds of two workers (one torchrun restart)"
    assert {e["backend"] for e in starts} == {"torchrun"}
    resume = resumed_from_last_commit(evs)  # not the durable checkpoint of step 60
    assert resume["from_step"] > 60
    assert not [e for e in evs if e["event"] == "restart"], "torchrun, not the supervisor, " \
        "should have restarted the workers"
    assert {e["params_sha256"] for e in evs if e["event"] == "done"} == ref_done


PROBE = """
import json, os, sys
out = os.path.join(os.environ["PROBE_DIR"], "rank" + os.environ["RANK"] + ".json")
preloaded = {m: m in sys.modules for m in ("torch._dynamo", "wave", "no_such_module_here")}

def load():  # imported only here: the agent reads it from the script, not from a run
    import wave  # noqa: F401
    import no_such_module_here  # noqa: F401

with open(out, "w") as fh:
    json.dump({"preloaded": preloaded, "argv": sys.argv,
               "main": __name__, "ppid": os.getppid()}, fh)
"""


@pytest.mark.parametrize("fork", ["1", "0"])
def test_torchrun_warm_forks_workers_with_imports_done(tmp_path, jobs, fork):
    """Workers start with torch._dynamo and the script's own imports (a function's too; one
    that does not exist is skipped) already imported, forked from the agent, and see the
    script's arguments as `python script.py` would; with HVD_RESILIENT_TORCHRUN_FORK=0 they are
    plain new interpreters."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    job = jobs.start(
        [PYTHON, "-m", "hvd_resilient.launch.warm.torchrun", "--nnodes", "1",
         "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), "--x", "1"],
        env=jobs.env(PROBE_DIR=str(tmp_path), HVD_RESILIENT_TORCHRUN_FORK=fork),
        name=f"warm-{fork}",
    )
    assert job.wait(120) == 0, job.output()[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for s in seen:
        warm = fork == "1"
        assert s["preloaded"] == {"torch._dynamo": warm, "wave": warm,
                                  "no_such_module_here": False}, s
        assert s["argv"] == [str(script), "--x", "1"], s
        assert s["main"] == "__main__", s
    if fork == "1":
        assert seen[0]["ppid"] == seen[1]["ppid"] == job.proc.pid, (seen, job.proc.pid)


RELEASE_PROBE = """
import atexit, os, sys, types
import torch.distributed as dist
from hvd_resilient.backends.torchrun.backend import TorchrunBackend

# Registered first, so it runs last of the exit hooks: what teardown will find.
atexit.register(lambda: os.write(1, f"groups at exit: {dist.is_initialized()}\\n".encode()))
backend = TorchrunBackend(heartbeat_timeout_s=float(sys.argv[1]))
backend.init()
events = types.SimpleNamespace(emit=lambda *a, **k: None)
state = types.SimpleNamespace(events=events, sync=lambda: None)
backend.run(lambda s: backend.any_rank(True), state)
assert dist.is_initialized(), "fit()'s caller may still run collectives"
"""


@pytest.mark.timeout(120)
def test_torchrun_a_finished_run_releases_its_process_groups_before_teardown(tmp_path, jobs):
    """Left to interpreter teardown, Gloo's threads can abort a finished worker ("terminate
    called without an active exception", exit -6): an FSDP job failed so in CI."""
    probe = tmp_path / "probe.py"
    probe.write_text(RELEASE_PROBE)
    torchrun = str(Path(PYTHON).parent / "torchrun")
    job = jobs.start([torchrun, "--standalone", "--nproc-per-node", "2", str(probe), "1.5"],
                     name="probe")
    assert job.wait(90) == 0, job.output()[-3000:]
    lines = [ln for ln in job.output().splitlines() if ln.startswith("groups at exit")]
    assert lines == ["groups at exit: False"] * 2, job.output()[-3000:]
