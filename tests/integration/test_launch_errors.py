"""`hvd-resilient run` and the examples meeting mistakes: secrets never shown, typos and
impossible sizes refused, bad discovery output caught, one line for a fatal error, once.

Every job is a real process (hvd-resilient run, horovodrun through our driver, mpirun) with a
timeout, stopped by the `jobs` fixture whatever happens.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from hvd_resilient.errors import FATAL_EXIT_CODE
from tests.support.jobs import PYTHON, events, set_hosts, wait_for
from tests.support.paths import ROOT, SCRIPTS
from tests.support.runs import assert_faults_fired

HVD = str(Path(PYTHON).parent / "hvd-resilient")
DIGITS = str(ROOT / "examples" / "digits.py")
PROBE = str(SCRIPTS / "launcher_probe.py")


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{Path(PYTHON).parent}:{e.get('PATH', '')}"
    e["PYTHONPATH"] = str(ROOT)
    e["PYTHONUNBUFFERED"] = "1"
    for name in list(e):  # the test's own run must not leak into the processes it starts
        if name.startswith("HVD_RESILIENT_") or name.startswith("AWS_"):
            del e[name]
    e.update(extra)
    return e


def run(*argv: str, timeout: float = 120, cwd: Path | None = None,
        **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                          env=env(**extra), cwd=cwd, stdin=subprocess.DEVNULL)


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def every_byte_under(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# -- A: credentials ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_credential_reaches_any_output_or_file(tmp_path):
    """Every entry point, given credentials in a URL or in the environment: the secret is in
    no byte written to a terminal, the run folder or the checkpoint folder."""
    key, secret = "AKIA" + uuid.uuid4().hex[:12].upper(), "SeCrEt" + uuid.uuid4().hex
    s3_url = f"s3://{key}:{secret}@bucket/x"
    slash_url = f"s3://{key}:ab/{secret}@bucket/x"  # a raw '/' in the secret
    creds = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
             "AWS_SESSION_TOKEN": secret + "tok"}
    outputs: dict[str, str] = {}

    def check(name: str, r: subprocess.CompletedProcess, code: int | None) -> None:
        outputs[name] = r.stdout + r.stderr
        assert "Traceback" not in outputs[name], (name, outputs[name][-3000:])
        if code is not None:
            assert r.returncode == code, (name, outputs[name][-3000:])

    def one_masked_error(name: str, r: subprocess.CompletedProcess, shown: str) -> None:
        check(name, r, FATAL_EXIT_CODE)
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("hvd-resilient") and shown in line, (name, line)

    runs = tmp_path / "runs"
    # hvd-resilient run, launched and dry: the URL is refused, masked, before anything starts
    for dry in ([], ["--dry-run"]):
        r = run(HVD, "run", "--launcher", "mpi", "--np", "2", "--run-dir", str(runs / "a"),
                "--checkpoint", s3_url, *dry, "--", PYTHON, DIGITS, "--max-steps", "2")
        one_masked_error(f"run {dry}", r, "s3://***@bucket/x embeds credentials")
    r = run(HVD, "run", "--run-dir", str(runs / "b"), "--dry-run", "--", PYTHON, DIGITS,
            "--checkpoint-url", slash_url)
    one_masked_error("run, credentials in the training command", r, "s3://***@bucket/x")
    # dry-run with secrets in the environment: printed masked
    r = run(HVD, "run", "--launcher", "mpi", "--np", "2", "--run-dir", str(runs / "c"),
            "--dry-run", "--", PYTHON, DIGITS, **creds,
            AWS_ENDPOINT_URL=f"http://{key}:{secret}@127.0.0.1:1")
    check("dry-run env", r, 0)
    for line in ("AWS_SECRET_ACCESS_KEY=***", "AWS_ACCESS_KEY_ID=***", "AWS_SESSION_TOKEN=***",
                 "AWS_ENDPOINT_URL=http://***@127.0.0.1:1", "HVD_RESILIENT_SUPERVISED=1"):
        assert line in r.stdout.splitlines(), (line, r.stdout)
    # the example run directly: refused at config time, one line, nothing written
    for name, url in (("file", f"file://{key}:{secret}@{tmp_path}/ck"), ("slash", slash_url)):
        r = run(PYTHON, DIGITS, "--run-dir", str(runs / name), "--max-steps", "2",
                "--checkpoint-url", url)
        one_masked_error(f"digits {name}", r, "***@")
    # the example with credentials in the environment and an unreachable store: one line
    r = run(PYTHON, DIGITS, "--run-dir", str(runs / "s3"), "--max-steps", "2",
            "--checkpoint-url", "s3://bucket/x", timeout=240, **creds,
            AWS_ENDPOINT_URL="http://127.0.0.1:9", HVD_RESILIENT_CHECKPOINT_STORE_WAIT_SECONDS="1")
    check("digits unreachable s3", r, None)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith(
        "hvd-resilient: error: "), r.stderr[-3000:]
    # hvd-resilient ckpt
    for cmd in (["list", s3_url], ["verify", f"file://{key}:{secret}@{tmp_path}/ck"],
                ["list", slash_url]):
        r = run(HVD, "ckpt", *cmd)
        one_masked_error(f"ckpt {cmd[0]}", r, "***@")
    # a real supervised launch with the secrets in its environment: events, checkpoints,
    # manifests, result, launcher and worker output
    ckpt = tmp_path / "ckpt"
    r = run(HVD, "run", "--launcher", "mpi", "--np", "2", "--run-dir", str(runs / "real"),
            "--checkpoint", ckpt.as_uri(), "--", PYTHON, DIGITS, "--max-steps", "4",
            "--checkpoint-every", "2", timeout=300, **creds)
    check("real launch", r, 0)
    assert list(ckpt.glob("step-*/manifest.json")), "the launch must have written checkpoints"
    assert any(e["event"] == "start" and e.get("config") for e in
               events(runs / "real" / "events.jsonl"))

    for name, text in outputs.items():
        assert secret not in text and key not in text, (name, text[-3000:])
    files = every_byte_under(tmp_path)
    assert any(p.endswith("events.jsonl") for p in files)
    for path, data in files.items():
        assert secret.encode() not in data and key.encode() not in data, path


# -- B: typos in a run config file ------------------------------------------------------------
def test_run_config_file_typo_is_refused_with_the_closest_option(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_restart: 0\nnp: 3\n")
    r = run(HVD, "run", "--config", str(cfg), "--run-dir", str(tmp_path / "r"), "--dry-run",
            "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE
    (line,) = r.stderr.strip().splitlines()
    assert f"run: config file {cfg}: unknown field max_restart (did you mean max_restarts?)" \
        in line
    cfg.write_text("max-restarts: 0\nnp: 3\nlauncher: mpi\n")  # dashes work as in the flags
    r = run(HVD, "run", "--config", str(cfg), "--run-dir", str(tmp_path / "r"), "--dry-run",
            "--", "python", "t.py")
    assert r.returncode == 0, r.stderr
    assert "mpirun -np 3 " in r.stdout.splitlines()[0]
    cfg.write_text("np: three\n")
    r = run(HVD, "run", "--config", str(cfg), "--run-dir", str(tmp_path / "r"), "--dry-run",
            "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE
    assert r.stderr.strip() == (f"hvd-resilient: error: run: config file {cfg}: np must be a "
                                "whole number, got 'three'")


# -- D: impossible sizes ----------------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["--launcher", "horovod", "--np", "0"], "--np must be >= 1, got 0"),
    (["--launcher", "mpi", "--np", "0"], "--np must be >= 1, got 0"),
    (["--launcher", "torchrun", "--np", "-2"], "--np must be >= 1, got -2"),
    (["--np", "2", "--min-np", "3", "--max-np", "2", "DISCOVERY"],
     "--min-np (3) is larger than --max-np (2)"),
    (["--np", "5", "--min-np", "1", "--max-np", "4", "DISCOVERY"],
     "--np 5 must lie between --min-np 1 and --max-np 4"),
    (["--np", "2", "--min-np", "0", "DISCOVERY"], "--min-np must be >= 1, got 0"),
    (["--np", "1", "--min-np", "2", "DISCOVERY"], "--np 1 must lie between --min-np 2"),
    (["--launcher", "mpi", "--np", "2", "--min-np", "1"],
     "--min-np applies to --launcher horovod or inplace only; drop it or choose horovod or "),
    (["--np", "2", "--min-np", "1"], "--min-np/--max-np size an elastic job"),
    (["--launcher", "mpi", "--np", "3", "--hosts", "a:1,b:1"], "--np 3 is more than the 2 slots"),
    (["--launcher", "torchrun", "--nnodes", "0:2"], "--nnodes must be N or MIN:MAX"),
    (["--launcher", "torchrun", "--nnodes", "3:2"], "--nnodes must be N or MIN:MAX"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--gloo-timeout-seconds", "0"], "--gloo-timeout-seconds must be >= 1"),
])
@pytest.mark.parametrize("dry", [False, True])
def test_impossible_sizes_are_refused_before_launch(tmp_path, argv, needle, dry):
    d = script(tmp_path / "d.sh", "echo localhost:8\n")
    argv = [x for a in argv for x in (["--discovery", str(d)] if a == "DISCOVERY" else [a])]
    r = run(HVD, "run", "--run-dir", str(tmp_path / "r"), *argv, *(["--dry-run"] if dry else []),
            "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("hvd-resilient: error: run: ") and needle in line, line
    assert not (tmp_path / "r").exists(), "nothing may launch"


# -- C: discovery output ----------------------------------------------------------------------
@pytest.mark.parametrize("printed,needle", [
    ("hello world", "line 1 'hello world' is not a host: hostname 'hello world' contains ' '"),
    ("localhost:lots", "line 1 'localhost:lots' is not a host: slots must be a positive integer"),
    ("a:1\\nb:2\\na:3", "line 3 'a:3' lists host 'a' a second time"),
    ("", "printed no hosts"),
])
def test_bad_discovery_output_is_refused_before_launch(tmp_path, printed, needle):
    d = script(tmp_path / "d.sh", f"printf '{printed}\\n'\n")
    r = run(HVD, "run", "--discovery", str(d), "--network-interface", "lo", "--run-dir",
            str(tmp_path / "r"), "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"hvd-resilient: error: discovery script {d} printed ")
    assert needle in line, line
    if printed:
        assert "expected one 'hostname:slots' line per host, e.g. 'node1:4'" in line
    assert not (tmp_path / "r").exists()


def test_driver_refuses_a_bad_first_discovery_answer_in_one_line(tmp_path):
    """Without the pre-launch check (the driver run as horovodrun): Horovod would make a host
    named 'hello world'; the driver stops with one line naming the line."""
    d = script(tmp_path / "d.sh", "echo hello world\n")
    r = run(PYTHON, "-m", "hvd_resilient.launch.horovod.driver", "-np", "1",
            "--host-discovery-script", str(d), "--network-interface", "lo", "--elastic-timeout",
            "30", PYTHON, "-c", "pass", timeout=90, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"hvd-resilient: launcher: discovery script {d} printed line 1 'hello world' is not a "
        "host: hostname 'hello world' contains ' '; only ASCII letters, digits, '-', '_' and "
        "'.' are allowed; expected one 'hostname:slots' line per host, e.g. 'node1:4' (or a "
        "bare hostname)"], r.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bad_discovery_output_during_the_run_keeps_the_last_good_hosts(tmp_path, jobs):
    """Horovod runs the script every second: garbage after a good answer keeps the hosts, warns
    once per distinct answer naming the line, and is recorded as `discovery_invalid`."""
    hosts = tmp_path / "hosts.txt"
    set_hosts(hosts, "localhost:1,127.0.0.1:1")
    d = script(tmp_path / "d.sh", f"cat {hosts}\n")
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    job = jobs.start([HVD, "run", "--discovery", str(d), "--np", "2", "--network-interface",
                      "lo", "--run-dir", str(run_dir), "--", PYTHON, PROBE, "--run-dir",
                      str(run_dir), "--until", str(stop), "--max-steps", "100000"],
                     env=env(), name="discovery")
    evs = lambda: events(run_dir / "events.jsonl")  # noqa: E731
    wait_for(lambda: len({e["rank"] for e in evs() if e["event"] == "start"}) == 2, 240,
             "both ranks training", job)
    hosts.write_text("hello world\nlocalhost:1\n")
    wait_for(lambda: [e for e in evs() if e["event"] == "discovery_invalid"], 60,
             "a discovery_invalid event", job)
    hosts.write_text("localhost:lots\n")
    wait_for(lambda: len([e for e in evs() if e["event"] == "discovery_invalid"]) == 2, 60,
             "a second discovery_invalid event", job)
    set_hosts(hosts, "localhost:1,127.0.0.1:1")
    stop.touch()
    assert job.wait(120) == 0, job.output()[-4000:]
    bad = [e for e in evs() if e["event"] == "discovery_invalid"]
    assert [e["error"].split(" is not a host")[0] for e in bad] == [
        "line 1 'hello world'", "line 1 'localhost:lots'"]
    assert all(e["kept"] == "127.0.0.1:1,localhost:1" and e["rank"] == -1 for e in bad)
    out = job.output()
    assert out.count("printed line 1 'hello world' is not a host") == 1, out[-4000:]
    assert out.count("printed line 1 'localhost:lots' is not a host") == 1
    assert "Traceback" not in out
    assert not [e for e in evs() if e["event"] == "reset"], "the world must not have changed"
    assert {e["size"] for e in evs() if e["event"] == "done"} == {2}


# -- E: a fatal error is one line, once ------------------------------------------------------
COMMIT_EVERY_0 = "config: commit_every must be >= 1, got 0"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", ["horovod-elastic", "horovod-static", "mpi"])
def test_a_config_error_in_every_rank_is_one_line_once(tmp_path, launch):
    d = script(tmp_path / "d.sh", "printf 'localhost:1\\n127.0.0.1:1\\n'\n")
    how = {"horovod-elastic": ["--discovery", str(d), "--network-interface", "lo"],
           "horovod-static": ["--network-interface", "lo"],
           "mpi": ["--launcher", "mpi"]}[launch]
    run_dir = tmp_path / "run"
    r = run(HVD, "run", *how, "--np", "2", "--run-dir", str(run_dir), "--", PYTHON, DIGITS,
            "--commit-every", "0", timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == FATAL_EXIT_CODE, out[-4000:]
    assert out.count(COMMIT_EVERY_0) == 1, out[-4000:]
    assert "Traceback" not in out and "hvd-resilient: launcher" not in out, out[-4000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hvd-resilient run: not restarting: {COMMIT_EVERY_0}"), last
    fatal = [e for e in events(run_dir / "events.jsonl") if e["event"] == "fatal"]
    assert fatal and all(COMMIT_EVERY_0 in e["error"] for e in fatal)
    assert not [e for e in events(run_dir / "events.jsonl") if e["event"] == "restart"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fatal_error_after_init_on_one_rank_stops_the_elastic_job_at_once(tmp_path):
    """Rank 1 fails a check after init while rank 0 waits in an allreduce. Horovod alone would
    blacklist the slot, reset rank 0 to size 1 and train on (and restart the slot into the
    same error after its cooldown); the driver stops the job instead."""
    d = script(tmp_path / "d.sh", "printf 'localhost:1\\n127.0.0.1:1\\n'\n")
    run_dir = tmp_path / "run"
    r = run(HVD, "run", "--discovery", str(d), "--np", "2", "--min-np", "1",
            "--network-interface", "lo", "--run-dir", str(run_dir), "--", PYTHON, PROBE,
            "--run-dir", str(run_dir), "--fatal-rank", "1", "--fatal-step", "5",
            "--max-steps", "300", timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == FATAL_EXIT_CODE, out[-4000:]
    message = "probe: rank 1 refuses step 5 (a late configuration check)"
    assert out.count(message) == 1 and "Traceback" not in out, out[-4000:]
    assert "hvd-resilient: launcher" not in out, out[-4000:]  # the driver adds nothing
    evs = events(run_dir / "events.jsonl")
    assert [(e["rank"], e["error"]) for e in evs if e["event"] == "fatal"] == [(1, message)]
    assert not [e for e in evs if e["event"] in ("done", "reset")], "rank 0 trained on"
    assert {e["rank"] for e in evs if e["event"] == "start"} == {0, 1}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("elastic", [False, True])
def test_horovod_launcher_failure_is_one_line_not_a_traceback(tmp_path, elastic):
    """Workers that fail for reasons of their own (exit 3): Horovod's launcher raises; our
    driver prints that as one line."""
    d = script(tmp_path / "d.sh", "printf 'localhost:1\\n127.0.0.1:1\\n'\n")
    how = ["--discovery", str(d)] if elastic else []
    r = run(HVD, "run", *how, "--np", "2", "--network-interface", "lo", "--run-dir",
            str(tmp_path / "run"), "--", PYTHON, "-c", "raise SystemExit(3)", timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("hvd-resilient: launcher:")]
    assert "exited with non-zero status" in line and "Exit code: 3" in line, line


# -- --fresh-start --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_fresh_start_sets_checkpoints_aside_before_the_first_launch_only(tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    base = [HVD, "run", "--launcher", "mpi", "--np", "1", "--run-dir", str(run_dir),
            "--checkpoint", ckpt.as_uri(), "--max-restarts", "1"]
    train = [PYTHON, DIGITS, "--checkpoint-every", "2", "--commit-every", "1"]
    r = run(*base, "--", *train, "--max-steps", "4", "--seed", "1", timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    old = {p.parent.name: p.read_bytes() for p in ckpt.glob("step-*/manifest.json")}
    assert sorted(old) == ["step-0000000002", "step-0000000004"]

    # A second history (another seed) over the first: the first is set aside once, before
    # the first launch; the relaunch after the kill at step 20 resumes from the second one
    # (checkpoints every 2 steps: some of them are published before the kill, however slowly
    # the background uploads go on a loaded machine).
    t0 = time.time()
    r = run(*base, "--fresh-start", "--", *train, "--max-steps", "24", "--seed", "2",
            timeout=300, HVD_RESILIENT_FAULT="kill:rank=0:step=20")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert_faults_fired(run_dir, 1)
    (line,) = [ln for ln in out.splitlines() if "--fresh-start" in ln]
    assert line.startswith(f"hvd-resilient run: --fresh-start: moved 2 checkpoint(s) (steps "
                           f"2, 4) from {ckpt.as_uri()} to {ckpt.as_uri()}/superseded-"), line
    (aside,) = ckpt.glob("superseded-*")  # one folder: the relaunch set nothing aside
    assert {p.parent.name: p.read_bytes() for p in aside.glob("step-*/manifest.json")} == old
    evs = [e for e in events(run_dir / "events.jsonl") if e["ts"] >= t0]
    (restart,) = [e for e in evs if e["event"] == "restart"]
    resumes = [e for e in evs if e["event"] == "resume"]
    assert [e["ts"] > restart["ts"] for e in resumes] == [True], (resumes, out[-3000:])
    assert resumes[0]["from_step"] in range(2, 21, 2), resumes  # the new history's
    assert sorted(p.parent.name for p in ckpt.glob("step-*/manifest.json"))[-1] == \
        "step-0000000024"


# -- exit_on_error, in process ----------------------------------------------------------------
def test_exit_on_error_records_a_supervised_fatal_once_and_prints_otherwise(
        tmp_path, monkeypatch, capsys):
    from hvd_resilient.checkpoint.stores import StoreConfigError, TransientStoreError
    from hvd_resilient.cli_errors import exit_on_error
    from hvd_resilient.errors import ConfigError
    from hvd_resilient.events import EventLog

    for name in list(os.environ):
        if name.startswith(("HVD_RESILIENT_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_")) or \
                name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)

    def failing(error: Exception):
        return exit_on_error(lambda: (_ for _ in ()).throw(error))

    # not supervised: one line, masked, no event
    with pytest.raises(SystemExit) as e:
        failing(StoreConfigError("bucket s3://K:hush@b/x refused"))()
    assert e.value.code == FATAL_EXIT_CODE
    assert capsys.readouterr().err == "hvd-resilient: error: bucket s3://***@b/x refused\n"
    # supervised: recorded with the launcher's rank, nothing printed
    monkeypatch.setenv("HVD_RESILIENT_SUPERVISED", "1")
    monkeypatch.setenv("HVD_RESILIENT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as e:
        failing(ConfigError("config: bad\nvalue"))()
    assert e.value.code == FATAL_EXIT_CODE and capsys.readouterr().err == ""
    (fatal,) = events(tmp_path / "events.jsonl")
    assert (fatal["event"], fatal["rank"], fatal["size"], fatal["error"]) == (
        "fatal", 3, 4, "config: bad value")
    # already recorded by the trainer (same error since this main started): not twice
    log = EventLog(tmp_path / "events.jsonl", rank=0, size=4)

    def trainer_records_then_raises():
        log.emit("fatal", error="resume: no fit", restartable=False)
        raise ConfigError("resume: no fit")

    with pytest.raises(SystemExit):
        exit_on_error(trainer_records_then_raises)()
    assert [e["rank"] for e in events(tmp_path / "events.jsonl")
            if e.get("error") == "resume: no fit"] == [0]
    # a store that may come back: exit 1 (a launcher may restart it), printed, not recorded
    with pytest.raises(SystemExit) as e:
        failing(TransientStoreError("endpoint down"))()
    assert e.value.code == 1
    assert capsys.readouterr().err == "hvd-resilient: error: endpoint down\n"
    # the event log cannot be written: printed after all
    monkeypatch.setenv("HVD_RESILIENT_RUN_DIR", str(tmp_path / "events.jsonl" / "sub"))
    with pytest.raises(SystemExit):
        failing(ConfigError("config: other"))()
    assert capsys.readouterr().err == "hvd-resilient: error: config: other\n"


def test_recent_events_reads_only_the_tail(tmp_path):
    from hvd_resilient.events import EventLog, read_events, read_recent_events

    log = EventLog(tmp_path / "e.jsonl")
    for i in range(2000):
        log.emit("progress", i=i, pad="x" * 100)
    recent = list(read_recent_events(tmp_path / "e.jsonl", max_bytes=10_000))
    everything = list(read_events(tmp_path / "e.jsonl"))
    assert 50 < len(recent) < 100 and recent == everything[-len(recent):]
    assert list(read_recent_events(tmp_path / "missing.jsonl")) == []
