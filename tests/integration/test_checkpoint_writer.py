"""The async writer: training never blocks, the newest snapshot wins, failures are events,
and an S3 outage in the middle of a save costs one checkpoint, not the run."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch

from hvd_resilient.checkpoint import (
    AsyncCheckpointWriter,
    CheckpointManager,
    from_bytes,
    snapshot_state_dict,
    step_dir,
)
from hvd_resilient.checkpoint.stores import StoreError
from hvd_resilient.checkpoint.stores.file import FileStore
from hvd_resilient.checkpoint.stores.s3 import S3Store
from tests.support.checkpoints import Events

WAIT = 60  # seconds; every wait in these tests is bounded


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(8, 4)
    return {"model": model.state_dict(), "step": step, "extra": [torch.arange(3), "x"]}


class GatedStore(FileStore):
    """A real file store whose puts can be held at a gate, to make "upload in flight"
    a state the test controls instead of a timing accident."""

    def __init__(self, root: str) -> None:
        super().__init__(root, retries=0)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = 0

    def _put(self, key: str, data: memoryview) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT), "test never opened the gate"
        if self.fail_next:
            self.fail_next -= 1
            raise StoreError(f"{self.url}/{key}: injected failure\nsecond line")
        super()._put(key, data)


def test_submit_saves_in_background_and_reports(tmp_path) -> None:
    events = Events()
    mgr = CheckpointManager(FileStore(str(tmp_path)), keep_last=2)
    writer = AsyncCheckpointWriter(mgr, on_event=events)
    for step in (1, 2, 3):
        state = _state(step)
        writer.submit(step, 0, 2, {"state.pt": snapshot_state_dict(state)}, run_id="r",
                      stall_seconds=0.005)
        assert writer.wait(WAIT)
    assert writer.close(WAIT)
    saved = events.named("checkpoint_saved")
    assert [e["ckpt_step"] for e in saved] == [1, 2, 3]
    for e in saved:
        assert e["stall_seconds"] == 0.005 and e["bytes"] > 0 and e["seconds"] > 0
        assert e["url"] == f"file://{tmp_path}/{step_dir(e['ckpt_step'])}"
        assert set(e) >= {"serialize_seconds", "upload_seconds", "epoch"}
    assert [i.step for i in mgr.list()] == [2, 3]  # pruned after each save
    info, files = mgr.load_latest()
    loaded = from_bytes(files["state.pt"])
    want = _state(3)
    assert loaded["step"] == 3 and loaded["extra"][1] == "x"
    for k, v in want["model"].items():
        assert torch.equal(loaded["model"][k], v)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(4, 0, 1, {"state.pt": b"x"})


def test_newest_pending_snapshot_wins(tmp_path) -> None:
    events = Events()
    store = GatedStore(str(tmp_path))
    mgr = CheckpointManager(store, keep_last=0)
    writer = AsyncCheckpointWriter(mgr, on_event=events)
    store.gate.clear()
    writer.submit(1, 0, 1, {"state.pt": b"one"})
    assert store.entered.wait(WAIT)  # step 1 is uploading and held
    made = []

    def snapshot(step: int):
        def fn() -> dict:
            # By the time a new snapshot is made, the older pending one is already gone:
            # at most two snapshots (uploading + newest) are alive.
            made.append((step, [e["ckpt_step"] for e in events.named("checkpoint_superseded")]))
            return {"state.pt": f"state {step}".encode()}
        return fn

    writer.submit(2, 0, 1, snapshot(2))
    writer.submit(3, 0, 1, snapshot(3))
    assert writer.busy
    assert made == [(2, []), (3, [2])]
    assert events.named("checkpoint_superseded") == [{"ckpt_step": 2, "by_step": 3}]
    assert not events.named("checkpoint_skipped")  # corrupt ones only, at a resume
    store.gate.set()
    assert writer.close(WAIT)
    assert [e["ckpt_step"] for e in events.named("checkpoint_saved")] == [1, 3]
    assert [i.step for i in mgr.list()] == [1, 3]
    assert writer.superseded == 1


def test_failed_upload_is_an_event_not_an_exception(tmp_path) -> None:
    events = Events()
    store = GatedStore(str(tmp_path))
    store.fail_next = 1
    writer = AsyncCheckpointWriter(CheckpointManager(store), on_event=events)
    writer.submit(1, 0, 1, {"state.pt": b"x"})
    assert writer.wait(WAIT)
    writer.submit(2, 0, 1, {"state.pt": b"y"})
    assert writer.close(WAIT)
    failed = events.named("checkpoint_failed")
    assert len(failed) == 1 and failed[0]["ckpt_step"] == 1
    assert "injected failure" in failed[0]["error"] and "\n" not in failed[0]["error"]
    assert [e["ckpt_step"] for e in events.named("checkpoint_saved")] == [2]
    assert (writer.saved, writer.failed) == (1, 1)


def test_broken_event_sink_does_not_stop_the_writer(tmp_path) -> None:
    def sink(name: str, fields: dict) -> None:
        raise RuntimeError("sink down")

    writer = AsyncCheckpointWriter(CheckpointManager(str(tmp_path)), on_event=sink)
    writer.submit(1, 0, 1, {"state.pt": b"x"})
    writer.submit(2, 0, 1, {"state.pt": b"y"})
    assert writer.close(WAIT)
    assert writer.saved >= 1


def test_save_sync_supersedes_pending_and_waits_for_inflight(tmp_path) -> None:
    events = Events()
    store = GatedStore(str(tmp_path))
    mgr = CheckpointManager(store, keep_last=0)
    writer = AsyncCheckpointWriter(mgr, on_event=events)
    store.gate.clear()
    writer.submit(1, 0, 1, {"state.pt": b"one"})
    assert store.entered.wait(WAIT)
    writer.submit(2, 0, 1, {"state.pt": b"two"})
    result = []
    sync = threading.Thread(target=lambda: result.append(
        writer.save_sync(3, 1, 1, lambda: {"state.pt": b"three"}, timeout=WAIT)))
    sync.start()
    sync.join(0.3)
    assert sync.is_alive()  # held behind the in-flight upload of step 1
    store.gate.set()
    sync.join(WAIT)
    assert result and result[0].step == 3
    assert writer.close(WAIT)
    assert [e["ckpt_step"] for e in events.named("checkpoint_saved")] == [1, 3]
    assert [e["ckpt_step"] for e in events.named("checkpoint_superseded")] == [2]
    sync = events.named("checkpoint_saved")[1]
    assert sync["stall_seconds"] >= sync["seconds"]  # the caller waited for all of it


def test_s3_outage_during_a_save_then_recovery(s3_server, s3_url) -> None:
    """The server dies between two files of a checkpoint: that checkpoint fails (an event,
    no exception, nothing visible), training goes on, and after a restart saves work again."""
    events = Events()
    bucket, _, prefix = s3_url[len("s3://"):].partition("/")

    class StopsServerMidSave(S3Store):
        def _put(self, key: str, data: memoryview) -> None:
            super()._put(key, data)
            if key == f"{step_dir(2)}/a.bin":
                s3_server.stop()

    store = StopsServerMidSave(
        bucket, prefix, endpoint_url=s3_server.endpoint, retries=1, backoff_base=0.05,
        max_attempts=2, connect_timeout=2, read_timeout=10,
    )
    mgr = CheckpointManager(store, keep_last=3)
    writer = AsyncCheckpointWriter(mgr, on_event=events)
    try:
        writer.submit(1, 0, 1, {"a.bin": b"a1", "state.pt": b"s1" * 1000})
        assert writer.wait(WAIT)
        writer.submit(2, 0, 1, {"a.bin": b"a2", "state.pt": b"s2" * 1000})
        assert writer.wait(WAIT)
        failed = events.named("checkpoint_failed")
        assert [f["ckpt_step"] for f in failed] == [2]
        assert "cannot reach" in failed[0]["error"]
        assert s3_server.secret_key not in failed[0]["error"]
        assert not s3_server.running
        s3_server.start()
        writer.submit(3, 0, 1, {"a.bin": b"a3", "state.pt": b"s3" * 1000})
        assert writer.close(WAIT)
    finally:
        s3_server.start()
    assert [e["ckpt_step"] for e in events.named("checkpoint_saved")] == [1, 3]
    assert [i.step for i in mgr.list()] == [1, 3]
    assert mgr.scan().partial == {}  # the torn step-2 folder was pruned after step 3 saved
    info, files = CheckpointManager(s3_url).load_latest()
    assert info.step == 3 and files["state.pt"] == b"s3" * 1000


def test_snapshot_is_independent_of_training(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": 1}
    snap = snapshot_state_dict(state)
    assert isinstance(snap["model"], OrderedDict)
    assert snap["model"]._metadata == state["model"]._metadata
    assert snap["model"]["0.weight"] is snap["model"]["1.weight"]  # sharing kept
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(snap["model"]["0.weight"], model[0].weight)
    assert not snap["model"]["0.weight"].requires_grad
    assert snap["opt"]["param_groups"] == state["opt"]["param_groups"]
    assert snap["opt"]["param_groups"] is not state["opt"]["param_groups"]
