"""`hvd-resilient ckpt list URL` also lists the memory tier segments this host holds for runs
whose checkpoint_url is URL (real segments written by SegmentDir, manifests only read)."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
import torch

from hvd_resilient.checkpoint import CheckpointManager
from hvd_resilient.checkpoint.cli import main
from hvd_resilient.checkpoint.memory import SegmentDir
from hvd_resilient.checkpoint.memory.listing import held_segments, key_matches


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def key(run_id: str, url: str, scope: str = "") -> str:
    """The run key of memory_tier.MemoryCommits.run_key."""
    where = hashlib.sha256(url.encode()).hexdigest()[:8]
    return f"{run_id}.{where}" + (f".{scope}" if scope else "")


def commit(root: str, run_key: str, step: int, *, owner: str = "replicated",
           epoch: int = 0, world: int = 2) -> SegmentDir:
    seg = SegmentDir(str(root), run_key, owner)
    state = {"model": {"w": torch.arange(256, dtype=torch.float32) + step}, "step": step}
    seg.finish(seg.begin(step, state, {"epoch": epoch, "world_size": world}))
    return seg


def rows_after(out: str, title: str) -> list[list[str]]:
    lines = out.splitlines()
    start = lines.index(title)
    assert lines[start + 1].split()[:5] == ["STEP", "EPOCH", "WORLD", "CREATED", "(UTC)"]
    assert lines[start + 1].split()[6:] == ["OWNER", "RUN", "STATE"]
    return [line.split() for line in lines[start + 2:]]


@pytest.fixture
def url(tmp_path) -> str:
    return (tmp_path / "ck").as_uri()


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "shm")


def test_durable_and_memory_side_by_side(url, root, tmp_path) -> None:
    CheckpointManager(url).save(100, 1, 2, {"state.pt": b"a" * 1500}, run_id="r1")
    mine, scoped = key("r1", url), key("r1.x", url, "attempt-2")
    for step in (110, 120, 130):  # the writer keeps the two newest
        commit(root, mine, step, epoch=1)
    commit(root, scoped, 7, world=4)
    commit(root, key("r1", (tmp_path / "other").as_uri()), 999)  # another location
    commit(root, "r1", 998)  # no digest at all

    code, out, err = run("list", url, "--memory-dir", root)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "EPOCH", "WORLD"] and lines[0].endswith("STATE")
    assert lines[1].split()[:3] == ["100", "1", "2"] and "1.5 KB" in lines[1]
    assert lines[2] == ""
    rows = rows_after(out, f"memory tier on this host ({root}):")
    assert [(r[0], r[1], r[2], r[-5], r[-4]) for r in rows] == [  # by run key, then step
        ("120", "1", "2", "replicated", mine),
        ("130", "1", "2", "replicated", mine),
        ("7", "0", "4", "replicated", scoped)]
    assert all(r[-3:] == ["complete", "(not", "re-hashed)"] for r in rows)
    assert all(r[6] == "KB" for r in rows)  # one page of float32 and the index
    assert "999" not in out and "998" not in out

    code, out, err = run("list", url, "--memory-dir", root, "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["url"] == url and doc["memory_dir"] == root
    assert [(c["step"], c["state"]) for c in doc["checkpoints"]] == [
        (100, "complete (not re-hashed)")]
    mem = doc["memory"]
    assert [(m["run"], m["step"], m["owner"], m["epoch"], m["world_size"]) for m in mem] == [
        (mine, 120, "replicated", 1, 2), (mine, 130, "replicated", 1, 2),
        (scoped, 7, "replicated", 0, 4)]
    assert all(m["bytes"] > 1024 and m["created"] > 0 and m["host"] for m in mem)


def test_memory_only_location_lists_and_exits_0(tmp_path, root) -> None:
    """A job that died before its first durable checkpoint: nothing at URL, segments here."""
    url = (tmp_path / "never-written").as_uri()
    commit(root, key("r2", url), 5, owner="replicated")
    commit(root, key("r2", url), 5, owner="rank-1")
    code, out, err = run("list", url, "--memory-dir", root)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"no durable checkpoints at {url}"
    rows = rows_after(out, f"memory tier on this host ({root}):")
    assert [(r[0], r[-5]) for r in rows] == [("5", "rank-1"), ("5", "replicated")]
    assert not (tmp_path / "never-written").exists()  # list creates nothing

    code, out, _ = run("list", url, "--memory-dir", root, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["checkpoints"] == [] and len(doc["memory"]) == 2

    # the same location given as a path (the store's spelling, a file:// URL) matches too
    code, out, _ = run("list", str(tmp_path / "never-written"), "--memory-dir", root)
    assert code == 0 and key("r2", url) in out


def test_no_checkpoints_anywhere_is_still_an_error(tmp_path, root) -> None:
    url = (tmp_path / "nothing").as_uri()
    commit(root, key("r3", (tmp_path / "elsewhere").as_uri()), 1)
    for extra in ([], ["--json"]):
        code, out, err = run("list", url, "--memory-dir", root, *extra)
        assert (code, out) == (2, "")
        assert err == f"hvd-resilient ckpt list: error: no checkpoints at {url}\n"
    code, out, _ = run("list", url, "--memory-dir", str(tmp_path / "no-such-root"))
    assert code == 2 and out == ""


def test_none_for_this_location_and_default_root(url, memory_tier_dir) -> None:
    """Without --memory-dir the tier is $HVD_RESILIENT_MEMORY_TIER_DIR (set per test by
    conftest), exactly where the training config puts it."""
    CheckpointManager(url).save(3, 0, 1, {"state.pt": b"x"})
    code, out, _ = run("list", url)
    assert code == 0
    assert out.splitlines()[-1] == "memory tier on this host: none for this location"
    assert json.loads(run("list", url, "--json")[1])["memory"] == []

    commit(memory_tier_dir, key("r4", url), 8)
    code, out, _ = run("list", url)
    assert code == 0 and f"memory tier on this host ({memory_tier_dir}):" in out
    assert out.splitlines()[-1].split()[0] == "8"


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "empty"])
def test_corrupt_manifest_is_bad_not_a_traceback(url, root, damage) -> None:
    mine = key("r5", url)
    seg = commit(root, mine, 10)
    commit(root, mine, 11)
    manifest = seg.file(10, ".json")
    raw = open(manifest, "rb").read()
    if damage == "garbage":
        raw = b"\xff\x00 not json"
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "foreign":  # a whole, valid manifest of another step
        raw = open(seg.file(11, ".json"), "rb").read()
    else:
        raw = b""
    with open(manifest, "wb") as f:
        f.write(raw)
    os.remove(seg.file(10, ".data"))  # a listing never reads data files anyway

    code, out, err = run("list", url, "--memory-dir", root)
    assert (code, err) == (0, "") and "Traceback" not in out
    rows = rows_after(out, f"memory tier on this host ({root}):")
    assert rows[0][:6] == ["10", "-", "-", "-", "-", "replicated"]
    assert rows[0][6:8] == [mine, "bad:"]
    assert rows[1][0] == "11" and rows[1][-3:] == ["complete", "(not", "re-hashed)"]

    doc = json.loads(run("list", url, "--memory-dir", root, "--json")[1])
    bad = doc["memory"][0]
    assert (bad["step"], bad["state"]) == (10, "bad") and bad["reason"]
    assert doc["memory"][1]["state"] == "complete (not re-hashed)"


def test_held_segments_reads_manifests_only(url, root, tmp_path) -> None:
    mine = key("run.with.dots", url, "scope.too")
    seg = commit(root, mine, 4)
    os.makedirs(os.path.join(root, key("idle", url), "replicated"))  # lock only, no segment
    for suffix in (".data", ".index"):
        os.chmod(seg.file(4, suffix), 0)  # unreadable data: the listing does not care
    held = held_segments(url, root)
    assert list(held) == [mine]
    assert [i.step for i in held[mine].segments] == [4] and held[mine].bad == []
    assert held_segments((tmp_path / "x").as_uri(), root) == {}
    assert held_segments(url, str(tmp_path / "missing")) == {}
    digest = key("r", url).split(".")[1]
    assert key_matches(f"a.{digest}", [digest]) and key_matches(f"a.b.{digest}.s", [digest])
    assert not key_matches(digest, [digest])  # the first component is the run id
