"""The memory tier (``hvd_resilient.checkpoint.memory``) without launcher processes: commits
kept in /dev/shm round-trip exactly, the newest complete one is never torn (not by recycling,
not by a writer dying mid-segment), every corruption is refused with one line, the cap is
enforced before anything changes, and peers fetch segments over HTTP, verified."""

from __future__ import annotations

import http.client
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hvd_resilient.checkpoint.memory import (
    SegmentDir,
    SegmentError,
    SegmentInfo,
    TierFull,
    segments,
)
from hvd_resilient.checkpoint.memory.peers import SegmentServer, fetch
from hvd_resilient.checkpoint.memory.segments import check_name, stem, tree_bytes
from hvd_resilient.checkpoint.split import join_state

RUN, OWNER = "run-1", "replicated"
META = {"epoch": 3, "world_size": 4}


class _TiedLM(torch.nn.Module):
    """Small model whose output layer shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(40, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 40, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(x))))


def _state(seed: int = 0) -> dict[str, Any]:
    """Model + Adam state after one optimizer step (so exp_avg etc. exist)."""
    torch.manual_seed(seed)
    model = _TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randint(0, 40, (4, 8))).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "counters": {"step": seed, "name": f"s{seed}"}}


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def _write(d: SegmentDir, step: int, state: Any, meta: dict[str, Any] | None = None
           ) -> SegmentInfo:
    return d.finish(d.begin(step, state, dict(META if meta is None else meta)))


def _load(d: SegmentDir, step: int) -> Any:
    return join_state(d.read(step)[1])


def _names(*steps: int) -> list[str]:
    return sorted(stem(s) + suffix for s in steps for suffix in (".data", ".index", ".json"))


def _snapshot(root: str) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root``: (inode, contents)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = (os.stat(p).st_ino, Path(p).read_bytes())
    return out


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# -- segments -------------------------------------------------------------------------------

@pytest.fixture(params=["one-piece", "many-pieces"])
def read_pieces(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """read() as small states take it (one read) and as big ones do (pieces of the file on
    several threads); pieces of one page make every test state many pieces."""
    from hvd_resilient.checkpoint.memory import segments

    if request.param == "many-pieces":
        monkeypatch.setattr(segments, "READ_PIECE", segments.ALIGN)
        monkeypatch.setattr(segments, "_read_threads", lambda: 3)
    return request.param


def test_round_trip_keeps_every_tensor_and_tied_weights(memory_tier_dir: str,
                                                        read_pieces: str) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    state = _state(7)
    info = _write(d, 7, state, {"epoch": 2, "world_size": 4, "note": "x"})

    assert d.steps() == [7]
    assert sorted(os.listdir(d.path)) == _names(7)
    assert (info.step, info.epoch, info.world_size, info.run_id, info.owner, info.meta) == (
        7, 2, 4, RUN, OWNER, {"note": "x"})
    assert len(info.parts) >= 2  # model and optimizer are separate parts
    assert d.info(7) == info

    got_info, files = d.read(7)
    assert got_info == info
    restored = join_state(files)
    _assert_same(restored, state)
    assert restored["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0  # after a real step
    model = restored["model"]
    assert model["emb.weight"].data_ptr() == model["out.weight"].data_ptr()
    fresh = _TiedLM()
    fresh.load_state_dict(model)
    assert fresh.out.weight is fresh.emb.weight

    # read() copies into process memory: recycling the segment's file later changes nothing
    for step in (8, 9, 10):
        _write(d, step, _state(step))
    assert 7 not in d.steps()
    _assert_same(restored, state)


def test_at_most_two_segments_and_the_oldest_data_file_is_recycled(memory_tier_dir: str
                                                                    ) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    states = {}
    for step in range(1, 9):
        states[step] = _state(step)
        held = None
        if step >= 3:  # the data file that this step must recycle, held open to pin its inode
            held = os.open(d.file(step - 2, ".data"), os.O_RDONLY)
        try:
            pending = d.begin(step, states[step], dict(META))
            if step >= 3:
                # mid-write only the newest complete segment is published, and it verifies
                assert d.steps() == [step - 1]
                _assert_same(_load(d, step - 1), states[step - 1])
            d.finish(pending)
            if held is not None:
                assert os.path.samestat(os.fstat(held), os.stat(d.file(step, ".data")))
        finally:
            if held is not None:
                os.close(held)
        live = [step, step - 1] if step > 1 else [1]
        assert d.steps() == live
        assert sorted(os.listdir(d.path)) == _names(*live)
        _assert_same(_load(d, step), states[step])
        if step > 1:
            assert not os.path.samestat(os.stat(d.file(step, ".data")),
                                        os.stat(d.file(step - 1, ".data")))
        states.pop(step - 2, None)


def test_a_writer_that_dies_between_begin_and_finish_leaves_the_newest_intact(
        memory_tier_dir: str) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    s1, s2 = _state(1), _state(2)
    _write(d, 1, s1)
    _write(d, 2, s2)
    pending = d.begin(3, _state(3), dict(META))
    del pending  # the writer dies here: finish never runs

    assert d.steps() == [2]
    _assert_same(_load(d, 2), s2)
    with pytest.raises(SegmentError, match="step 1"):
        d.read(1)  # recycled: its manifest went first
    assert "step-0000000003.data.tmp" in os.listdir(d.path)

    new = SegmentDir(memory_tier_dir, RUN, OWNER)  # the next writer
    new.sweep()
    assert sorted(os.listdir(d.path)) == _names(2)
    s3 = _state(3)
    _write(new, 3, s3)
    assert new.steps() == [3, 2]
    _assert_same(_load(new, 3), s3)
    _assert_same(_load(new, 2), s2)


def test_a_writer_that_dies_before_the_manifest_leaves_orphans_that_sweep_removes(
        memory_tier_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    s2 = _state(2)
    _write(d, 1, _state(1))
    _write(d, 2, s2)
    real = segments._write_new

    def dies_at_manifest(path: str, data: Any) -> None:
        if path.endswith(".json"):
            raise KeyboardInterrupt  # killed between data/index and the manifest
        real(path, data)

    monkeypatch.setattr(segments, "_write_new", dies_at_manifest)
    pending = d.begin(3, _state(3), dict(META))
    with pytest.raises(KeyboardInterrupt):
        d.finish(pending)
    monkeypatch.setattr(segments, "_write_new", real)

    assert d.steps() == [2]
    _assert_same(_load(d, 2), s2)
    left = set(os.listdir(d.path))
    assert {"step-0000000003.data", "step-0000000003.index"} <= left  # orphans, no manifest
    Path(d.path, "step-0000000004.json.tmp").write_bytes(b"{")  # a half-written manifest

    SegmentDir(memory_tier_dir, RUN, OWNER).sweep()
    assert sorted(os.listdir(d.path)) == _names(2)
    _assert_same(_load(d, 2), s2)


def _corrupt_json_field(d: SegmentDir, step: int) -> None:
    """A flip inside the manifest that keeps it valid JSON: only its own digest notices."""
    path = d.file(step, ".json")
    raw = Path(path).read_bytes()
    at = raw.index(d.info(step).index_digest.encode())
    c = raw[at:at + 1]
    Path(path).write_bytes(raw[:at] + (b"0" if c != b"0" else b"1") + raw[at + 1:])


@pytest.mark.parametrize(("case", "message"), [
    ("data-first-part", "part 0 digest mismatch"),
    ("data-last-part", "digest mismatch"),
    ("index", "index digest mismatch"),
    ("json-value", "manifest digest does not match"),
    ("json-syntax", "manifest unreadable"),
    ("json-other-step", "describes"),
    ("truncated-data", "manifest says"),
    ("empty-data", "manifest says"),
    ("missing-data", "unreadable"),
    ("missing-index", "unreadable"),
])
def test_corruption_is_refused_with_one_line(memory_tier_dir: str, case: str, message: str,
                                             read_pieces: str) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    _write(d, 1, _state(1))
    info = _write(d, 2, _state(2))
    data = d.file(2, ".data")
    if case == "data-first-part":
        offset, size, _ = info.parts[0]
        _flip(data, offset + size // 2)
    elif case == "data-last-part":
        offset, size, _ = info.parts[-1]
        _flip(data, offset + size - 1)
    elif case == "index":
        _flip(d.file(2, ".index"), info.index_bytes // 2)
    elif case == "json-value":
        _corrupt_json_field(d, 2)
    elif case == "json-syntax":
        _flip(d.file(2, ".json"), 0)
    elif case == "json-other-step":
        os.replace(d.file(1, ".json"), d.file(2, ".json"))
    elif case == "truncated-data":
        os.truncate(data, info.data_bytes - 1)
    elif case == "empty-data":
        os.truncate(data, 0)
    elif case == "missing-data":
        os.unlink(data)
    elif case == "missing-index":
        os.unlink(d.file(2, ".index"))

    with pytest.raises(SegmentError, match=message) as caught:
        d.read(2)
    text = str(caught.value)
    assert text and "\n" not in text
    if case.startswith("json"):
        with pytest.raises(SegmentError):
            d.info(2)
    if case != "json-other-step":
        _load(d, 1)  # the other segment is unaffected


@pytest.mark.parametrize("before", [0, 1, 2])
def test_a_commit_over_the_cap_raises_tier_full_and_changes_nothing(memory_tier_dir: str,
                                                                    before: int) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    states = {s: _state(s) for s in range(1, before + 1)}
    for s, st in states.items():
        _write(d, s, st)
    os.makedirs(d.path, exist_ok=True)
    was = _snapshot(memory_tier_dir)
    big = {"model": {"w": torch.randn(256, 1024)}}  # 1 MiB, more than any segment so far
    capped = SegmentDir(memory_tier_dir, RUN, OWNER,
                        max_bytes=tree_bytes(memory_tier_dir) + (256 << 10))

    with pytest.raises(TierFull, match="cap") as caught:
        capped.begin(before + 1, big, dict(META))
    assert "\n" not in str(caught.value)
    assert _snapshot(memory_tier_dir) == was
    assert d.steps() == sorted(states, reverse=True)
    for s, st in states.items():
        _assert_same(_load(d, s), st)

    # the free-space reserve refuses the same way
    reserved = SegmentDir(memory_tier_dir, RUN, OWNER, reserve_fraction=1.0)
    with pytest.raises(TierFull, match="free"):
        reserved.begin(before + 1, big, dict(META))
    assert _snapshot(memory_tier_dir) == was

    if before == 2:
        # a commit that fits the recycled data file needs no new bytes: still written
        s3 = _state(3)
        _write(capped, 3, s3)
        assert capped.steps() == [3, 2]
        _assert_same(_load(capped, 3), s3)


def test_clear_keeps_the_lock_file_and_remove_drops_the_folder(memory_tier_dir: str) -> None:
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    other = SegmentDir(memory_tier_dir, RUN, "rank-1")
    for s in (1, 2, 3):
        _write(d, s, _state(s))
    s1 = _state(1)
    _write(other, 1, s1)
    Path(d.path, ".writer.lock").touch()
    Path(d.path, "step-0000000009.data.tmp").write_bytes(b"x")

    d.clear()
    assert d.steps() == []
    assert os.listdir(d.path) == [".writer.lock"]
    with pytest.raises(SegmentError):
        d.read(3)

    _write(d, 4, _state(4))
    d.remove()
    assert not os.path.exists(d.path)
    assert d.steps() == []
    d.remove()  # already gone: no error
    assert other.steps() == [1]  # another owner of the same run is untouched
    _assert_same(_load(other, 1), s1)


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".", "..", ".hidden", "-x", "a b",
                                  "a\n", "x" * 129])
def test_check_name_refuses_anything_but_a_plain_name(name: str) -> None:
    with pytest.raises(ValueError, match="not a plain name"):
        check_name(name, "run id")
    with pytest.raises(ValueError):
        SegmentDir("/dev/shm/unused", name, OWNER)
    with pytest.raises(ValueError):
        SegmentDir("/dev/shm/unused", RUN, name)


@pytest.mark.parametrize("name", ["run-1", "a", "r.2_x-Y", "x" * 128])
def test_check_name_accepts_plain_names(name: str) -> None:
    assert check_name(name, "owner") == name


# -- peers ----------------------------------------------------------------------------------

@pytest.fixture
def served(memory_tier_dir: str):
    """Two segments on "another host", and its server."""
    d = SegmentDir(memory_tier_dir, RUN, OWNER)
    states = {1: _state(1), 2: _state(2)}
    infos = {s: _write(d, s, st) for s, st in states.items()}
    server = SegmentServer(memory_tier_dir, "127.0.0.1")
    try:
        yield d, server, states, infos
    finally:
        server.close()


def _get(address: tuple[str, int], path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*address, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_fetch_returns_the_verified_segment(served: Any) -> None:
    d, server, states, infos = served
    for step in (2, 1):
        info, files = fetch(server.address, RUN, OWNER, step, timeout=10)
        assert info == infos[step]
        restored = join_state(files)
        _assert_same(restored, states[step])
        assert restored["model"]["emb.weight"].data_ptr() == \
            restored["model"]["out.weight"].data_ptr()


@pytest.mark.parametrize("damage", ["flip", "truncate", "index"])
def test_fetch_refuses_a_corrupt_copy(served: Any, damage: str) -> None:
    d, server, _, infos = served
    offset, size, _ = infos[2].parts[0]
    if damage == "flip":
        _flip(d.file(2, ".data"), offset + size // 2)
    elif damage == "truncate":
        os.truncate(d.file(2, ".data"), infos[2].data_bytes - 4096)
    else:
        _flip(d.file(2, ".index"), 10)
    with pytest.raises(SegmentError, match="memory segment replicated step 2") as caught:
        fetch(server.address, RUN, OWNER, 2, timeout=10)
    assert "\n" not in str(caught.value)
    fetch(server.address, RUN, OWNER, 1, timeout=10)  # the other one still verifies


@pytest.mark.parametrize(("run", "owner", "step"), [
    (RUN, OWNER, 3), (RUN, "rank-9", 1), ("run-2", OWNER, 1)])
def test_fetch_of_a_missing_segment_raises(served: Any, run: str, owner: str, step: int
                                           ) -> None:
    _, server, _, _ = served
    with pytest.raises(SegmentError, match="404"):
        fetch(server.address, run, owner, step, timeout=10)


def test_fetch_refuses_a_manifest_for_another_step(served: Any) -> None:
    d, server, _, _ = served
    os.replace(d.file(1, ".json"), d.file(5, ".json"))
    with pytest.raises(SegmentError, match="describes"):
        fetch(server.address, RUN, OWNER, 5, timeout=10)


def test_fetch_checks_names_before_any_request(served: Any) -> None:
    _, server, _, _ = served
    with pytest.raises(ValueError, match="plain name"):
        fetch(server.address, "../..", OWNER, 1, timeout=10)
    with pytest.raises(ValueError, match="plain name"):
        fetch(server.address, RUN, "a/b", 1, timeout=10)


def test_the_server_serves_segment_files_only(served: Any, memory_tier_dir: str) -> None:
    d, server, _, _ = served
    Path(d.path, ".writer.lock").write_bytes(b"lock")
    Path(memory_tier_dir, "secret.json").write_bytes(b"secret")
    good = f"/{RUN}/{OWNER}/{stem(2)}.json"
    assert _get(server.address, good) == (200, Path(d.file(2, ".json")).read_bytes())
    for path in ("/../../etc/passwd", f"/{RUN}/{OWNER}/../../x", f"/{RUN}/../secret.json",
                 f"/{RUN}/{OWNER}/../../secret.json", "/%2e%2e/%2e%2e/etc/passwd",
                 f"/{RUN}/{OWNER}/.writer.lock", f"/{RUN}/{OWNER}/{stem(2)}.json?x=1",
                 f"/{RUN}/{OWNER}/{stem(2)}.json/../../../secret.json",
                 f"/{RUN}/{OWNER}/{stem(2)}.data.tmp", "/", f"/{RUN}/{OWNER}/"):
        status, body = _get(server.address, path)
        assert status == 404, path
        assert b"secret" not in body and b"root:" not in body, path


def test_fetch_from_a_closed_server_is_unreachable(served: Any) -> None:
    _, server, _, _ = served
    address = server.address
    server.close()
    t0 = time.monotonic()
    with pytest.raises(SegmentError, match="unreachable") as caught:
        fetch(address, RUN, OWNER, 2, timeout=2)
    assert time.monotonic() - t0 < 5
    assert "\n" not in str(caught.value)
