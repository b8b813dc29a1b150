"""The survivors of a SIGKILL restore the same commit in place, so the verified sync after the
recovery finds nothing differing and sends nothing (docs/architecture.md, the in-place backend):
the job's own `sync_check` records say so. Before, `attributes` differed on every rank but 0 at
every such sync: the trainer's `last_loss` (each rank's loss of its own batch) was compared as
if it were shared state (state.core.RANK_LOCAL). The same on threads, in a second:
tests/unit/test_inplace_restore_agreement.py."""

from __future__ import annotations

import json

import pytest

from tests.support.jobs import PYTHON, events
from tests.support.paths import SCRIPTS
from tests.support.runs import assert_faults_fired

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(180)]


def test_the_sync_after_an_in_place_recovery_sends_nothing(tmp_path, jobs):
    run = tmp_path / "run"
    cmd = [PYTHON, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", "3", "--",
           PYTHON, str(SCRIPTS / "recipe_job.py"), "--recipe", "adamw-warmup-cosine",
           "--run-id", "inplace-restore-sync", "--run-dir", str(run), "--batch-size", "8",
           "--commit-every", "4", "--epochs", "1000", "--max-steps", "10",
           "--checkpoint-every", "1000", "--no-memory-tier-enabled"]
    # SIGKILL to rank 1 before its step 7: the survivors restore the commit of step 4
    job = jobs.start(cmd, env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=6"),
                     name="inplace-restore-sync")
    assert job.wait(150) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    restores = [e for e in evs if e["event"] == "restore"]
    assert sorted(e["rank"] for e in restores) == [0, 2], restores  # ranks of generation 0
    assert {(e["from_step"], e["to_step"]) for e in restores} == {(6, 4)}, restores
    checks = [e for e in evs if e["event"] == "sync_check"]
    assert [(e["size"], e["step"]) for e in checks] == [(3, 0), (2, 4)], checks
    after = checks[-1]
    assert (after["sent"], after["differing_ranks"], after["repaired"]) == ([], [], []), after
    done = {e["rank"]: e for e in evs if e["event"] == "done" and "digests" in e}
    assert sorted(done) == [0, 1], done
    assert len({json.dumps(d["digests"], sort_keys=True) for d in done.values()}) == 1, done
