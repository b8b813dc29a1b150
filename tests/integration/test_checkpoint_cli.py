"""`hvd-resilient ckpt list|show|verify|prune` against a real S3 server."""

from __future__ import annotations

import io

import pytest

from hvd_resilient.checkpoint import CheckpointManager, step_dir
from hvd_resilient.checkpoint.cli import main


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _populate(url: str) -> CheckpointManager:
    mgr = CheckpointManager(url)
    mgr.save(100, 1, 4, {"state.pt": b"a" * 1500}, run_id="r1")
    mgr.save(200, 2, 3, {"state.pt": b"b" * 2_500_000}, meta={"note": "x"})
    mgr.store.put(f"{step_dir(300)}/state.pt", b"torn")  # killed writer
    return mgr


def test_list_show_verify_prune(s3_server, s3_url) -> None:
    mgr = _populate(s3_url)
    code, out, err = run("list", s3_url)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["STEP", "EPOCH", "WORLD", "CREATED", "(UTC)"]
    assert lines[1].split()[:3] == ["100", "1", "4"] and "1.5 KB" in lines[1]
    assert lines[2].split()[:3] == ["200", "2", "3"] and "2.5 MB" in lines[2]
    assert lines[3].startswith("300") and "partial (no manifest)" in lines[3]

    code, out, _ = run("show", s3_url)
    assert code == 0 and "step:            200" in out and '{"note": "x"}' in out
    assert f"{s3_url}/{step_dir(200)}" in out

    code, out, _ = run("verify", s3_url)
    assert code == 0, out
    assert [line.split()[-1] for line in out.splitlines()[1:3]] == ["ok", "ok"]

    data = bytearray(mgr.store.get(f"{step_dir(100)}/state.pt"))
    data[0] ^= 1
    mgr.store.put(f"{step_dir(100)}/state.pt", data)
    code, out, _ = run("verify", s3_url)
    assert code == 1
    assert "BAD: state.pt xxh3_128 mismatch" in out.splitlines()[1]
    code, out, _ = run("verify", s3_url, "--step", "200")
    assert code == 0 and len(out.splitlines()) == 2

    code, out, _ = run("prune", s3_url, "--keep-last", "1", "--dry-run")
    assert code == 0 and out.splitlines() == [
        f"would remove: {step_dir(100)}",
        "would abort 0 stale uploads (started more than 3600s ago)"]
    code, out, _ = run("prune", s3_url, "--keep-last", "1")
    assert out.splitlines()[0] == f"removed: {step_dir(100)}"
    assert [i.step for i in mgr.list()] == [200]


def test_errors_are_one_line_without_secrets(s3_server, tmp_path) -> None:
    code, out, err = run("list", "s3://no-such-bucket-cli/x")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    assert s3_server.secret_key not in err
    code, _, err = run("verify", "gs://x/y")
    assert code == 2 and "unsupported checkpoint URL scheme" in err
    code, _, err = run("bogus")
    assert code == 2


@pytest.mark.parametrize("command", [
    ["list"], ["show"], ["verify"], ["verify", "--step", "5"], ["prune", "--keep-last", "1"],
    ["prune", "--keep-last", "1", "--dry-run"], ["supersede"], ["supersede", "--tag", "t"],
])
@pytest.mark.parametrize("where", ["empty", "missing", "s3"])
def test_no_checkpoints_is_an_error_never_success(command, where, tmp_path, request) -> None:
    """A mistyped or empty location must not pass for a healthy one: `verify` of nothing
    said ok (exit 0). Every subcommand says so in one line and exits 2, creating nothing."""
    if where == "s3":
        url = request.getfixturevalue("s3_url")
    else:
        (tmp_path / "empty").mkdir()
        url = str(tmp_path / where)
    code, out, err = run(command[0], url, *command[1:])
    assert (code, out) == (2, "")
    assert err == f"hvd-resilient ckpt {command[0]}: error: no checkpoints at " \
        f"{CheckpointManager(url).url}\n"
    assert not (tmp_path / "missing").exists()


def test_verify_fails_when_no_checkpoint_is_complete(tmp_path) -> None:
    """Only a torn folder: nothing a resume could load, so verify must not say ok."""
    mgr = CheckpointManager(str(tmp_path))
    mgr.store.put(f"{step_dir(3)}/state.pt", b"torn")
    code, out, _ = run("verify", str(tmp_path))
    assert code == 1
    assert "partial (no manifest)" in out.splitlines()[1]
    assert out.splitlines()[-1] == (f"no complete checkpoint at {mgr.url} verifies: a resume "
                                    "would start from scratch")
    code, _, err = run("verify", str(tmp_path), "--step", "3")
    assert code == 2 and "no complete checkpoint step-0000000003" in err
    mgr.save(4, 0, 1, {"state.pt": b"good"})
    code, out, _ = run("verify", str(tmp_path))
    assert code == 0 and "no complete checkpoint" not in out
