"""Write-once checkpoints on real storage (local disk and a real S3 server): a published
checkpoint is never written again, torn attempts may be, the manifest is created exclusively,
and `supersede` moves old checkpoints out of the way of a fresh start, safely re-runnable
after a crash at any point."""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from hvd_resilient.checkpoint import (
    MANIFEST_NAME,
    AsyncCheckpointWriter,
    CheckpointManager,
    StoreError,
    step_dir,
)
from hvd_resilient.checkpoint.cli import main as ckpt_main
from hvd_resilient.checkpoint.errors import CheckpointExistsError
from hvd_resilient.checkpoint.stores import StoreExistsError, open_store
from hvd_resilient.checkpoint.supersede import default_supersede_tag, validate_tag

MUTATING = ("put", "put_new", "copy", "delete")


def _files(step: int, tag: str = "a") -> dict[str, bytes]:
    return {"state.pt": f"{tag}: state of step {step}".encode() * 50,
            "extra/rank0.bin": bytes([step % 256]) * 10}


def snapshot(mgr: CheckpointManager) -> dict[str, bytes]:
    """Every key below the URL with its bytes."""
    return {k: bytes(mgr.store.get(k)) for k in mgr.store.list()}


def record_writes(mgr: CheckpointManager) -> list[tuple[str, str]]:
    """Spy on the store's writing methods: (method, first argument) per call."""
    calls: list[tuple[str, str]] = []
    for name in MUTATING:
        real = getattr(mgr.store, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, str(args[0]) if args else ""))
            return _real(*args, **kwargs)

        setattr(mgr.store, name, spy)
    return calls


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return ckpt_main(list(argv), out=out, err=err), out.getvalue(), err.getvalue()


# ---- write-once -----------------------------------------------------------------------------


def test_a_published_step_is_never_written_again(url: str) -> None:
    CheckpointManager(url).save(5, 1, 2, _files(5))
    before = snapshot(CheckpointManager(url))
    mgr = CheckpointManager(url)  # a run that starts over: a fresh process
    calls = record_writes(mgr)
    with pytest.raises(CheckpointExistsError) as e:
        mgr.save(5, 0, 1, _files(5, "b"))
    msg = str(e.value)
    assert "\n" not in msg and f"{mgr.url}/{step_dir(5)} (step 5) already exists" in msg
    assert (e.value.step, e.value.url) == (5, f"{mgr.url}/{step_dir(5)}")
    # The sharded path: every rank stores its own files into the folder, then rank 0 publishes.
    with pytest.raises(CheckpointExistsError):
        mgr.store_files(step_dir(5), {"shards/__1_0.distcp": b"x"})
    with pytest.raises(CheckpointExistsError):
        mgr.begin(5)
    assert calls == [] and snapshot(mgr) == before
    info, files = CheckpointManager(url).load_latest()
    assert (info.step, info.epoch, files) == (5, 1, _files(5))


@pytest.mark.parametrize("rotten", [False, True], ids=["verifies", "rotten"])
def test_the_background_writer_writes_nothing_over_a_published_step(url: str,
                                                                     rotten: bool) -> None:
    """A rank 0 that died after publishing, before the others learned of it: the next rank 0
    saves the same step again. A published checkpoint that verifies counts as saved; a rotten
    one is a failed save. Neither is written again."""
    CheckpointManager(url).save(5, 1, 2, _files(5))
    if rotten:
        mgr0 = CheckpointManager(url)
        key = f"{step_dir(5)}/state.pt"
        data = bytearray(mgr0.store.get(key))
        data[0] ^= 1
        mgr0.store.delete([key])
        mgr0.store.put(key, bytes(data))
    before = snapshot(CheckpointManager(url))
    events: list[tuple[str, dict]] = []
    mgr = CheckpointManager(url, on_event=lambda n, f: events.append((n, f)))
    writer = AsyncCheckpointWriter(mgr, prune=False)
    try:
        got = writer.save_sync(5, 0, 1, _files(5, "b"))
        writer.submit(6, 0, 1, _files(6))
        assert writer.wait(60)
    finally:
        writer.close(60)
    failed = [f for n, f in events if n == "checkpoint_failed"]
    published = [f for n, f in events if n == "checkpoint_already_published"]
    assert not [f for n, f in events if n == "checkpoint_skipped"]  # corrupt at resume only
    if rotten:
        assert got is None and len(failed) == 1 and failed[0]["ckpt_step"] == 5
        assert "already exists" in failed[0]["error"] and not published
    else:
        assert got is not None and got.step == 5 and not failed
        assert published == [{"ckpt_step": 5, "url": f"{mgr.url}/{step_dir(5)}"}]
    assert [f["ckpt_step"] for n, f in events if n == "checkpoint_saved"] == [6]
    after = snapshot(mgr)
    assert {k: v for k, v in after.items() if not k.startswith(step_dir(6))} == before


def test_a_torn_folder_may_be_written(url: str) -> None:
    mgr = CheckpointManager(url)
    mgr.store.put(f"{step_dir(7)}/state.pt", b"torn")  # files, no manifest
    mgr.store.put(f"{step_dir(8)}/state.pt", b"torn")  # an unreadable manifest
    mgr.store.put(f"{step_dir(8)}/{MANIFEST_NAME}", b'{"format": "hvd_res')
    for step in (7, 8):
        mgr.save(step, 0, 1, _files(step))
    assert [i.step for i in CheckpointManager(url).list()] == [7, 8]
    assert CheckpointManager(url).load(mgr.list()[0]) == _files(7)
    # A manifest of a newer format may be a good checkpoint of a newer version: kept.
    mgr.store.put(f"{step_dir(9)}/{MANIFEST_NAME}",
                  b'{"format": "hvd_resilient.checkpoint/4"}')
    with pytest.raises(CheckpointExistsError, match="newer version"):
        mgr.save(9, 0, 1, _files(9))
    assert mgr.store.list(step_dir(9)) == [f"{step_dir(9)}/{MANIFEST_NAME}"]


def test_of_two_writers_racing_for_one_step_one_publishes(url: str) -> None:
    a, b = CheckpointManager(url), CheckpointManager(url)
    a.begin(6), b.begin(6)  # neither sees a manifest yet
    entries_a = a.store_files(step_dir(6), _files(6, "a"))
    entries_b = b.store_files(step_dir(6), _files(6, "a"))
    info = a.publish(6, 0, 1, entries_a)
    raw = a.store.get(f"{step_dir(6)}/{MANIFEST_NAME}")
    with pytest.raises(CheckpointExistsError, match="another writer published it"):
        b.publish(6, 1, 1, entries_b)
    assert a.store.get(f"{step_dir(6)}/{MANIFEST_NAME}") == raw
    assert CheckpointManager(url).latest() == info


def test_exclusive_create_on_local_disk_has_one_winner(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    n = 8
    barrier = threading.Barrier(n)
    won: list[int] = []
    lost: list[int] = []

    def create(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            store.put_new("step-0000000001/manifest.json", f"writer {i}".encode())
            won.append(i)
        except StoreExistsError:
            lost.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(lost) == n - 1
    assert store.get("step-0000000001/manifest.json") == f"writer {won[0]}".encode()
    assert [p.name for p in (tmp_path / "step-0000000001").iterdir()] == ["manifest.json"]
    store.put_new("step-0000000001/manifest.json", f"writer {won[0]}".encode())  # same: ok


def test_s3_honours_the_conditional_put(s3_url: str) -> None:
    """SeaweedFS answers If-None-Match: * with 412, so the manifest's create is exclusive
    even where the look before it is beaten by another writer (simulated: it sees nothing)."""
    store = open_store(s3_url)
    store.put("k", b"first")
    store._exists = lambda key: False  # type: ignore[method-assign]
    with pytest.raises(StoreExistsError):
        store.put_new("k", b"second")
    assert store.get("k") == b"first" and store._conditional_put
    store.put_new("k", b"first")  # what is there already: a landed retry, not a conflict
    store.put_new("new", b"x")
    assert store.get("new") == b"x"


def test_exists_error_message_never_shows_credentials() -> None:
    e = CheckpointExistsError("s3://AKIAXXXX:s3cr3t/key@bucket/run/step-0000000005", 5)
    assert "s3cr3t" not in str(e) and "AKIAXXXX" not in str(e) and "bucket/run" in str(e)
    assert "s3cr3t" not in e.url and "\n" not in str(e)


# ---- supersede ------------------------------------------------------------------------------


def _populate(url: str) -> CheckpointManager:
    mgr = CheckpointManager(url)
    mgr.save(5, 0, 1, _files(5))
    mgr.save(10, 1, 1, _files(10))
    mgr.store.put(f"{step_dir(15)}/state.pt", b"torn upload")
    mgr.store.put(f"{step_dir(20)}/state.pt", b"unreadable")
    mgr.store.put(f"{step_dir(20)}/{MANIFEST_NAME}", b"{not json")
    return mgr


def _check_moved(url: str, tag: str, before: dict[str, bytes]) -> None:
    """Everything that was at ``url`` is at ``url/tag`` byte for byte; ``url`` is empty."""
    mgr = CheckpointManager(url)
    assert not mgr.has_checkpoints() and mgr.list() == [] and mgr.load_latest() is None
    moved = CheckpointManager(f"{url}/{tag}")
    assert {k: bytes(moved.store.get(k)) for k in moved.store.list()} == before
    scan = moved.scan()
    assert [i.step for i in scan.checkpoints] == [5, 10]
    assert set(scan.partial) == {15} and set(scan.invalid) == {20}
    assert [moved.verify(i) for i in scan.checkpoints] == [[], []]
    info, files = moved.load_latest()
    assert info.step == 10 and files == _files(10)


def test_supersede_moves_everything_out_of_the_way(url: str) -> None:
    mgr = _populate(url)
    before = snapshot(mgr)
    assert mgr.has_checkpoints()
    assert mgr.supersede("old") == [5, 10, 15, 20]
    _check_moved(url, "old", before)
    # The fresh start: same steps again, and listings of url ignore url/old/...
    fresh = CheckpointManager(url)
    fresh.save(5, 0, 1, _files(5, "new"))
    assert [i.step for i in fresh.list()] == [5] and not fresh.scan().partial
    assert fresh.load_latest()[1] == _files(5, "new")
    assert CheckpointManager(f"{url}/old").load(CheckpointManager(f"{url}/old").list()[0]) \
        == _files(5)
    assert fresh.prune() == [] and fresh.supersede("old2") == [5]


# Every crash point is a fresh population of the store: ~70 s on the S3 server, 2 s on disk.
# The S3 store's part of it (exclusive create, copy, delete) is proven by the other S3 cases.
@pytest.mark.parametrize("url", ["file", pytest.param("s3", marks=pytest.mark.extended)],
                         indirect=True)
def test_supersede_can_be_rerun_after_a_crash_at_any_point(url: str) -> None:
    """Kills the first run at its 1st, 2nd, ... store write (nothing after it happens), then
    re-runs it: every time, everything ends up moved, intact and loadable."""
    crash_at = 0
    while True:
        crash_at += 1
        where = f"{url}/case{crash_at}"
        before = snapshot(_populate(where))
        crashing = CheckpointManager(where)
        count = [0]
        for name in MUTATING:
            real = getattr(crashing.store, name)

            def fail_at(*args, _real: Callable = real, _count: list = count,
                        _at: int = crash_at, **kwargs):
                _count[0] += 1
                if _count[0] == _at:
                    raise StoreError("injected crash")
                return _real(*args, **kwargs)

            setattr(crashing.store, name, fail_at)
        try:
            crashing.supersede("t")
            finished = True
        except StoreError as e:
            assert str(e) == "injected crash"
            finished = False
            # Whatever was published is still loadable somewhere meanwhile.
            here, there = CheckpointManager(where), CheckpointManager(f"{where}/t")
            steps = {i.step for i in here.list()} | {i.step for i in there.list()}
            assert steps >= {5, 10}
            assert CheckpointManager(where).supersede("t") in ([5, 10, 15, 20], [10, 15, 20],
                                                                [15, 20], [20], [])
        _check_moved(where, "t", before)
        if finished:
            break
    assert crash_at > 10  # every write of a real move was a crash point once


def test_supersede_never_overwrites_another_checkpoint(url: str) -> None:
    mgr = CheckpointManager(url)
    mgr.save(5, 0, 1, _files(5))
    assert mgr.supersede("t") == [5]
    mgr.save(5, 3, 1, _files(5, "second run"))
    with pytest.raises(CheckpointExistsError, match=re.escape(f"{mgr.url}/t/{step_dir(5)}")):
        mgr.supersede("t")
    assert CheckpointManager(url).load_latest()[0].epoch == 3  # left where it was
    assert CheckpointManager(f"{url}/t").load_latest()[0].epoch == 0
    assert mgr.supersede("t2") == [5]


def test_a_rotten_checkpoint_is_moved_as_it_is(url: str) -> None:
    mgr = CheckpointManager(url)
    mgr.save(5, 0, 1, _files(5))
    bad = mgr.save(10, 0, 1, _files(10))
    data = bytearray(mgr.store.get(bad.key("state.pt")))
    data[0] ^= 0xFF
    mgr.store.put(bad.key("state.pt"), data)
    assert mgr.supersede("t") == [5, 10]
    moved = CheckpointManager(f"{url}/t")
    assert moved.verify(moved.list()[1]) == ["state.pt xxh3_128 mismatch"]
    assert moved.load_latest()[0].step == 5


def test_supersede_cli_and_tags(url: str) -> None:
    _populate(url)
    code, out, err = run_cli("supersede", url, "--tag", "step-0000000001")
    assert code == 2 and "supersede tag 'step-0000000001'" in err and err.count("\n") == 1
    for bad in ("", "a/b", "..", "-x", "x" * 101):
        with pytest.raises(ValueError):
            validate_tag(bad)
    assert re.fullmatch(r"superseded-\d{8}T\d{6}", default_supersede_tag())
    assert default_supersede_tag(0) == "superseded-19700101T000000"
    code, out, err = run_cli("supersede", url)
    base = CheckpointManager(url).url
    m = re.fullmatch(rf"moved 4 checkpoint folders \(steps 5, 10, 15, 20\) from {re.escape(base)}"
                     rf" to {re.escape(base)}/(superseded-\d{{8}}T\d{{6}})\n", out)
    assert code == 0 and err == "" and m, out
    assert [i.step for i in CheckpointManager(f"{url}/{m.group(1)}").list()] == [5, 10]
    code, out, err = run_cli("supersede", url)
    assert code == 2 and err == f"hvd-resilient ckpt supersede: error: no checkpoints at {base}\n"
