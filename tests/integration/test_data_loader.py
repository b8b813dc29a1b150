"""The loader with real worker processes: prefetched batches dropped, never counted, when the
order changes; a worker killed by SIGKILL (the OOM killer's signal) replaced without losing or
repeating a sample; bad samples and unreadable shards named; workers that hold none of the
training process's network connections; shards streamed from SeaweedFS."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from hvd_resilient.config import DataOptions
from hvd_resilient.data.errors import DataError
from hvd_resilient.data.loader import ElasticLoader
from hvd_resilient.data.shards import ShardedDataset, write_shards
from hvd_resilient.events import EventLog
from hvd_resilient.state.sampler import ElasticDataSampler
from tests.support.jobs import wait_for
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(240)


class Slow:
    """Sample i is (i, a random draw), after `ms` of CPU work; raises for ids in `bad`."""

    def __init__(self, n: int, ms: float = 0.0, bad: frozenset[int] = frozenset()) -> None:
        self.n, self.ms, self.bad = n, ms, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.perf_counter() + self.ms / 1000
        while time.perf_counter() < end:
            pass
        if i in self.bad:
            raise ValueError(f"cannot decode {i}")
        return torch.tensor([float(i), torch.rand(()).item()])


def workers_of_this_process() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if p.name().startswith(("python", "pt_"))]


def events_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def one_epoch(loader: ElasticLoader, s, world: int, rank: int = 0,
              each=None) -> list[int]:
    """Rank `rank`'s ids from the loaded data plus the other ranks' from the sampler."""
    used: list[int] = []
    k = 0
    while not s.epoch_done():
        b = loader.next_batch(rank, world)
        if b.used:
            assert b.data[:, 0].long().tolist() == b.used
        used += b.used
        used += [i for r in range(world) if r != rank
                 for i in s.next_slice(r, world, loader.batch_size).indices]
        s.next_slice(rank, world, loader.batch_size)
        s.advance(b.global_count)
        if each is not None:
            each(k)
        k += 1
    return used


def test_prefetched_batches_of_a_dropped_plan_are_never_delivered():
    """Restores and resizes while the workers are ahead: every sample once, and the draws
    equal to loading without workers (each sample seeded by its id, whoever loads it)."""
    draws = {}
    for workers in (0, 2):
        s = ElasticDataSampler(300, seed=2)
        with ElasticLoader(Slow(300, ms=2), s, batch_size=6, seed=4,
                           options=DataOptions(num_workers=workers, prefetch_factor=4)) as ld:
            used, got = [], {}
            commits = {}
            for step in range(200):
                if s.epoch_done():
                    break
                if step == 12:
                    commits[12] = (copy.deepcopy(s.state_dict()), len(used))
                if step == 20:  # back to the commit of step 12: 8 steps of work undone
                    s.load_state_dict(commits[12][0])
                    del used[commits[12][1]:]
                world = 2 if step < 30 else 3
                b = ld.next_batch(0, world)
                got.update(zip(b.used, b.data[:, 1].tolist(), strict=False))
                used += b.used + [i for r in range(1, world)
                                  for i in s.next_slice(r, world, 6).indices]
                s.next_slice(0, world, 6)
                s.advance(b.global_count)
            assert sorted(used) == list(range(300)), f"workers={workers}"
            assert ld.replans == 2
            draws[workers] = got
    assert draws[0] == {i: draws[2][i] for i in draws[0]}


def test_a_loader_worker_killed_by_sigkill_is_replaced_and_nothing_is_lost(tmp_path: Path):
    log = tmp_path / "events.jsonl"
    s = ElasticDataSampler(240, seed=1)
    killed: list[int] = []

    def kill_one(k: int) -> None:
        if k == 5:
            victim = wait_for(workers_of_this_process, 30, "loader workers")[0]
            victim.send_signal(signal.SIGKILL)
            killed.append(victim.pid)

    with ElasticLoader(Slow(240, ms=5), s, batch_size=8, events=EventLog(log),
                       options=DataOptions(num_workers=2)) as loader:
        used = one_epoch(loader, s, world=2, each=kill_one)
        assert loader.worker_losses == 1
    assert sorted(used) == list(range(240))
    lost = [e for e in events_of(log) if e["event"] == "loader_worker_lost"]
    assert len(lost) == 1 and str(killed[0]) in lost[0]["error"], lost
    assert not psutil.pid_exists(killed[0]) or psutil.Process(killed[0]).status() == "zombie"


def test_a_sample_that_raises_in_a_worker_is_skipped_and_counted(tmp_path: Path):
    log = tmp_path / "events.jsonl"
    s = ElasticDataSampler(64, shuffle=False)
    with ElasticLoader(Slow(64, bad=frozenset({3, 40})), s, batch_size=8, events=EventLog(log),
                       options=DataOptions(num_workers=2, on_bad_sample="skip")) as loader:
        used = one_epoch(loader, s, world=1)
    assert used == [i for i in range(64) if i not in (3, 40)]
    bad = [e for e in events_of(log) if e["event"] == "bad_sample"]
    assert [x["index"] for e in bad for x in e["samples"]] == [3, 40]
    assert bad[-1]["skipped_total"] == 2


def test_a_sample_that_raises_in_a_worker_stops_the_process_with_one_line(tmp_path: Path):
    """`fatal` (the default): the entry point exits FATAL (78) with one line naming the
    sample, as hvd_resilient.cli_errors.exit_on_error prints every error of ours."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys
        from tests.integration.test_data_loader import Slow
        from hvd_resilient.config import DataOptions
        from hvd_resilient.data.loader import ElasticLoader
        from hvd_resilient.cli_errors import exit_on_error
        from hvd_resilient.state.sampler import ElasticDataSampler

        @exit_on_error
        def main():
            s = ElasticDataSampler(64, shuffle=False)
            with ElasticLoader(Slow(64, bad=frozenset({21})), s, batch_size=8,
                               options=DataOptions(num_workers=2)) as loader:
                while not s.epoch_done():
                    b = loader.next_batch(0, 1)
                    s.next_slice(0, 1, 8)
                    s.advance(b.global_count)
            return 0

        sys.exit(main())
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HVD_RESILIENT_SUPERVISED", None)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 78, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("hvd-resilient: error:")]
    assert len(lines) == 1 and "sample 21" in lines[0] and "cannot decode 21" in lines[0], \
        p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_workers_hold_no_copy_of_the_training_process_connections():
    """A worker's copy of a Gloo socket would keep the connection open after its rank died,
    hiding the death from the peers' hang-up watch."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        s = ElasticDataSampler(400)
        with ElasticLoader(Slow(400, ms=1), s, batch_size=4,
                           options=DataOptions(num_workers=2)) as loader:
            loader.next_batch(0, 1)
            workers = wait_for(lambda: len(workers_of_this_process()) == 2
                               and workers_of_this_process(), 30, "two workers")
            mine = {c.fd for c in psutil.Process().net_connections("inet")}
            assert mine, "the test should hold inet sockets to check"
            for w in workers:
                assert w.net_connections("inet") == [], f"worker {w.pid} holds inet sockets"
    finally:
        for x in (client, conn, server):
            x.close()


def shard_samples(n: int):
    for i in range(n):
        yield {"__key__": f"{i:06d}", "bin": os.urandom(512), "cls": i}


def decode_id(sample: dict) -> torch.Tensor:
    return torch.tensor([float(int(sample["cls"])), 0.0])


def test_shards_streamed_from_s3_with_workers_match_the_local_copy(tmp_path, s3_url, s3_server):
    write_shards(shard_samples(600), s3_url, samples_per_shard=50)
    local = (tmp_path / "local").as_uri()
    write_shards(shard_samples(600), local, samples_per_shard=50)
    orders = []
    for url in (s3_url, local):
        ds = ShardedDataset(url, decode=decode_id)
        s = ds.make_sampler(seed=3)
        with ElasticLoader(ds, s, batch_size=10, seed=1,
                           options=DataOptions(num_workers=2, readahead_shards=2,
                                               cache_dir=str(tmp_path / "cache"))) as loader:
            used = one_epoch(loader, s, world=3, rank=1)
            if url == s3_url:
                folder = tmp_path / "cache" / f"pid{os.getpid()}"
                assert len(list(folder.glob("*.tar"))) <= 2 * (2 + 2), "shards not dropped"
        assert sorted(used) == list(range(600))
        orders.append(used)
    assert orders[0] == orders[1]


def test_an_unreadable_shard_on_s3_is_reported_once_and_its_samples_skipped(
        tmp_path, s3_url, s3_server):
    write_shards(shard_samples(200), s3_url, samples_per_shard=50)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    s3_server.client().put_object(Bucket=bucket, Key=f"{prefix}/shard-000002.tar",
                                  Body=b"replaced by something else")
    log = tmp_path / "events.jsonl"
    ds = ShardedDataset(s3_url, decode=decode_id)
    s = ds.make_sampler(seed=0)
    with ElasticLoader(ds, s, batch_size=10, events=EventLog(log),
                       options=DataOptions(num_workers=2, on_bad_sample="skip")) as loader:
        used = one_epoch(loader, s, world=1)
    assert sorted(used) == [i for i in range(200) if not 100 <= i < 150]
    evs = events_of(log)
    shard_events = [e for e in evs if e["event"] == "bad_shard"]
    assert len(shard_events) == 1 and shard_events[0]["shard"].endswith("shard-000002.tar")
    assert "checksum" in shard_events[0]["error"] or "bytes" in shard_events[0]["error"]
    skipped = sum(e["count"] for e in evs if e["event"] == "bad_sample")
    assert skipped == 50


def test_an_unreadable_shard_is_fatal_by_default(tmp_path: Path):
    url = (tmp_path / "d").as_uri()
    write_shards(shard_samples(100), url, samples_per_shard=25)
    (tmp_path / "d" / "shard-000001.tar").write_bytes(b"\0garbage" * 100)
    ds = ShardedDataset(url, decode=decode_id)
    s = ds.make_sampler(shuffle=False)
    with ElasticLoader(ds, s, batch_size=10, options=DataOptions(num_workers=2)) as loader:
        with pytest.raises(DataError, match=r"shard-000001\.tar"):
            one_epoch(loader, s, world=1)


@pytest.mark.parametrize("persistent", [True, False])
def test_workers_live_across_epochs_only_when_persistent(persistent: bool):
    s = ElasticDataSampler(48, seed=5)
    pids: list[set[int]] = []
    with ElasticLoader(Slow(48, ms=1), s, batch_size=8,
                       options=DataOptions(num_workers=2, persistent_workers=persistent)
                       ) as loader:
        for _ in range(2):
            assert sorted(one_epoch(loader, s, world=2)) == list(range(48))
            pids.append({p.pid for p in workers_of_this_process()})
            s.set_epoch(s.epoch + 1)
        assert loader.replans == 0, "crossing an epoch is part of the plan, not a new one"
    assert (pids[0] == pids[1]) is persistent, pids
