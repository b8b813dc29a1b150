"""File digests of durable checkpoints: new ones are xxh3-128, and the sha256 manifests that
users' stores hold (frozen below, byte for byte as the previous version wrote one) still load,
are verified with sha256, and a damaged file under either is refused and passed over."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import xxhash

from hvd_resilient.checkpoint import MANIFEST_NAME, CheckpointManager, FileEntry, step_dir
from hvd_resilient.checkpoint.cli import main as ckpt_main
from hvd_resilient.checkpoint.digest import (
    ALGORITHMS,
    DEFAULT,
    SHA256,
    XXH3_128,
    check_hex,
    hex_digest,
    new_hasher,
)
from hvd_resilient.checkpoint.manifest import (
    FORMAT,
    LEGACY_FORMAT,
    SHA256_FORMAT,
    CheckpointInfo,
    ManifestError,
    new_info,
)
from tests.support.checkpoints import Events

#: The files of the checkpoint below, and the manifest the version before xxh3-128 wrote for
#: them (``CheckpointManager.save(1, 0, 2, OLD_FILES, run_id="old", meta={"lr": 0.5})``).
OLD_FILES = {"state.pt": b"state before xxh3 " * 64, "extra/rank0.bin": bytes(range(16))}
OLD_MANIFEST = b"""{
 "created": 1796067319.5645022,
 "epoch": 0,
 "files": {
  "extra/rank0.bin": {
   "sha256": "be45cb2605bf36bebde684841a28f0fd43c69850a3dce5fedba69928ee3a8991",
   "size": 16
  },
  "state.pt": {
   "sha256": "70b8b071b7c16d990274bf9d28468808ef6d77fdd5ca0030c1bd85678a609ade",
   "size": 1152
  }
 },
 "format": "hvd_resilient.checkpoint/2",
 "layout": "replicated",
 "library_version": "0.1.0",
 "manifest_sha256": "9a1fde8a33b039dd1ed4cd95d113b670783f364073078c00494e5b01e070e6f4",
 "meta": {
  "lr": 0.5
 },
 "run_id": "old",
 "step": 1,
 "torch_version": "2.13.0+cpu",
 "world_size": 2
}
"""
NEW_FILES = {"state.pt": b"state after xxh3 " * 64}


def _ckpt_cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_main(list(argv), out=out, err=err)
    assert code in (0, 1), err.getvalue()
    return code, out.getvalue()


def _store_old_checkpoint(root: Path) -> None:
    folder = root / step_dir(1)
    for name, data in OLD_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / MANIFEST_NAME).write_bytes(OLD_MANIFEST)


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(data)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_hasher_by_name_is_the_library_hash(algorithm: str) -> None:
    data = bytes(range(256)) * 1000
    reference = {SHA256: hashlib.sha256(data).hexdigest(),
                 XXH3_128: xxhash.xxh3_128(data).hexdigest()}[algorithm]
    h = new_hasher(algorithm)
    for i in range(0, len(data), 4096):  # fed in pieces, as a download feeds it
        h.update(memoryview(data)[i:i + 4096])
    assert h.hexdigest() == reference == hex_digest(data, algorithm)
    assert check_hex(reference, algorithm) == reference
    with pytest.raises(ValueError, match=f"expected a {algorithm} hex digest"):
        check_hex(reference[:-1], algorithm)
    with pytest.raises(ValueError, match=f"expected a {algorithm} hex digest"):
        check_hex(reference.upper(), algorithm)


def test_unknown_algorithms_and_misfiled_digests_are_refused() -> None:
    assert DEFAULT == XXH3_128
    for fn in (new_hasher, lambda a: check_hex("00" * 16, a), lambda a: FileEntry(1, "0" * 32, a)):
        with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
            fn("md5")
    # An xxh3 digest filed as sha256 (the entry's default), or the other way round.
    with pytest.raises(ValueError, match="expected a sha256 hex digest"):
        FileEntry(1, hex_digest(b"x", XXH3_128))
    with pytest.raises(ValueError, match="expected a xxh3_128 hex digest"):
        FileEntry(1, hex_digest(b"x", SHA256), XXH3_128)


def test_the_written_format_is_the_oldest_that_holds_the_digests() -> None:
    xxh = {"state.pt": FileEntry(3, hex_digest(b"abc"), DEFAULT)}
    sha = {"state.pt": FileEntry(3, hex_digest(b"abc", SHA256), SHA256)}
    raw = new_info(1, 0, 1, xxh).to_json()
    doc = json.loads(raw)
    assert doc["format"] == FORMAT and doc["files"] == {
        "state.pt": {"size": 3, "xxh3_128": xxhash.xxh3_128(b"abc").hexdigest()}}
    assert CheckpointInfo.from_json(raw).files == xxh
    for legacy, fmt in ((False, SHA256_FORMAT), (True, LEGACY_FORMAT)):
        raw = new_info(1, 0, 1, sha).to_json(legacy=legacy)
        doc = json.loads(raw)
        assert doc["format"] == fmt and doc["files"] == {
            "state.pt": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}}
        assert CheckpointInfo.from_json(raw).files == sha
    with pytest.raises(ValueError, match="holds sha256 digests only"):
        new_info(1, 0, 1, xxh).to_json(legacy=True)


@pytest.mark.parametrize("entry", [
    {"size": 3},
    {"size": 3, "md5": "0" * 32},
    {"size": 3, "sha256": "0" * 64, "xxh3_128": "0" * 32},
    {"size": 3, "xxh3_128": "0" * 64},
])
def test_an_entry_without_exactly_one_valid_digest_is_refused(entry: dict) -> None:
    doc = json.loads(new_info(1, 0, 1, {}).to_json(legacy=True))
    doc["files"] = {"state.pt": entry}
    with pytest.raises(ManifestError, match="manifest field missing or malformed"):
        CheckpointInfo.from_json(json.dumps(doc).encode())


def test_a_manifest_of_the_previous_version_loads_and_verifies_with_sha256(
        tmp_path: Path) -> None:
    _store_old_checkpoint(tmp_path)
    url = tmp_path.as_uri()
    [old] = CheckpointManager(url).list()
    assert {n: (e.size, e.algorithm) for n, e in old.files.items()} == {
        n: (len(d), SHA256) for n, d in OLD_FILES.items()}
    assert (old.run_id, old.meta, old.world_size) == ("old", {"lr": 0.5}, 2)
    assert old.to_json() == OLD_MANIFEST  # re-serialized, byte for byte what it was
    assert CheckpointManager(url).verify(old) == []
    assert CheckpointManager(url).load_latest() == (old, OLD_FILES)
    assert _ckpt_cli("verify", url)[0] == 0
    shown = _ckpt_cli("show", url)[1]
    assert f"state.pt  1152 bytes  sha256 {hashlib.sha256(OLD_FILES['state.pt']).hexdigest()}" \
        in shown

    # This version's next checkpoint is xxh3-128; damaged, resume falls back to the old one.
    new = CheckpointManager(url).save(2, 0, 2, NEW_FILES)
    assert json.loads((tmp_path / step_dir(2) / MANIFEST_NAME).read_bytes())["format"] == FORMAT
    assert new.files["state.pt"].algorithm == XXH3_128
    _damage(tmp_path / step_dir(2) / "state.pt")
    events = Events()
    assert CheckpointManager(url, on_event=events).load_latest() == (old, OLD_FILES)
    assert [e["reason"] for e in events.named("checkpoint_skipped")] == [
        "state.pt xxh3_128 mismatch"]

    # A damaged file under the sha256 manifest is refused just the same.
    _damage(tmp_path / step_dir(1) / "extra" / "rank0.bin")
    events.clear()
    assert CheckpointManager(url).verify(old) == ["extra/rank0.bin sha256 mismatch"]
    assert CheckpointManager(url, on_event=events).load_latest() is None
    assert [e["reason"] for e in events.named("checkpoint_skipped")] == [
        "state.pt xxh3_128 mismatch", "extra/rank0.bin sha256 mismatch"]
    code, out = _ckpt_cli("verify", url)
    assert code == 1 and "BAD: extra/rank0.bin sha256 mismatch" in out
    assert "BAD: state.pt xxh3_128 mismatch" in out
