"""The checkpoint manager's two other jobs in modules of their own: the reader (list, verify,
load; usable alone by tools that never write) and supersede; the fault hook between a
checkpoint's files and its manifest, handed to the manager as a plain callback."""

from __future__ import annotations

import pytest

from hvd_resilient.checkpoint import CheckpointManager, CheckpointReader, step_dir
from hvd_resilient.checkpoint.reader import ScanResult
from hvd_resilient.training.fault_hooks import before_publish
from hvd_resilient.training.faults import FaultPlan, InjectedFault
from tests.support.checkpoints import Events, flip_byte


def _files(step: int) -> dict[str, bytes]:
    return {"state.pt": f"state of step {step}".encode() * 40}


def test_a_reader_lists_verifies_and_loads_what_a_manager_saved(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path.as_uri(), keep_last=0)
    for step in (10, 20):
        mgr.save(step, 0, 2, _files(step))
    flip_byte(mgr, f"{step_dir(20)}/state.pt")
    events = Events()
    reader = CheckpointReader(tmp_path.as_uri(), on_event=events)
    assert [i.step for i in reader.list()] == [10, 20]
    assert isinstance(reader.scan(), ScanResult)
    assert reader.verify(reader.latest()) == ["state.pt xxh3_128 mismatch"]  # type: ignore[arg-type]
    info, files = reader.load_latest()  # type: ignore[misc]
    assert info.step == 10 and bytes(files["state.pt"]) == _files(10)["state.pt"]
    assert [f["ckpt_step"] for f in events.named("checkpoint_skipped")] == [20]
    assert not hasattr(reader, "save") and not hasattr(reader, "prune")


def test_supersede_moves_through_the_manager(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path.as_uri())
    mgr.save(5, 0, 1, _files(5))
    assert mgr.supersede("old") == [5]
    assert mgr.list() == []
    assert [i.step for i in CheckpointManager(f"{tmp_path.as_uri()}/old").list()] == [5]


def test_no_fault_hook_without_an_upload_fault(tmp_path) -> None:
    assert before_publish(None, 0) is None
    assert before_publish(FaultPlan.parse("raise:rank=0:step=2", str(tmp_path)), 0) is None


def test_an_upload_fault_fires_between_the_files_and_the_manifest(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    plan = FaultPlan.parse("raise:rank=0:step=2:at=upload", str(run))
    store = (tmp_path / "ckpt").as_uri()
    mgr = CheckpointManager(store, before_publish=before_publish(plan, 0))
    mgr.save(1, 0, 1, _files(1))
    with pytest.raises(InjectedFault):
        mgr.save(2, 0, 1, _files(2))
    scan = mgr.scan()
    assert [i.step for i in scan.checkpoints] == [1] and list(scan.partial) == [2]
    mgr.save(2, 0, 1, _files(2))  # once per run: the torn attempt is written again
    assert [i.step for i in mgr.list()] == [1, 2]
    other = CheckpointManager(store, before_publish=before_publish(
        FaultPlan.parse("raise:rank=0:step=3:at=upload", str(run)), 1))
    other.save(3, 0, 1, _files(3))  # another rank's fault: not this process's
