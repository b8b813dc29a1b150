"""FSDP on the torchrun path: sharded checkpoints that reshard on resume.

Each test trains under real torchrun (Gloo), kills the whole job with SIGKILL after a few
checkpoints, resumes at the other world size (4 -> 2, 2 -> 4) and requires the gathered
parameters AND optimizer state right after the resume to equal those the checkpoint was taken
from, together with the step, sample count, sampler position and scheduler. The S3 test also
corrupts one shard of the newest checkpoint: it is rejected with its reason and the previous
one loads.
"""

from __future__ import annotations

import io
import pickle
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from hvd_resilient.checkpoint import CheckpointManager
from hvd_resilient.checkpoint.cli import main as ckpt_main
from hvd_resilient.checkpoint.manifest import CheckpointInfo, FileEntry, ManifestError, new_info
from hvd_resilient.checkpoint.sharded.dcp_safe import UnsafeMetadataError, read_metadata
from hvd_resilient.errors import FATAL_EXIT_CODE
from tests.support.jobs import PYTHON, events, wait_for
from tests.support.paths import SCRIPTS

TORCHRUN = str(Path(PYTHON).parent / "torchrun")
JOB = str(SCRIPTS / "fsdp_job.py")
EVERY = 10


def launch(jobs, run: Path, nproc: int, url: str, max_steps: int, name: str,
           memory: bool = False):
    """The durable path by default (memory tier off); ``memory``: durable checkpoints every
    1000 steps and the memory tier on, so only memory can hold the commits."""
    tier = ["--checkpoint-every", "1000"] if memory else [
        "--checkpoint-every", str(EVERY), "--no-memory-tier-enabled"]
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
           JOB, "--fsdp", "--run-id", "r", "--run-dir", str(run), "--checkpoint-url", url,
           *tier, "--commit-every", str(EVERY), "--batch-size", "8", "--epochs", "1000",
           "--max-steps", str(max_steps), "--checkpoint-keep-last", "4", "--log-every", "1000",
           "--dump-dir", str(run / "dumps")]
    return jobs.start(cmd, name=name)


def saved_steps(run: Path) -> list[int]:
    return [e["ckpt_step"] for e in events(run / "events.jsonl")
            if e["event"] == "checkpoint_saved"]


def train_and_kill(jobs, run: Path, nproc: int, url: str, checkpoints: int) -> None:
    """Trains until ``checkpoints`` exist, then SIGKILLs torchrun and every worker (an upload
    may be in flight: that checkpoint has no manifest and does not exist)."""
    job = launch(jobs, run, nproc, url, 100_000, f"train{nproc}")
    wait_for(lambda: len(saved_steps(run)) >= checkpoints, 240, "sharded checkpoints", job)
    procs = job.processes()
    assert len(procs) == nproc + 1, "expected torchrun and its workers"
    for p in procs:
        p.send_signal(signal.SIGKILL)
    job.wait(30)
    assert not [e for e in events(run / "events.jsonl") if e["event"] == "done"]


def resume(jobs, run: Path, nproc: int, url: str, from_step: int,
           memory: bool = False) -> dict[str, Any]:
    """Resumes at ``nproc`` ranks, trains 5 more steps, returns the resume event."""
    job = launch(jobs, run, nproc, url, from_step + 5, f"resume{nproc}", memory)
    assert job.wait(240) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    (resumed,) = [e for e in evs if e["event"] == "resume"]
    done = [e for e in evs if e["event"] == "done"]
    assert len(done) == nproc and {e["size"] for e in done} == {nproc}
    assert {e["step"] for e in done} == {from_step + 5}
    assert len({e["params_sha256"] for e in done}) == 1, "ranks disagree after training on"
    return resumed


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: length differs"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_resumed_state(run: Path, step: int, saved_world: int, resumed_world: int) -> None:
    saved = torch.load(run / "dumps" / f"saved-{step}-w{saved_world}.pt", weights_only=True)
    loaded = torch.load(run / "dumps" / f"resumed-{step}-w{resumed_world}.pt", weights_only=True)
    assert saved["optim"]["state"], "the optimizer state should not be empty"
    assert_same(saved, loaded, "state")  # model, optimizer, sampler, scheduler, counters


def ckpt(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    code = ckpt_main(list(argv), out=out, err=err)
    return code, out.getvalue() + err.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fsdp_4_to_2_ranks_file_store(tmp_path, jobs):
    run, url = tmp_path / "run", (tmp_path / "ckpt").as_uri()
    train_and_kill(jobs, run, 4, url, 1)
    latest = CheckpointManager(url).latest()
    assert latest is not None and latest.layout == "sharded" and latest.world_size == 4
    assert latest.shard_files == 4

    code, out = ckpt("show", url)
    assert code == 0 and "sharded (torch.distributed.checkpoint), 4 shard files" in out
    code, out = ckpt("list", url)
    assert code == 0 and "sharded/4" in out.splitlines()[1]
    code, out = ckpt("verify", url)
    assert code == 0 and "BAD" not in out, out

    resumed = resume(jobs, run, 2, url, latest.step)
    assert resumed["from_step"] == latest.step and resumed["saved_world_size"] == 4
    check_resumed_state(run, latest.step, 4, 2)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fsdp_2_to_4_ranks_s3_corrupt_shard_falls_back(tmp_path, jobs, s3_url, s3_server):
    jobs.extra_env.update(s3_server.env())
    run = tmp_path / "run"
    train_and_kill(jobs, run, 2, s3_url, 2)
    mgr = CheckpointManager(s3_url)
    *_, previous, newest = mgr.list()
    assert newest.layout == previous.layout == "sharded"
    key = newest.key("shards/__1_0.distcp")
    data = bytearray(mgr.store.get(key))
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    mgr.store.put(key, data)
    code, out = ckpt("verify", s3_url, "--step", str(newest.step))
    assert code == 1 and "BAD: shards/__1_0.distcp xxh3_128 mismatch" in out

    resumed = resume(jobs, run, 4, s3_url, previous.step)
    assert resumed["from_step"] == previous.step and resumed["saved_world_size"] == 2
    skipped = [e for e in events(run / "events.jsonl") if e["event"] == "checkpoint_skipped"]
    assert [(e["ckpt_step"], e["reason"]) for e in skipped] == [
        (newest.step, "shards/__1_0.distcp xxh3_128 mismatch")]
    check_resumed_state(run, previous.step, 2, 4)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fsdp_4_to_2_ranks_from_the_memory_tier(tmp_path, jobs, memory_tier_dir):
    """No durable checkpoint yet (every 1000 steps): the killed 4-rank job's shards in host
    memory are the only copy; 2 ranks reassemble and reshard them."""
    run, url = tmp_path / "run", (tmp_path / "ckpt").as_uri()
    job = launch(jobs, run, 4, url, 100_000, "train4", memory=True)

    def complete() -> list[int]:  # steps every rank's shards reached memory at
        seen: dict[int, set[int]] = {}
        for e in events(run / "events.jsonl"):
            if e["event"] == "memory_commit":
                seen.setdefault(e["ckpt_step"], set()).add(e["rank"])
        return [s for s, ranks in seen.items() if len(ranks) == 4]

    wait_for(lambda: len(complete()) >= 2, 240, "two complete commits in memory", job)
    job.kill_all()
    job.wait(30)
    newest = max(complete())
    assert CheckpointManager(url).latest() is None, "no durable checkpoint expected"

    resumed = resume(jobs, run, 2, url, newest, memory=True)
    assert (resumed["source"], resumed["from_step"]) == ("memory", newest), resumed
    assert resumed["saved_world_size"] == 4 and resumed["layout"] == "sharded", resumed
    check_resumed_state(run, newest, 4, 2)
    assert not list(Path(memory_tier_dir).rglob("step-*")), "commits left after the run"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_fsdp_a_lost_hosts_shards_come_from_its_peers_copy(tmp_path, jobs):
    """Two torchrun nodes of two ranks each, each node with a memory tier of its own (two
    hosts to the tier). Each node copies its shards to the other's memory. Everything is
    SIGKILLed and node 1's memory wiped (a host lost); 2 nodes of 1 rank resume: node 1's
    rank fetches every shard from node 0, which holds its own and node 1's copies."""
    from hvd_resilient.launch.launchers.torchrun import torchrun_command
    from tests.support.jobs import free_port

    run, url = tmp_path / "run", (tmp_path / "ckpt").as_uri()
    memory = [str(tmp_path / f"shm-node{i}") for i in range(2)]

    def nodes(nproc: int, max_steps: int, name: str) -> list:
        train = [JOB, "--fsdp", "--run-id", "r", "--run-dir", str(run), "--checkpoint-url",
                 url, "--checkpoint-every", "1000", "--commit-every", str(EVERY),
                 "--batch-size", "8", "--epochs", "1000", "--max-steps", str(max_steps),
                 "--log-every", "1000", "--dump-dir", str(run / "dumps")]
        cmd = torchrun_command(nproc, "2", f"127.0.0.1:{free_port()}", 0, "r", train)
        return [jobs.start(cmd, env=jobs.env(HVD_RESILIENT_MEMORY_TIER_DIR=memory[i]),
                           name=f"{name}-node{i}") for i in range(2)]

    first = nodes(2, 100_000, "train")

    def complete_in_node0() -> set[int]:
        """Steps of which node 0 holds all four shards: its own two and node 1's pushed two
        (its own writes and node 1's pushes finish independently, so wait for both)."""
        held: dict[int, set[str]] = {}
        for p in Path(memory[0]).rglob("shard-*-of-00004/step-*.json"):
            held.setdefault(int(p.stem.split("-")[1]), set()).add(p.parent.name)
        return {step for step, owners in held.items() if len(owners) == 4}

    wait_for(lambda: complete_in_node0(), 240, "a step with all 4 shards in node 0's memory",
             first[0])
    for job in first:
        job.kill_all()
    for job in first:
        job.wait(30)
    shutil.rmtree(memory[1])

    newest = max(complete_in_node0())
    again = nodes(1, newest + 5, "resume")
    for job in again:
        assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    (resumed,) = [e for e in evs if e["event"] == "resume"]
    assert resumed["source"] == "peer" and resumed["fetched_by"], resumed
    assert resumed["saved_world_size"] == 4 and resumed["size"] == 2, resumed
    assert resumed["from_step"] == newest, (resumed, newest)
    check_resumed_state(run, newest, 4, 2)
    assert not [p for m in memory for p in Path(m).rglob("step-*")], "commits left in memory"


def test_fsdp_with_horovod_is_one_config_error(tmp_path):
    """Without torchrun the backend is Horovod: refused before any training, one line."""
    r = subprocess.run([PYTHON, JOB, "--fsdp", "--run-dir", str(tmp_path), "--dump-dir",
                        str(tmp_path / "dumps")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == FATAL_EXIT_CODE
    assert r.stderr.strip().splitlines() == [
        "hvd-resilient: error: config: fsdp needs the torchrun or inplace backend, this job "
        "runs on horovod (launch it with torchrun or `hvd-resilient run --launcher "
        "torchrun|inplace`, or drop --fsdp / HVD_RESILIENT_FSDP)"]
    assert not (tmp_path / "events.jsonl").exists()


def test_manifest_layout_round_trips_and_old_manifests_are_replicated():
    files = {"shards/.metadata": FileEntry(3, "a" * 64), "run_state.pt": FileEntry(1, "d" * 64),
             "shards/__0_0.distcp": FileEntry(5, "b" * 64),
             "shards/__1_0.distcp": FileEntry(5, "c" * 64)}
    info = CheckpointInfo.from_json(new_info(7, 0, 2, files, layout="sharded").to_json())
    assert (info.layout, info.shard_files, info.world_size) == ("sharded", 2, 2)
    old = new_info(7, 0, 2, {"state.pt": FileEntry(1, "d" * 64)}).to_json(legacy=True).replace(
        b'"layout": "replicated",', b"")
    assert b"layout" not in old and CheckpointInfo.from_json(old).layout == "replicated"
    with pytest.raises(ManifestError, match="layout 'striped'"):
        CheckpointInfo.from_json(new_info(7, 0, 2, files, layout="striped").to_json())


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(UnsafeMetadataError, match="subprocess.call"):
        read_metadata(str(tmp_path))
    assert not (tmp_path / "pwned").exists()
