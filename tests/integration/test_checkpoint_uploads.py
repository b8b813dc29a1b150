"""Nothing an interrupted write leaves behind stays on the store (against a real SeaweedFS):
a multipart upload whose part fails, or whose thread is abandoned at process exit, is
aborted; `hvd-resilient ckpt prune` aborts the stale ones killed processes left, and removes
the temporary files of killed writers on local disk."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hvd_resilient.checkpoint import CheckpointManager, open_store
from hvd_resilient.checkpoint.cli import main as ckpt_main
from hvd_resilient.checkpoint.stores import s3 as s3_module
from hvd_resilient.checkpoint.stores.file import TMP_MARKER
from tests.support.paths import ROOT

MiB = 1 << 20


def uploads(s3_server, prefix: str) -> list[dict]:
    """The multipart uploads in progress below ``prefix`` (as the server lists them)."""
    resp = s3_server.client().list_multipart_uploads(Bucket=s3_server.bucket, Prefix=prefix)
    return resp.get("Uploads", []) or []


def _prefix(s3_url: str) -> str:
    return s3_url.split("/", 3)[3] + "/"


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return ckpt_main(list(argv), out=out, err=err), out.getvalue(), err.getvalue()


def test_a_failed_part_aborts_the_upload(s3_server, s3_url) -> None:
    store = open_store(s3_url, part_size=5 * MiB, threads=2)
    real = store.client.upload_part
    aborted: list[str] = []
    real_abort = store.client.abort_multipart_upload

    def upload_part(**kw):
        if kw["PartNumber"] == 2:
            raise RuntimeError("link died in part 2")
        return real(**kw)

    store.client.upload_part = upload_part
    store.client.abort_multipart_upload = lambda **kw: (aborted.append(kw["UploadId"]),
                                                        real_abort(**kw))[1]
    with pytest.raises(RuntimeError, match="part 2"):
        store.put("big.bin", bytes(12 * MiB))
    assert len(aborted) == 1
    assert uploads(s3_server, _prefix(s3_url)) == [] and not store.exists("big.bin")
    store.close()


CHILD = textwrap.dedent("""
    import sys, threading
    from hvd_resilient.checkpoint import open_store

    store = open_store(sys.argv[1], part_size=5 * 2**20, threads=2)
    client = store.client
    real_part, real_abort = client.upload_part, client.abort_multipart_upload
    in_part, aborted = threading.Event(), threading.Event()

    def upload_part(**kw):
        if kw["PartNumber"] == 2:  # stuck (a dead link) until the upload is aborted
            in_part.set()
            aborted.wait()
        return real_part(**kw)

    def abort(**kw):
        out = real_abort(**kw)
        print("ABORTED", flush=True)
        aborted.set()
        return out

    client.upload_part, client.abort_multipart_upload = upload_part, abort
    writer = threading.Thread(target=store.put, args=("state.bin", bytes(24 * 2**20)),
                              daemon=True)
    writer.start()
    assert in_part.wait(60), "never reached part 2"
    print("ABANDONING", flush=True)
    # The main thread ends here: the writer thread is abandoned mid-upload.
""")


def test_an_upload_abandoned_at_exit_is_aborted(s3_server, s3_url, tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), s3_url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == ["ABANDONING", "ABORTED"], proc.stdout
    assert "the process is exiting" in proc.stderr  # the warning of the abort
    assert uploads(s3_server, _prefix(s3_url)) == []
    assert not open_store(s3_url).exists("state.bin")


def test_prune_aborts_stale_multipart_uploads(s3_server, s3_url) -> None:
    client, bucket, prefix = s3_server.client(), s3_server.bucket, _prefix(s3_url)
    CheckpointManager(s3_url).save(1, 0, 1, {"state.pt": b"x"})
    # What a SIGKILLed writer leaves: an upload created, a part sent, never completed.
    up = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}step-0000000002/state.pt")
    client.upload_part(Bucket=bucket, Key=f"{prefix}step-0000000002/state.pt",
                       UploadId=up["UploadId"], PartNumber=1, Body=b"p" * 1000)
    other = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix[:-1]}-other/x")
    try:
        code, out, _ = run_cli("prune", s3_url, "--keep-last", "1")
        assert code == 0 and out.splitlines() == [
            "removed: nothing", "aborted 0 stale uploads (started more than 3600s ago)"]
        assert len(uploads(s3_server, prefix)) == 1  # younger than an hour: maybe running
        code, out, _ = run_cli("prune", s3_url, "--keep-last", "1", "--dry-run",
                               "--stale-uploads-after", "0")
        assert out.splitlines()[1] == "would abort 1 stale upload (started more than 0s ago)"
        assert len(uploads(s3_server, prefix)) == 1
        code, out, _ = run_cli("prune", s3_url, "--keep-last", "1", "--stale-uploads-after", "0")
        assert code == 0 and out.splitlines()[1] == \
            "aborted 1 stale upload (started more than 0s ago)"
        assert uploads(s3_server, prefix) == []
        # Only below the URL: a sibling prefix that merely starts alike is not touched.
        assert [u["UploadId"] for u in uploads(s3_server, f"{prefix[:-1]}-other/")] == \
            [other["UploadId"]]
        code, _, err = run_cli("prune", s3_url, "--keep-last", "1", "--stale-uploads-after", "-1")
        assert code == 2 and "--stale-uploads-after must be >= 0" in err
    finally:
        client.abort_multipart_upload(Bucket=bucket, Key=f"{prefix[:-1]}-other/x",
                                      UploadId=other["UploadId"])


def test_an_empty_location_with_stale_uploads_is_cleaned(s3_server, s3_url) -> None:
    client, bucket, prefix = s3_server.client(), s3_server.bucket, _prefix(s3_url)
    client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}step-0000000001/state.pt")
    code, out, err = run_cli("prune", s3_url, "--keep-last", "1", "--stale-uploads-after", "0")
    assert (code, err) == (0, "") and out.splitlines()[1].startswith("aborted 1 stale upload")
    assert uploads(s3_server, prefix) == []


def test_prune_removes_stale_temporary_files_on_local_disk(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, 0, 1, {"state.pt": b"x"})
    folder = tmp_path / "step-0000000002"
    folder.mkdir()
    stale = folder / f".state.pt{TMP_MARKER}0123456789ab"
    fresh = folder / f".other.pt{TMP_MARKER}ba9876543210"
    stale.write_bytes(b"half a file")
    fresh.write_bytes(b"being written")
    hour_ago = time.time() - 3700
    os.utime(stale, (hour_ago, hour_ago))
    code, out, _ = run_cli("prune", str(tmp_path), "--keep-last", "1")
    assert code == 0 and out.splitlines()[1] == \
        "aborted 1 stale upload (started more than 3600s ago)"
    assert not stale.exists() and fresh.exists()
    assert CheckpointManager(str(tmp_path)).load_latest()[0].step == 1


def test_server_side_copy_in_parts(s3_url, monkeypatch) -> None:
    """`supersede` copies on the server: one request up to 5 GiB, parts beyond (made small
    here so that a few MB take the parts path against the real server)."""
    store = open_store(s3_url, part_size=5 * MiB, threads=2)
    data = os.urandom(11 * MiB)
    store.put("a.bin", data)
    store.copy("a.bin", "b.bin")
    monkeypatch.setattr(s3_module, "_COPY_LIMIT", 1 * MiB)
    store.copy("a.bin", "c.bin")
    assert store.get("b.bin") == data and store.get("c.bin") == data
    store.close()
