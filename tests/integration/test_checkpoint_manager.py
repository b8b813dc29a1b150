"""Manifests and the checkpoint manager on real storage: round trips, corruption and torn
checkpoints are skipped (never loaded), retention keeps what it promises."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import xxhash

from hvd_resilient.checkpoint import (
    MANIFEST_NAME,
    CheckpointCorruptError,
    CheckpointInfo,
    CheckpointManager,
    FileEntry,
    step_dir,
)
from hvd_resilient.checkpoint.errors import CheckpointExistsError
from hvd_resilient.checkpoint.manifest import FORMAT, SHA256_FORMAT, ManifestError, new_info
from tests.support.checkpoints import Events, flip_byte
from tests.support.paths import ROOT

MiB = 1 << 20


def _files(step: int) -> dict[str, bytes]:
    return {
        "state.pt": f"state of step {step}".encode() * 100,
        "extra/rank0.bin": bytes([step % 256]) * 10,
    }


def test_save_list_load_roundtrip(url: str) -> None:
    mgr = CheckpointManager(url)
    assert mgr.list() == [] and mgr.load_latest() is None
    info = mgr.save(7, epoch=1, world_size=4, files=_files(7), run_id="run-a", meta={"lr": 0.1})
    mgr.save(12, epoch=2, world_size=3, files=_files(12))
    found = CheckpointManager(url).list()  # a fresh process sees the same
    assert [i.step for i in found] == [7, 12]
    got = found[0]
    assert (got.step, got.epoch, got.world_size) == (7, 1, 4)
    assert (got.run_id, got.meta) == ("run-a", {"lr": 0.1})
    assert got.files == info.files and got.total_bytes == sum(map(len, _files(7).values()))
    assert got.library_version == "0.1.0" and got.torch_version.startswith("2.")
    assert got.created > 0 and got.url == f"{url}/{step_dir(7)}"
    latest, files = CheckpointManager(url).load_latest()
    assert latest.step == 12 and files == _files(12)
    assert CheckpointManager(url).load(found[0]) == _files(7)
    assert CheckpointManager(url).verify(found[0]) == []


def test_manifest_is_written_last_and_describes_files(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path))
    order: list[str] = []
    real_put, real_put_new = mgr.store.put, mgr.store.put_new
    mgr.store.put = lambda key, data: (order.append(key), real_put(key, data))[1]  # type: ignore[method-assign]
    mgr.store.put_new = lambda key, data: (order.append(key), real_put_new(key, data))[1]  # type: ignore[method-assign]
    mgr.save(3, 0, 1, _files(3))
    assert order[-1] == f"{step_dir(3)}/{MANIFEST_NAME}" and len(order) == 3
    doc = json.loads((tmp_path / step_dir(3) / MANIFEST_NAME).read_text())
    assert set(doc) >= {"step", "epoch", "world_size", "run_id", "created", "files",
                        "library_version", "torch_version", "meta"}
    assert doc["format"] == FORMAT
    assert doc["files"] == {name: {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
                            for name, data in _files(3).items()}


def test_flipped_byte_is_detected_and_skipped(url: str, caplog: pytest.LogCaptureFixture) -> None:
    events = Events()
    mgr = CheckpointManager(url, on_event=events)
    mgr.save(1, 0, 2, _files(1))
    bad = mgr.save(2, 0, 2, _files(2))
    flip_byte(mgr, bad.key("state.pt"))
    fresh = CheckpointManager(url, on_event=events)
    assert fresh.verify(bad) == ["state.pt xxh3_128 mismatch"]
    with pytest.raises(CheckpointCorruptError, match="state.pt xxh3_128 mismatch"):
        fresh.load(bad)
    caplog.set_level(logging.WARNING)
    info, files = fresh.load_latest()
    assert info.step == 1 and files == _files(1)
    assert events.named("checkpoint_skipped") == [{
        "ckpt_step": 2, "reason": "state.pt xxh3_128 mismatch", "url": f"{url}/{step_dir(2)}",
    }]
    assert ("checkpoint step-0000000002 is corrupt (state.pt xxh3_128 mismatch); "
            "falling back to an older one") in caplog.text


def test_truncated_file_is_detected_and_skipped(url: str) -> None:
    events = Events()
    mgr = CheckpointManager(url, on_event=events)
    mgr.save(1, 0, 1, _files(1))
    bad = mgr.save(2, 0, 1, _files(2))
    size = bad.files["state.pt"].size
    mgr.store.put(bad.key("state.pt"), _files(2)["state.pt"][:-1])  # an upload cut short
    problem = f"state.pt size differs from the manifest's {size} bytes"
    assert CheckpointManager(url).verify(bad) == [problem]
    info, files = CheckpointManager(url, on_event=events).load_latest()
    assert info.step == 1 and files == _files(1)
    assert [e["reason"] for e in events.named("checkpoint_skipped")] == [problem]


def _save_as_before_xxh3(mgr: CheckpointManager, step: int, files: dict[str, bytes]) -> None:
    """A checkpoint as versions before xxh3-128 wrote it: sha256 entries, format /2."""
    entries = {n: FileEntry(len(d), hashlib.sha256(d).hexdigest()) for n, d in files.items()}
    raw = new_info(step, 0, 1, entries).to_json()
    assert json.loads(raw)["format"] == SHA256_FORMAT and b"xxh3" not in raw
    for name, data in files.items():
        mgr.store.put(f"{step_dir(step)}/{name}", data)
    mgr.store.put(f"{step_dir(step)}/{MANIFEST_NAME}", raw)


def test_sha256_manifests_still_verify_and_reject_a_corrupt_file(url: str) -> None:
    events = Events()
    mgr = CheckpointManager(url, on_event=events)
    _save_as_before_xxh3(mgr, 1, _files(1))
    _save_as_before_xxh3(mgr, 2, _files(2))
    old = mgr.list()
    assert [e.algorithm for i in old for e in i.files.values()] == ["sha256"] * 4
    assert [CheckpointManager(url).verify(i) for i in old] == [[], []]
    assert CheckpointManager(url).load_latest()[1] == _files(2)
    flip_byte(mgr, old[1].key("state.pt"))
    assert CheckpointManager(url).verify(old[1]) == ["state.pt sha256 mismatch"]
    with pytest.raises(CheckpointCorruptError, match="state.pt sha256 mismatch"):
        CheckpointManager(url).load(old[1])
    info, files = CheckpointManager(url, on_event=events).load_latest()
    assert info.step == 1 and files == _files(1)
    assert [e["reason"] for e in events.named("checkpoint_skipped")] == [
        "state.pt sha256 mismatch"]


def test_missing_file_and_bad_manifest_are_skipped(url: str) -> None:
    events = Events()
    mgr = CheckpointManager(url, on_event=events)
    mgr.save(1, 0, 1, _files(1))
    mgr.save(2, 0, 1, _files(2))
    mgr.save(3, 0, 1, _files(3))
    mgr.store.delete([f"{step_dir(3)}/extra/rank0.bin"])
    mgr.store.put(f"{step_dir(2)}/{MANIFEST_NAME}", b"{not json")
    assert [i.step for i in mgr.list()] == [1, 3]
    assert CheckpointManager(url).verify(mgr.list()[1]) == ["extra/rank0.bin missing"]
    info, _ = CheckpointManager(url, on_event=events).load_latest()
    assert info.step == 1
    reasons = {f["ckpt_step"]: f["reason"] for f in events.named("checkpoint_skipped")}
    assert reasons[3] == "extra/rank0.bin missing"
    assert reasons[2].startswith("unreadable manifest")


def test_partial_checkpoint_is_invisible(url: str) -> None:
    mgr = CheckpointManager(url)
    mgr.save(5, 0, 1, _files(5))
    # A writer killed after its files but before its manifest.
    for name, data in _files(9).items():
        mgr.store.put(f"{step_dir(9)}/{name}", data)
    assert [i.step for i in mgr.list()] == [5]
    scan = mgr.scan()
    assert set(scan.partial) == {9}
    info, files = mgr.load_latest()
    assert info.step == 5 and files == _files(5)


def test_resave_of_a_published_step_is_refused(tmp_path: Path) -> None:
    """Write-once (more in test_checkpoint_write_once.py): the old checkpoint stays whole."""
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(4, 0, 1, {"state.pt": b"old" * 10})
    with pytest.raises(CheckpointExistsError, match="step 4"):
        mgr.save(4, 1, 1, {"state.pt": b"new" * 20})
    info, files = mgr.load_latest()
    assert info.epoch == 0 and files == {"state.pt": b"old" * 10}


def test_save_validates_arguments(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path))
    with pytest.raises(ValueError, match="at least one file"):
        mgr.save(1, 0, 1, {})
    with pytest.raises(ValueError, match="reserved"):
        mgr.save(1, 0, 1, {MANIFEST_NAME: b"x"})
    with pytest.raises(ValueError, match="JSON-serializable"):
        mgr.save(1, 0, 1, {"a": b"x"}, meta={"obj": object()})
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=-1)
    with pytest.raises(ManifestError):
        CheckpointInfo.from_json(b'{"format": "other"}')


# ---- retention -------------------------------------------------------------------------------


def test_retention_keeps_last_k_and_every_mth(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep_last=3, keep_every=40)
    for step in range(10, 101, 10):
        mgr.save(step, 0, 1, _files(step))
    assert mgr.prune(dry_run=True) == [10, 20, 30, 50, 60, 70]
    assert mgr.prune() == [10, 20, 30, 50, 60, 70]
    assert [i.step for i in mgr.list()] == [40, 80, 90, 100]
    assert sorted(os.listdir(tmp_path)) == [step_dir(s) for s in (40, 80, 90, 100)]
    assert mgr.prune() == []
    everything = CheckpointManager(str(tmp_path), keep_last=0)
    assert everything.prune() == []


def test_prune_never_removes_newest_verified(url: str) -> None:
    mgr = CheckpointManager(url, keep_last=1)
    for step in (1, 2, 3, 4):
        mgr.save(step, 0, 1, _files(step))
    flip_byte(mgr, f"{step_dir(4)}/state.pt")  # newest is rotten
    for name, data in _files(0).items():  # an old torn folder: garbage
        mgr.store.put(f"{step_dir(0)}/{name}", data)
    for name, data in _files(9).items():  # a newer torn one: maybe still uploading
        mgr.store.put(f"{step_dir(9)}/{name}", data)
    fresh = CheckpointManager(url, keep_last=1)  # knows nothing: must re-hash
    assert fresh.prune() == [0, 1, 2]
    assert [i.step for i in fresh.list()] == [3, 4]
    assert set(fresh.scan().partial) == {9}
    info, _ = fresh.load_latest()
    assert info.step == 3
    # Once a newer good checkpoint exists, the rotten one and the older torn one go.
    fresh.save(10, 0, 1, _files(10))
    assert fresh.prune() == [3, 4, 9]
    assert [i.step for i in fresh.list()] == [10]
    assert fresh.store.list() == sorted(f"{step_dir(10)}/{n}" for n in [*_files(10), MANIFEST_NAME])


# ---- a writer SIGKILLed mid-upload --------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    from hvd_resilient.checkpoint import CheckpointManager

    mgr = CheckpointManager(sys.argv[1], part_size=5 * 2**20, threads=2)
    client = mgr.store.client
    real_upload_part = client.upload_part
    calls = []

    def upload_part(**kw):
        calls.append(kw["PartNumber"])
        if len(calls) == 2:  # the 2nd part: tell the parent, then hang until killed
            print("MID-UPLOAD", flush=True)
            sys.stdin.read()
        return real_upload_part(**kw)

    client.upload_part = upload_part
    files = {"a.bin": b"a" * 1000, "state.pt": bytes(24 * 2**20)}
    mgr.save(20, 2, 2, files)
    print("FINISHED", flush=True)
""")


def test_writer_killed_mid_upload_leaves_no_checkpoint(s3_url: str, tmp_path: Path) -> None:
    mgr = CheckpointManager(s3_url)
    mgr.save(10, 1, 2, _files(10))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen(
        [sys.executable, str(script), s3_url], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=60), "child never reached the middle of its upload"
        line = proc.stdout.readline().decode().strip()
        assert line == "MID-UPLOAD", (line, proc.stderr.read().decode()[-2000:])
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()
    fresh = CheckpointManager(s3_url)
    assert [i.step for i in fresh.list()] == [10]
    assert fresh.scan().partial == {20: [f"{step_dir(20)}/a.bin"]}  # state.pt never completed
    info, files = fresh.load_latest()
    assert info.step == 10 and files == _files(10)
