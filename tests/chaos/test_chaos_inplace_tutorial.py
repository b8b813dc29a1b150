"""PyTorch's DDP tutorial script in place across hosts: `hvd-resilient run --launcher inplace
--hosts a:2,b:2,c:2` on 3 namespaced hosts with sshd, the script adapted only with the lines
docs/inplace-ddp.md tells a user to add (`pytorch_ddp_tutorial/inplace.patch`, after the CPU
patch), as `tests/integration/test_thirdparty_inplace.py` runs it on one machine.

A whole host's processes killed (its agent, its workers, the ssh session), then the host
holding rank 0 and the coordinating agent killed too: each time the survivors go on in the
processes they were launched as, re-plan the sampler for the smaller world, finish every epoch,
exit 0, and end with the same state (the adapter's `done` digests).
"""

from __future__ import annotations

import pytest

from tests.chaos.test_chaos_inplace import kill_once
from tests.support.jobs import PYTHON, VENV_BIN, events, wait_for
from tests.support.netns import Cluster
from tests.support.thirdparty import prepare

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]
EPOCHS = 40


def test_the_adapted_tutorial_loses_two_hosts_one_by_one_and_the_last_one_finishes(chaos):
    c: Cluster = chaos.cluster(3)
    script = prepare("pytorch_ddp_tutorial", chaos.tmp / "script", ("cpu.patch",
                                                                    "inplace.patch"))
    run = chaos.tmp / "run"
    hosts = ",".join(f"{h.addr}:2" for h in c.hosts)
    cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace", "--hosts", hosts,
           "--np", "6", "--ssh-port", str(c.port), "--run-id", "tutorial-hosts",
           "--run-dir", str(run), "--max-restarts", "0", "--",
           PYTHON, "multigpu_torchrun.py", str(EPOCHS), "1000"]
    job = chaos.jobs.start(cmd, env=c.env(chaos.jobs.env()), cwd=script, name="tutorial-hosts")
    log = run / "events.jsonl"

    def of(kind: str) -> list[dict]:
        return [e for e in events(log) if e["event"] == kind] if log.exists() else []

    wait_for(lambda: len(of("commit")) >= 3, 150, "three epochs committed", job)
    pids = {e["rank"]: e["pid"] for e in of("start")}
    assert sorted(pids) == list(range(6)), pids
    assert c.host_of_pid(pids[0]) == c.hosts[0]
    last = set(c.pids(c.hosts[2])) & set(pids.values())
    kill_once(c, c.hosts[1])
    wait_for(lambda: any(e["size"] == 4 for e in of("commit")), 60, "an epoch at 4", job)
    kill_once(c, c.hosts[0])  # rank 0, the coordinating agent, the generation's store
    assert job.wait(240) == 0, job.output()[-4000:]

    evs = events(log)
    assert len([e for e in evs if e["event"] == "start"]) == 6, "a worker was (re)started"
    resets = [e["new_size"] for e in evs if e["event"] == "reset" and e["rank"] == 0]
    assert resets == [4, 2], resets  # rank 0's: each generation once
    done = {e["rank"]: e for e in evs if e["event"] == "done"}
    assert sorted(done) == [0, 1] and done[0]["digests"] == done[1]["digests"], done
    assert len(last) == 2 and {e["pid"] for e in evs if e["event"] == "first_step"} >= last
    assert len({e["step"] for e in evs if e["event"] == "commit"}) >= EPOCHS, "an epoch lost"
    out = job.output()
    assert "host 2 coordinates from generation" in out, out[-4000:]
    assert out.count("Epoch 39 |") == 2 and "Steps: 32" in out, out[-3000:]  # 2048 / 2 / 32
