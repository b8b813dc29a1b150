"""A rank 0 SIGKILLed in the middle of a durable save, on local disk: the temporary file it
was writing stays in the step's folder. The next save of that step removes it (its writer is
gone), but never the file of a writer still alive; pruning a step removes its folder whole.

Real processes: a child saves through the real file store and stops inside the fsync of its
`state-00000.bin` temporary file (written in full, not yet renamed), tells the test the file's
path, and is killed there."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hvd_resilient.checkpoint import CheckpointManager, step_dir
from hvd_resilient.checkpoint.stores import file as file_store
from hvd_resilient.checkpoint.stores.file import TMP_MARKER
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)

CHILD = textwrap.dedent("""
    import os, sys
    from hvd_resilient.checkpoint import CheckpointManager

    real_fsync = os.fsync

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(".state-00000.bin.tmp-"):  # written in full, not renamed yet
            print(os.readlink(f"/proc/self/fd/{fd}"), flush=True)
            sys.stdin.read()  # hang here until killed (or until the test is gone)
        real_fsync(fd)

    os.fsync = fsync
    mgr = CheckpointManager(sys.argv[1])
    mgr.save(int(sys.argv[2]), 0, 1, {"extra.pt": b"e" * 100,
                                      "state-00000.bin": os.urandom(1 << 20)})
""")

FILES = {"extra.pt": b"saved again" * 10, "state-00000.bin": b"s" * 4096}


@contextmanager
def writing(url: str, step: int) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A child in the middle of saving ``step``: (the child, its temporary file). Killed and
    reaped on the way out, if the test did not kill it first."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, url, str(step)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=60), "the child never got into its write"
        line = proc.stdout.readline().decode().strip()
        assert line, proc.stderr.read().decode()[-2000:]
        tmp = Path(line)
        assert tmp.exists() and TMP_MARKER in tmp.name, tmp
        yield proc, tmp
    finally:
        kill(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL, and reaped: a dead rank 0 whose launcher noticed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def leftovers(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if TMP_MARKER in n) if folder.exists() else []


def test_saving_the_step_again_removes_what_the_killed_writer_left(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/ckpt"
    with writing(url, 5) as (proc, tmp):
        kill(proc)
    assert tmp.exists(), "the killed writer left its temporary file"
    mgr = CheckpointManager(url)
    mgr.save(5, 0, 1, FILES)
    assert leftovers(tmp_path / "ckpt" / step_dir(5)) == []
    info, files = CheckpointManager(url).load_latest()
    assert info.step == 5 and files == FILES


def test_a_live_writers_file_is_kept_and_pruning_removes_the_folder_whole(
        tmp_path: Path) -> None:
    """A save of step 5 while another process still writes it (alive: its file must stay),
    then that process is killed, and step 5 pruned: nothing of its folder may remain."""
    url = f"file://{tmp_path}/ckpt"
    mgr = CheckpointManager(url, keep_last=1)
    with writing(url, 5) as (proc, tmp):
        mgr.save(5, 0, 1, FILES)
        assert leftovers(tmp_path / "ckpt" / step_dir(5)) == [tmp.name]
        kill(proc)
    mgr.save(6, 0, 1, FILES)
    assert mgr.prune() == [5]
    assert not (tmp_path / "ckpt" / step_dir(5)).exists(), os.listdir(tmp_path / "ckpt")


def test_pruning_a_torn_step_removes_its_folder_whole(tmp_path: Path) -> None:
    """The writer killed in step 2 left `extra.pt` and a temporary file, no manifest: a torn
    step, removed by the prune once a newer checkpoint verifies."""
    url = f"file://{tmp_path}/ckpt"
    with writing(url, 2) as (proc, _):
        kill(proc)
    mgr = CheckpointManager(url, keep_last=1)
    assert mgr.scan().partial == {2: [f"{step_dir(2)}/extra.pt"]}
    mgr.save(3, 0, 1, FILES)
    assert mgr.prune() == [2]
    assert sorted(os.listdir(tmp_path / "ckpt")) == [step_dir(3)]


def test_only_a_writer_of_this_machine_known_dead_counts_as_gone(tmp_path: Path) -> None:
    """The rule the save's sweep relies on, on the names the store itself gives."""
    name = Path(file_store.FileStore(str(tmp_path))._tmp("step-0000000001/x.bin")[2]).name
    rand, pid, machine = name.rpartition(TMP_MARKER)[2].split(".")
    assert int(pid) == os.getpid() and machine == file_store._machine() != ""
    never = str(2**22 + 1)  # above any pid_max: no process has it
    dead = name.replace(f".{pid}.", f".{never}.")
    assert not file_store._writer_gone(name)  # this process: alive
    assert file_store._writer_gone(dead)
    assert not file_store._writer_gone(dead.replace(machine, "0123456789abcdefn1"))  # elsewhere
    assert not file_store._writer_gone(f".x.bin{TMP_MARKER}{rand}")  # no owner: only by age
    assert not file_store._writer_gone(dead.replace(f".{never}.", ".0."))  # pid 0: a group


def test_pruning_a_step_on_s3_aborts_its_unfinished_uploads(s3_server, s3_url) -> None:
    """S3's counterpart of a temporary file: a multipart upload never completed (billed). One
    below a pruned step goes with it; one below a kept step, or below a sibling prefix that
    merely starts alike, stays."""
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = s3_url.split("/", 3)[3] + "/"
    mgr = CheckpointManager(s3_url, keep_last=1)
    mgr.save(5, 0, 1, FILES)
    mgr.save(6, 0, 1, FILES)
    keys = [f"{prefix}{step_dir(5)}/state-00001.bin", f"{prefix}{step_dir(6)}/state-00001.bin",
            f"{prefix}{step_dir(5)}0/x"]
    started = [client.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"] for k in keys]
    try:
        assert mgr.prune() == [5]
        left = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads") or []
        assert sorted(u["UploadId"] for u in left) == sorted(started[1:])
    finally:
        for key, upload in zip(keys, started, strict=True):
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
            except Exception:  # aborted already, by the prune
                pass
