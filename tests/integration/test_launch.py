"""`hvd-resilient run`: command lines, checks before launch, and supervised full restarts."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.launch import demo
from tests.support.jobs import PYTHON, events, wait_for
from tests.support.paths import ROOT
from tests.support.runs import assert_faults_fired, resumed_from_last_commit, sizes_seen

HVD = str(Path(PYTHON).parent / "hvd-resilient")
DIGITS = str(ROOT / "examples" / "digits.py")


def cli(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([HVD, *argv], capture_output=True, text=True, timeout=timeout, env=env)


def test_dry_run_prints_command_and_masks_credentials(tmp_path):
    import os

    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="s3cr3t-value", AWS_ACCESS_KEY_ID="AKIAX")
    r = cli("run", "--launcher", "mpi", "--np", "3", "--hosts", "a:2,b:2", "--run-id", "x",
            "--run-dir", str(tmp_path), "--checkpoint", "s3://bkt/p", "--dry-run", "--",
            "python", "train.py", "--epochs", "2", env=env)
    assert r.returncode == 0, r.stderr
    first, *env_lines = r.stdout.splitlines()
    assert "mpirun -np 3 " in first and "-H a:2,b:2" in first
    assert "-x AWS_SECRET_ACCESS_KEY" in first and first.endswith("python train.py --epochs 2")
    assert "AWS_SECRET_ACCESS_KEY=***" in env_lines
    assert "HVD_RESILIENT_CHECKPOINT_URL=s3://bkt/p" in env_lines
    assert "s3cr3t-value" not in r.stdout + r.stderr


def test_elastic_dry_run_sets_the_flags_that_matter(tmp_path):
    d = tmp_path / "d.sh"
    d.write_text("#!/bin/sh\necho localhost:2\n")
    d.chmod(0o755)
    r = cli("run", "--discovery", str(d), "--np", "2", "--min-np", "1", "--max-np", "4",
            "--network-interface", "lo", "--run-dir", str(tmp_path), "--dry-run", "--",
            "python", "t.py")
    assert r.returncode == 0, r.stderr
    for flag in ("--host-discovery-script", "--min-np 1", "--max-np 4",
                 "--blacklist-cooldown-range", "--gloo-timeout-seconds 30",
                 "--network-interface lo"):
        assert flag in r.stdout.splitlines()[0]
    # slot hosts by default: Horovod's launcher run through our driver module
    assert "-m hvd_resilient.launch.horovod.driver -np 2" in r.stdout.splitlines()[0]
    tuned = cli("run", "--discovery", str(d), "--np", "2", "--reset-limit", "5",
                "--elastic-timeout", "60", "--blacklist-cooldown-range", "3", "9",
                "--run-dir", str(tmp_path), "--dry-run", "--", "python", "t.py")
    assert tuned.returncode == 0, tuned.stderr
    for flag in ("--reset-limit 5", "--elastic-timeout 60", "--blacklist-cooldown-range 3 9"):
        assert flag in tuned.stdout.splitlines()[0]
    plain = cli("run", "--discovery", str(d), "--np", "2", "--no-slot-hosts",
                "--network-interface", "lo", "--run-dir", str(tmp_path), "--dry-run", "--",
                "python", "t.py")
    assert plain.returncode == 0, plain.stderr
    # still our driver (a fatal worker error stops the job, one line instead of a traceback),
    # told to blacklist whole hosts as plain horovodrun does
    first, *env_lines = plain.stdout.splitlines()
    assert "-m hvd_resilient.launch.horovod.driver -np 2" in first
    assert "HVD_RESILIENT_SLOT_HOSTS=0" in env_lines
    assert "HVD_RESILIENT_SLOT_HOSTS=0" not in r.stdout
    # --warm-pool reaches the driver the same way; off unless asked for
    pooled = cli("run", "--discovery", str(d), "--np", "2", "--warm-pool", "--run-dir",
                 str(tmp_path), "--dry-run", "--", "python", "t.py")
    assert pooled.returncode == 0, pooled.stderr
    assert "HVD_RESILIENT_WARM_POOL=1" in pooled.stdout.splitlines()[1:]
    assert "HVD_RESILIENT_WARM_POOL=1" not in plain.stdout
    # --discovery-watch too, as an absolute path (the driver runs in the run folder)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    watched = cli("run", "--discovery", str(d), "--np", "2", "--discovery-watch",
                  os.path.relpath(hosts), "--run-dir", str(tmp_path), "--dry-run", "--",
                  "python", "t.py")
    assert watched.returncode == 0, watched.stderr
    assert f"HVD_RESILIENT_DISCOVERY_WATCH={hosts}" in watched.stdout.splitlines()[1:]
    assert "HVD_RESILIENT_DISCOVERY_WATCH" not in plain.stdout


def test_standby_runs_in_process_only_what_python_itself_would_run_as_is():
    import sys

    from hvd_resilient.launch.warm.standby import runnable_here

    assert runnable_here([sys.executable, "train.py", "--epochs", "2"])
    assert runnable_here([sys.executable, "-m", "pkg.train"])
    assert not runnable_here([sys.executable, "-u", "train.py"])  # flags: exec'd as given
    assert not runnable_here([sys.executable, "-c", "print(1)"])
    assert not runnable_here([sys.executable, "-m"])
    assert not runnable_here(["/bin/sh", "train.sh"])  # another program
    assert not runnable_here([sys.executable])


def test_discovery_interval_from_the_environment(monkeypatch):
    from horovod.runner.elastic import driver

    from hvd_resilient.errors import LaunchError
    from hvd_resilient.launch.horovod.options import DriverOptions
    from hvd_resilient.launch.horovod.patches import discovery_interval
    from hvd_resilient.launch.horovod.patches.context import PatchContext

    monkeypatch.setattr(driver, "DISCOVER_HOSTS_FREQUENCY_SECS", 1.0)
    options = DriverOptions.read({"HVD_RESILIENT_DISCOVERY_INTERVAL": "0.25"})
    discovery_interval.install(PatchContext(options))
    assert driver.DISCOVER_HOSTS_FREQUENCY_SECS == 0.25
    for bad in ("fast", "0", "-1"):
        with pytest.raises(LaunchError) as e:
            DriverOptions.read({"HVD_RESILIENT_DISCOVERY_INTERVAL": bad})
        assert "HVD_RESILIENT_DISCOVERY_INTERVAL" in str(e.value) and bad in str(e.value)
    assert driver.DISCOVER_HOSTS_FREQUENCY_SECS == 0.25


def test_standby_takes_its_rank_from_the_go_not_from_its_start(monkeypatch):
    """A failure reset between a standby's start and its release shifts ranks: the released
    worker must join as what the driver says now."""
    from types import SimpleNamespace

    from hvd_resilient.launch.warm import standby

    for name, value in zip(standby.SLOT_ENV, ("2", "3", "0", "1", "2", "3"), strict=True):
        monkeypatch.setenv(name, value)
    now = SimpleNamespace(rank=1, size=2, local_rank=0, local_size=1, cross_rank=1,
                          cross_size=2)
    standby.apply_go(standby.slot_env(now))
    assert [os.environ[n] for n in standby.SLOT_ENV] == ["1", "2", "0", "1", "1", "2"]
    with pytest.raises(SystemExit, match="bad go"):
        standby.apply_go(b"1")


def test_slot_hosts_split_per_slot_and_map_back_to_the_machine():
    from hvd_resilient.backends.horovod import slots as slot_hosts

    split = slot_hosts.split({"node-a": 2, "10.0.0.7": 1})
    assert split == {"node-a+0": 1, "node-a+1": 1, "10.0.0.7+0": 1}
    assert {slot_hosts.real_host(h) for h in split} == {"node-a", "10.0.0.7"}
    assert slot_hosts.real_host("plain-host") == "plain-host"
    assert slot_hosts.local_rank({"HOROVOD_HOSTNAME": "node-a+1"}) == 1
    assert slot_hosts.local_rank({"HOROVOD_HOSTNAME": "node-a"}) is None
    assert slot_hosts.local_rank({}) is None


@pytest.mark.parametrize("argv,needle", [
    (["--launcher", "mpi", "--discovery", "x"],
     "run: --discovery applies to --launcher horovod or inplace only; drop it or choose "
     "horovod or inplace"),
    (["--hosts", "a:0"], "--hosts entry 'a:0' must look like host:slots"),
    (["--np", "5", "--min-np", "1", "--max-np", "4", "--discovery", "/bin/true"],
     "--np 5 must lie between"),
    (["--checkpoint", "ftp://x"], "--checkpoint: unsupported checkpoint URL scheme 'ftp'"),
    (["--discovery-watch", "/etc/hostname"], "--discovery-watch needs --discovery"),
    (["--discovery", "/bin/true", "--discovery-watch", "/no/such/hosts.txt"],
     "--discovery-watch /no/such/hosts.txt is not a file"),
])
def test_bad_options_one_line(tmp_path, argv, needle):
    r = cli("run", "--run-dir", str(tmp_path), *argv, "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr


def test_discovery_failing_on_first_call_is_one_line(tmp_path):
    d = tmp_path / "d.sh"
    d.write_text("#!/bin/sh\necho 'cannot reach the API server' >&2\nexit 1\n")
    d.chmod(0o755)
    r = cli("run", "--discovery", str(d), "--run-dir", str(tmp_path), "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE
    assert r.stderr.strip() == (f"hvd-resilient: error: discovery script {d} failed on its "
                                "first call: cannot reach the API server")


def test_unreachable_and_malicious_hosts_stop_before_launch(tmp_path):
    r = cli("run", "--launcher", "mpi", "--np", "2", "--hosts", "localhost:1,127.0.0.9:1",
            "--ssh-port", "1", "--run-dir", str(tmp_path), "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE
    assert r.stderr.strip() == (
        "hvd-resilient: error: hosts unreachable over ssh (127.0.0.9: connection refused on "
        "port 1); check they are up and sshd listens on port 1 (--ssh-port)")
    r = cli("run", "--hosts", "a;reboot:2", "--run-dir", str(tmp_path), "--", "python", "t.py")
    assert r.returncode == FATAL_EXIT_CODE, r.stderr
    assert "--hosts:" in r.stderr and "';'" in r.stderr, r.stderr


def test_missing_bucket_is_one_line_before_launch(tmp_path, s3_server):
    import os

    env = dict(os.environ, **s3_server.env())
    r = cli("run", "--launcher", "mpi", "--run-dir", str(tmp_path), "--checkpoint",
            "s3://no-such-bucket/x", "--", "python", DIGITS, env=env)
    assert r.returncode == FATAL_EXIT_CODE, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no-such-bucket" in r.stderr and s3_server.secret_key not in r.stderr
    assert not (tmp_path / "events.jsonl").exists(), "nothing may launch"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mpi_rank_killed_supervisor_restarts_and_ends_bit_identical(tmp_path, jobs):
    common = ["--epochs", "8", "--commit-every", "5", "--checkpoint-every", "20", "--seed", "2"]
    ref = tmp_path / "ref"
    job = jobs.start([HVD, "run", "--launcher", "mpi", "--np", "2", "--run-id", "ref",
                      "--run-dir", str(ref), "--", PYTHON, DIGITS, *common], name="ref")
    assert job.wait(240) == 0, job.output()[-3000:]
    run = tmp_path / "run"
    job = jobs.start([HVD, "run", "--launcher", "mpi", "--np", "2", "--run-id", "run",
                      "--run-dir", str(run), "--max-restarts", "2", "--", PYTHON, DIGITS,
                      *common], env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=70"),
                     name="run")
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    assert [(e["attempt"], e["delay"]) for e in evs if e["event"] == "restart"] == [(1, 0)]
    assert [e["warm"] for e in evs if e["event"] == "start"] == [True] * 4  # the warm pool's
    resume = resumed_from_last_commit(evs)  # not the durable checkpoint of step 60
    assert 70 - resume["from_step"] <= 5, "more than one commit interval redone"
    digests = {e["params_sha256"] for e in evs if e["event"] == "done"}
    ref_digests = {e["params_sha256"] for e in events(ref / "events.jsonl")
                   if e["event"] == "done"}
    assert len(ref_digests) == 1 and digests == ref_digests


def _preempted_mpi_job(tmp_path, jobs, epochs: int, backend: str = "mpi"
                       ) -> tuple[Path, object]:
    """An mpi (or another backend's) job under `hvd-resilient run` past its first checkpoint."""
    run = tmp_path / "run"
    extra = ["--network-interface", "lo"] if backend == "horovod" else []
    job = jobs.start([HVD, "run", "--launcher", backend, "--np", "2", "--run-id", "p",
                      "--run-dir", str(run), *extra, "--", PYTHON, DIGITS,
                      "--epochs", str(epochs),
                      "--commit-every", "5", "--checkpoint-every", "50",
                      "--checkpoint-grace-seconds", "30"], name="preempt")
    wait_for(lambda: any(e["event"] == "checkpoint_saved" for e in events(run / "events.jsonl")),
             180, "a first checkpoint", job)
    return run, job


def _stopped_at_a_final_checkpoint(evs: list[dict]) -> dict:
    """Both ranks stopped on the signal, and rank 0's last checkpoint is the stop step."""
    pre = [e for e in evs if e["event"] == "preempted"]
    assert sorted(e["rank"] for e in pre) == [0, 1] and all(e["exit_code"] == 75 for e in pre)
    (pre0,) = [e for e in pre if e["rank"] == 0]
    saved_at_stop = max(e["ckpt_step"] for e in evs
                        if e["event"] == "checkpoint_saved" and e["ts"] <= pre0["ts"])
    assert saved_at_stop == pre0["step"], "work lost at preemption"
    return pre0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_preemption_signal_final_checkpoint_then_restart_loses_nothing(tmp_path, jobs):
    run, job = _preempted_mpi_job(tmp_path, jobs, 30)
    workers = [e["pid"] for e in events(run / "events.jsonl") if e["event"] == "start"]
    assert len(workers) == 2  # forked from the warm pool: its command line, their own pids
    for pid in workers:  # what Slurm's --signal=USR1@T and a Kubernetes eviction do: every task
        os.kill(pid, signal.SIGUSR1)
    assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    pre0 = _stopped_at_a_final_checkpoint(evs)
    (resume,) = [e for e in evs if e["event"] == "resume"]
    assert resume["from_step"] == pre0["step"], "work lost at preemption"
    assert any(e["event"] == "restart" and e["preempted"] for e in evs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_run_stops_mpi_ranks_at_a_final_checkpoint(tmp_path, jobs):
    """mpirun answers SIGTERM by killing its ranks at once (we set its grace to 0, so that a
    dead rank costs no second): `hvd-resilient run` passes the first SIGTERM on as SIGUSR1,
    which mpirun forwards to every rank, and the job stops as at a preemption."""
    run, job = _preempted_mpi_job(tmp_path, jobs, 2000)
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == 75, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    _stopped_at_a_final_checkpoint(evs)
    assert not any(e["event"] == "restart" for e in evs), "a stopped run was relaunched"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_run_stops_horovod_workers_at_a_final_checkpoint(tmp_path, jobs):
    """Horovod's driver answers the SIGTERM by ending its workers with SIGTERM (SIGKILL 5 s
    later): each stops at a final checkpoint and exits 75, the driver starts none again and
    exits 75 too (`patches/stop_signal.py`), and the run is not relaunched."""
    run, job = _preempted_mpi_job(tmp_path, jobs, 2000, backend="horovod")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(120) == 75, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    pre0 = _stopped_at_a_final_checkpoint(evs)
    assert not any(e["event"] == "restart" for e in evs), "a stopped run was relaunched"
    late = [e for e in evs if e["event"] == "start" and e["rank"] >= 0 and e["ts"] > pre0["ts"]]
    assert not late, f"workers started after the stop: {late}"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["horovod", pytest.param("mpi", marks=pytest.mark.extended),
                                     "torchrun"])
def test_whole_job_sigkilled_then_run_again_resumes_from_s3(backend, tmp_path, jobs, s3_url,
                                                            s3_server):
    """The same script under each launcher: checkpoints go to SeaweedFS, kill -9 of every
    process (supervisor, launcher, workers), then `hvd-resilient run` again resumes."""
    import socket

    jobs.extra_env.update(s3_server.env())
    run = tmp_path / "run"
    extra = {"horovod": ["--network-interface", "lo"], "mpi": [], "torchrun": []}[backend]
    if backend == "torchrun":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            extra = ["--rdzv-endpoint", f"127.0.0.1:{s.getsockname()[1]}"]
    cmd = [HVD, "run", "--launcher", backend, "--np", "2", "--run-id", "k", "--run-dir",
           str(run), "--checkpoint", f"{s3_url}/k", *extra, "--", PYTHON, DIGITS,
           "--epochs", "25", "--commit-every", "5", "--checkpoint-every", "20"]
    job = jobs.start(cmd, name="first")
    saved = lambda: [e["ckpt_step"] for e in events(run / "events.jsonl")  # noqa: E731
                     if e["event"] == "checkpoint_saved"]
    wait_for(lambda: any(s >= 100 for s in saved()), 240, "a checkpoint at step >= 100", job)
    job.kill_all()
    job.wait(30)
    assert not [e for e in events(run / "events.jsonl") if e["event"] == "done"]
    last_saved = max(saved())

    job = jobs.start(cmd, name="second")
    assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    resume = resumed_from_last_commit(evs)  # every process died; the host's memory did not
    assert resume["from_step"] >= last_saved
    done = {e["params_sha256"] for e in evs if e["event"] == "done"}
    assert len(done) == 1 and len([e for e in evs if e["event"] == "done"]) == 2


# The demo's acts, in the order it narrates them (launch/demo.py).
DEMO_ACTS = ("worker killed; the survivors noticed", "the killed slot returns after its cooldown",
             "world size 2 again", "added a host", "world size 3: training at it",
             "removed it again", "world size 2: training at it")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_plays_its_whole_script_however_fast_training_is(tmp_path, jobs):
    """The demo kills a worker, adds a host and removes it, and the job ends only after its
    script has played, however many steps that takes: here a step budget of 100 that the
    story cannot fit on any machine (the killed slot's cooldown alone is seconds), with steps
    cheaper than the demo's own (twice as many a second here), as on a faster machine. The
    demo once ended at its step budget, before the removal, on a quiet machine. Then: the
    fault was survived, the ranks agree (and the demo says so), the report was printed.

    Started through `jobs`: the demo runs horovodrun in a session of its own, which a timeout
    of this test would orphan; the fixture's teardown kills every process of the job."""
    run = tmp_path / "demo"
    job = jobs.start([HVD, "demo", "--max-steps", "100", "--run-dir", str(run),
                      "--job-args=--dim 8 --layers 1 --batch-size 2"], name="demo")
    rc = job.wait(150)
    out = job.output()
    assert rc == 0, out[-4000:]
    assert f"run folder:  {run}" in out
    assert f"hvd-resilient report {run}" in out
    assert "the job ended before" not in out and "gave up" not in out, out[-4000:]
    at = [out.find(act) for act in DEMO_ACTS]
    assert -1 not in at and at == sorted(at), (dict(zip(DEMO_ACTS, at, strict=True)),
                                                out[-4000:])
    assert "goodput" in out.lower(), out[-3000:]
    assert "ranks hold the same parameters, optimizer state and schedule" in out
    assert_faults_fired(run, 1)
    assert sizes_seen(run) == [2, 1, 2, 3, 2]
    evs = events(run / "events.jsonl")
    assert [e for e in evs if e["event"] == "restore"]
    # the job ended at the final size, FINAL_STEPS or more after its first commit there (the
    # one the demo saw), past the budget
    steps = [(e["size"], e["step"]) for e in evs if e["event"] == "commit"]
    last_grown = max(i for i, (size, _) in enumerate(steps) if size == 3)
    final = [step for size, step in steps[last_grown + 1:]]
    assert {size for size, _ in steps[last_grown + 1:]} == {2}
    assert final[-1] - final[0] >= demo.FINAL_STEPS and final[-1] > 100, steps[-10:]
    done = [e for e in evs if e["event"] == "done"]
    assert len(done) == 2 and len({e["params_sha256"] for e in done}) == 1
    assert {e["step"] for e in done} == {final[-1]}
    assert list((run / "checkpoints").glob("step-*/manifest.json"))


def test_python_is_this_environments_without_the_venv_on_path(tmp_path):
    """`-- python ...` with the venv not activated: the workers still run in it (they used to
    start the system's Python and fail at `import torch`), and an interpreter named by a path
    that lacks the project is refused before anything starts, in one line."""
    env = dict(os.environ, PATH="/usr/bin:/bin")
    seen = tmp_path / "python.txt"  # a file: mpirun's tagged stdout may split a line
    probe = f"import sys, torch, hvd_resilient; open({str(seen)!r}, 'w').write(sys.executable)"
    r = cli("run", "--launcher", "mpi", "--np", "1", "--run-dir", str(tmp_path / "a"), "--",
            "python", "-c", probe, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert seen.read_text() == PYTHON
    bare = tmp_path / "python3"  # a real interpreter that cannot see site-packages
    bare.write_text(f"#!/bin/sh\nexec {PYTHON} -S -I \"$@\"\n")
    bare.chmod(0o755)
    r = cli("run", "--launcher", "mpi", "--np", "1", "--run-dir", str(tmp_path / "b"), "--",
            str(bare), "-c", probe, env=env, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot import torch" in lines[0], r.stderr
    assert not (tmp_path / "b" / "events.jsonl").exists() or "launch" not in \
        (tmp_path / "b" / "events.jsonl").read_text()
