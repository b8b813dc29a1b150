"""The manifest checks itself: every single-bit flip of a manifest the manager writes is
refused, by `hvd-resilient ckpt verify` AND by resume, and the two always agree, also on the
older manifests (format /1, no checksum) that users' stores still hold."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
from pathlib import Path

import pytest
import torch

from hvd_resilient.checkpoint import (
    MANIFEST_NAME,
    CheckpointInfo,
    CheckpointManager,
    FileEntry,
    step_dir,
)
from hvd_resilient.checkpoint.cli import main as ckpt_main
from hvd_resilient.checkpoint.digest import DEFAULT, hex_digest
from hvd_resilient.checkpoint.manifest import (
    CHECKSUM_FIELD,
    FORMAT,
    LEGACY_FORMAT,
    SHA256_FORMAT,
    ManifestError,
)
from hvd_resilient.checkpoint.serialize import to_buffer
from hvd_resilient.checkpoint.split import decode_file, join_state, part_name, split_state

STEP = 5


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    return {"model": model.state_dict(), "counters": {"step": STEP}}


def _save(url: str) -> tuple[CheckpointManager, CheckpointInfo]:
    """A real checkpoint, written the way the trainer writes one (parts + index)."""
    files = split_state(_state(), part_bytes=1024)
    assert part_name(1) in files, "the test needs a state split over several parts"
    blobs = {n: v if isinstance(v, bytes | bytearray | memoryview) else to_buffer(v)
             for n, v in files.items()}
    mgr = CheckpointManager(url)
    return mgr, mgr.save(STEP, 1, 2, blobs, run_id="flips", meta={"lr": 1e-05})


def _as_written_before_xxh3(info: CheckpointInfo, folder: Path) -> CheckpointInfo:
    """``info`` with the sha256 entries that versions before xxh3-128 recorded (the only
    digest a format /1 manifest holds)."""
    return dataclasses.replace(info, files={
        name: FileEntry(e.size, hashlib.sha256((folder / name).read_bytes()).hexdigest())
        for name, e in info.files.items()})


def verify_ok(url: str) -> bool:
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_main(["verify", url], out=out, err=err)
    assert code in (0, 1), err.getvalue()  # a verdict, never a crash or a store error
    return code == 0


def resumes(url: str) -> bool:
    """What a resume does with the store: the newest checkpoint that verifies, decoded and
    joined into a state (None: start from scratch)."""
    found = CheckpointManager(url).load_latest(decode=decode_file)
    if found is None:
        return False
    info, files = found
    state = join_state(files)
    assert info.step == STEP and state["counters"]["step"] == STEP
    assert torch.equal(state["model"]["0.weight"], _state()["model"]["0.weight"])
    return True


def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


@pytest.mark.parametrize("before_xxh3", [False, True], ids=["xxh3_128", "sha256"])
def test_every_single_bit_flip_of_a_manifest_is_refused(tmp_path: Path, before_xxh3: bool) -> None:
    url = f"file://{tmp_path}/ckpt"
    _, info = _save(url)
    path = tmp_path / "ckpt" / step_dir(STEP) / MANIFEST_NAME
    if before_xxh3:  # what versions before xxh3-128 wrote, still in users' stores
        path.write_bytes(_as_written_before_xxh3(info, path.parent).to_json())
    good = path.read_bytes()
    doc = json.loads(good)
    assert doc["format"] == (SHA256_FORMAT if before_xxh3 else FORMAT)
    assert len(doc[CHECKSUM_FIELD]) == 64
    assert verify_ok(url) and resumes(url)
    accepted = []
    for bit in range(len(good) * 8):
        path.write_bytes(_flip(good, bit))
        if verify_ok(url) or resumes(url):
            accepted.append(bit)
    assert accepted == [], [(b // 8, good[b // 8:b // 8 + 1]) for b in accepted[:10]]
    path.write_bytes(good)
    assert verify_ok(url) and resumes(url)


def test_legacy_manifests_still_load_and_verify_agrees_with_resume(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    _, info = _save(url)
    path = tmp_path / "ckpt" / step_dir(STEP) / MANIFEST_NAME
    # what versions before the checksum wrote
    legacy = _as_written_before_xxh3(info, path.parent).to_json(legacy=True)
    assert json.loads(legacy)["format"] == LEGACY_FORMAT and CHECKSUM_FIELD.encode() not in legacy
    path.write_bytes(legacy)
    assert verify_ok(url) and resumes(url)
    verdicts = set()
    for bit in random.Random(7).sample(range(len(legacy) * 8), 200):
        path.write_bytes(_flip(legacy, bit))
        v, r = verify_ok(url), resumes(url)
        assert v == r, f"bit {bit} (byte {legacy[bit // 8:bit // 8 + 1]!r}): verify {v}, resume {r}"
        verdicts.add(v)
    assert verdicts == {True, False}  # some flips are harmless in a legacy manifest, not all


def test_a_duplicated_file_name_is_refused_by_both(tmp_path: Path) -> None:
    """The review's case: a flip that turns one file name into another's (JSON would keep the
    last) made `verify` say ok while resume failed with "checkpoint lacks state-00000.bin"."""
    url = f"file://{tmp_path}/ckpt"
    _, info = _save(url)
    path = tmp_path / "ckpt" / step_dir(STEP) / MANIFEST_NAME
    legacy = _as_written_before_xxh3(info, path.parent).to_json(legacy=True)
    first, second = f'"{part_name(0)}"'.encode(), f'"{part_name(1)}"'.encode()
    assert legacy.count(first) == 1 and legacy.count(second) == 1
    path.write_bytes(legacy.replace(first, second))
    with pytest.raises(ManifestError, match=f"repeats the key '{part_name(1)}'"):
        CheckpointInfo.from_json(path.read_bytes())
    assert not verify_ok(url) and not resumes(url)


def test_a_new_manifest_without_or_with_a_moved_checksum_is_refused() -> None:
    info = CheckpointInfo(step=1, epoch=0, world_size=1, prefix=step_dir(1),
                          files={"state.pt": FileEntry(3, hex_digest(b"abc"), DEFAULT)})
    raw = info.to_json()
    assert CheckpointInfo.from_json(raw, prefix=step_dir(1)) == info
    doc = json.loads(raw)
    del doc[CHECKSUM_FIELD]
    with pytest.raises(ManifestError, match=f"lacks a valid {CHECKSUM_FIELD}"):
        CheckpointInfo.from_json(json.dumps(doc).encode())
    # The same content, serialized otherwise (same JSON value, other bytes): refused.
    with pytest.raises(ManifestError, match="checksum mismatch"):
        CheckpointInfo.from_json(json.dumps(json.loads(raw), indent=2, sort_keys=True).encode())
    # A checksum in an old-format manifest is checked too.
    assert json.loads(raw)["format"] == FORMAT
    for older in (SHA256_FORMAT, LEGACY_FORMAT):
        with pytest.raises(ManifestError, match="checksum mismatch"):
            CheckpointInfo.from_json(raw.replace(FORMAT.encode(), older.encode()))
    with pytest.raises(ManifestError, match="newer"):
        CheckpointInfo.from_json(raw.replace(FORMAT.encode(), b"hvd_resilient.checkpoint/4"))
