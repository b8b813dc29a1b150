"""Checkpoint benchmark against a SeaweedFS it starts itself (not a test).

For states of ``--sizes`` MB (10 float32 tensors each), median of ``--repeats``:

- stall: what the training step pays. Async writer = the copy of every tensor into raw part
  buffers + submit (what ``DurableCheckpoints.save`` does); the median is over repeats whose
  snapshot reused the buffers of the one before (steady state); shown apart: the first
  checkpoint of a process copying into fresh memory (cold), and the first snapshot after
  ``warm_buffers`` faulted its buffers in, as ``DurableCheckpoints`` does after the first
  step. Sync = one ``torch.save`` into memory + upload (what a naive loop blocks on).
- end to end: from the start of the snapshot until ``checkpoint_saved``.
- upload MB/s of ``CheckpointManager.save`` of the split state (hashing overlapped) vs raw
  boto3 of the same bytes as one object: ``put_object`` and ``upload_fileobj`` with a
  TransferConfig of the same part size and threads; the better of the two is the bar.
- restore: what a resume does, from the newest manifest to a state dict in memory: list,
  manifest, every file downloaded and its digest verified, tensors made over the raw parts'
  bytes (the small index through ``torch.load(weights_only=True)``). The bar ("raw
  download") is the BEST of four plain downloads of the same bytes with the same client, part
  size and threads, nothing else done to them: the checkpoint's files through the store (as
  many in flight as a restore keeps), the state as one object through the store's ranged
  GETs, boto3 ``get_object().read()`` and boto3 ``download_fileobj``. The legacy single
  ``state.pt`` restore is shown for comparison.

Usage: ``OMP_NUM_THREADS=1 python bench/checkpoint_bench.py --sizes 10,100,1000 --repeats 3``;
prints a markdown table with the goal checks and writes ``bench/results/checkpoint.json``
(with the load average before and after each size: the machine is shared, read it with them).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's tests.support

from hvd_resilient.checkpoint import (  # noqa: E402
    AsyncCheckpointWriter,
    CheckpointInfo,
    CheckpointManager,
    to_buffer,
)
from hvd_resilient.checkpoint.host_buffers import HostBufferPool, pool  # noqa: E402
from hvd_resilient.checkpoint.reader import READ_AHEAD  # noqa: E402
from hvd_resilient.checkpoint.split import (  # noqa: E402
    LEGACY_FILE,
    decode_file,
    join_state,
    split_state,
    warm_buffers,
)
from tests.support.s3_server import S3Server  # noqa: E402

MB = 1_000_000


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * MB // 4 // 10
    return {f"layer{i}.weight": torch.randn(n) for i in range(10)}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def _cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (``pid`` None) or of ``pid``: where the two
    cores went, which wall times on a shared 2-core machine cannot say."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_timed(
    server: S3Server, cpu: dict[str, list[float]], what: str, fn: Callable[..., Any], *args: Any,
    **kwargs: Any,
) -> tuple[float, Any]:
    """``_timed`` that also records the client's and the server's CPU seconds under ``what``."""
    pid = server.proc.pid if server.proc is not None else None
    c0, s0 = _cpu_seconds(), _cpu_seconds(pid) if pid else 0.0
    out = _timed(fn, *args, **kwargs)
    cpu[f"{what}_client_cpu"].append(_cpu_seconds() - c0)
    cpu[f"{what}_server_cpu"].append(_cpu_seconds(pid) - s0 if pid else 0.0)
    return out


def _plain_files_get(mgr: CheckpointManager, info: CheckpointInfo) -> None:
    """Every file of ``info`` with the store's ranged GETs, as many files in flight as a
    restore keeps, but nothing else: no digest, no torch.load (a fair raw download)."""
    with ThreadPoolExecutor(READ_AHEAD) as pool:
        list(pool.map(lambda n: mgr.store.get_into(info.key(n), info.files[n].size),
                      sorted(info.files)))


def bench_size(server: S3Server, size_mb: int, repeats: int, part: int, threads: int) -> dict:
    import boto3.s3.transfer

    state = make_state(size_mb)
    url = f"s3://{server.bucket}/bench-{size_mb}mb"
    mgr = CheckpointManager(url, keep_last=0, part_size=part, threads=threads)
    client = server.client()
    tconf = boto3.s3.transfer.TransferConfig(
        multipart_threshold=2 * part, multipart_chunksize=part, max_concurrency=threads,
        use_threads=True,
    )
    prefix = f"bench-{size_mb}mb"
    s: dict[str, list[float]] = {k: [] for k in (
        "snapshot", "async_stall", "async_end_to_end", "serialize", "upload_s",
        "sync_stall", "raw_put_s", "raw_multipart_put_s", "restore_s", "legacy_restore_s",
        "plain_files_get_s", "store_get_s", "raw_get_s", "raw_ranged_get_s",
        "restore_client_cpu", "restore_server_cpu", "plain_files_get_client_cpu",
        "plain_files_get_server_cpu", "snapshot_reused_bytes", "warmed_first_snapshot",
    )}
    nbytes = single_bytes = 0
    for r in range(repeats):
        mgr.store.delete(mgr.store.list())
        # sync, the naive loop: one torch.save + upload inside the step (a single state.pt,
        # which is also the legacy layout restored below)
        t0 = time.perf_counter()
        blob = to_buffer(state)
        legacy = mgr.save(2 * r + 1, 0, 1, {LEGACY_FILE: blob})
        s["sync_stall"].append(time.perf_counter() - t0)
        single_bytes = len(blob)
        # async, what DurableCheckpoints does: the step pays for snapshot + split only
        events: list[tuple[str, dict]] = []
        writer = AsyncCheckpointWriter(
            mgr, on_event=lambda n, f, events=events: events.append((n, f)), prune=False
        )
        t0 = time.perf_counter()
        snap = split_state(state)
        t1 = time.perf_counter()
        writer.submit(2 * r + 2, 0, 1, snap, stall_seconds=t1 - t0)
        stall = time.perf_counter() - t0
        del snap
        assert writer.close(600), "async save did not finish"
        # a process's first snapshot after DurableCheckpoints warmed its buffers off the step
        fresh = HostBufferPool()
        warm_buffers(state, buffers=fresh)
        t2 = time.perf_counter()
        first = split_state(state, buffers=fresh)
        s["warmed_first_snapshot"].append(time.perf_counter() - t2)
        del first, fresh
        saved = [f for n, f in events if n == "checkpoint_saved"]
        assert saved, events
        ev = saved[0]
        s["snapshot"].append(t1 - t0)
        s["async_stall"].append(stall)
        s["async_end_to_end"].append(ev["stall_seconds"] + ev["seconds"])
        s["serialize"].append(ev["serialize_seconds"])
        s["upload_s"].append(ev["upload_seconds"])
        nbytes = ev["bytes"]
        s["snapshot_reused_bytes"].append(pool().reused_bytes)
        # raw boto3 uploads of the same bytes
        raw = bytes(blob)
        del blob
        s["raw_put_s"].append(_timed(
            client.put_object, Bucket=server.bucket, Key=f"{prefix}/raw-put", Body=raw)[0])
        s["raw_multipart_put_s"].append(_timed(
            client.upload_fileobj, io.BytesIO(raw), server.bucket, f"{prefix}/raw-mp",
            Config=tconf)[0])
        # restore, what resume does: newest manifest -> every file verified -> state dict
        dt, (info, files) = _cpu_timed(server, s, "restore", mgr.load_latest,
                                       decode=decode_file)
        dt2, obj = _timed(join_state, files)
        s["restore_s"].append(dt + dt2)
        assert info.step == 2 * r + 2 and torch.equal(obj["layer9.weight"], state["layer9.weight"])
        del obj, files
        dt, files = _timed(lambda info: join_state(mgr.load(info, decode_file)), legacy)
        s["legacy_restore_s"].append(dt)
        del files
        # raw downloads of the same bytes; the best of them is the bar
        s["plain_files_get_s"].append(
            _cpu_timed(server, s, "plain_files_get", _plain_files_get, mgr, info)[0])
        s["store_get_s"].append(_timed(
            mgr.store.get_into, legacy.key(LEGACY_FILE), single_bytes)[0])
        dt, body = _timed(lambda key: client.get_object(
            Bucket=server.bucket, Key=key)["Body"].read(), f"{prefix}/raw-put")
        assert len(body) == len(raw)
        s["raw_get_s"].append(dt)
        del body
        buf = io.BytesIO()
        s["raw_ranged_get_s"].append(_timed(
            client.download_fileobj, server.bucket, f"{prefix}/raw-mp", buf, Config=tconf)[0])
        del buf, raw
    mgr.store.delete(mgr.store.list())
    m = {k: median(v) for k, v in s.items()}
    if repeats > 1:  # steady state: the first snapshot of the process faults in fresh memory
        m["async_stall"] = median(s["async_stall"][1:])
        m["snapshot"] = median(s["snapshot"][1:])
    mbs, single_mbs = nbytes / MB, single_bytes / MB
    raw_up = single_mbs / min(m["raw_put_s"], m["raw_multipart_put_s"])
    downloads = {
        "plain_files_get": mbs / m["plain_files_get_s"],
        "store_get": single_mbs / m["store_get_s"],
        "boto3_get_object": single_mbs / m["raw_get_s"],
        "boto3_download_fileobj": single_mbs / m["raw_ranged_get_s"],
    }
    best = max(downloads, key=downloads.__getitem__)
    raw_down = downloads[best]
    return {
        "size_mb": size_mb,
        "bytes": nbytes,
        "single_file_bytes": single_bytes,
        "repeats": repeats,
        "loadavg_1min_after": os.getloadavg()[0],
        "median_seconds": m,
        "samples": s,
        "upload_mbps": mbs / m["upload_s"],
        "raw_upload_mbps": raw_up,
        "upload_vs_raw": (mbs / m["upload_s"]) / raw_up,
        "download_mbps": downloads,
        "raw_download_mbps": raw_down,
        "raw_download_best": best,
        "restore_mbps": mbs / m["restore_s"],
        "restore_vs_raw": (mbs / m["restore_s"]) / raw_down,
        "legacy_restore_vs_raw": (single_mbs / m["legacy_restore_s"]) / raw_down,
        "stall_vs_sync": m["async_stall"] / m["sync_stall"],
        "first_stall_s": s["async_stall"][0],
    }


GOALS = (  # (result key, comparison, bound, what)
    ("stall_vs_sync", "<=", 0.05, "async stall / sync save"),
    ("upload_vs_raw", ">=", 0.80, "upload / raw boto3 upload"),
    ("restore_vs_raw", ">=", 0.80, "restore / raw download"),
)


def table(results: list[dict]) -> str:
    rows = [
        "| state | stall: async writer (first checkpoint: cold, warmed) | stall: sync save "
        "| async end-to-end "
        "| upload MB/s (raw best, %) | restore: manifest -> verified state dict "
        "| raw download MB/s (best of 4) | legacy single-file restore |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        m = r["median_seconds"]
        rows.append(
            f"| {r['size_mb']} MB | {m['async_stall']:.3f} s ({r['first_stall_s']:.3f} s, "
            f"{m['warmed_first_snapshot']:.3f} s) "
            f"| {m['sync_stall']:.2f} s "
            f"| {m['async_end_to_end']:.2f} s "
            f"| {r['upload_mbps']:.0f} ({r['raw_upload_mbps']:.0f}, "
            f"{100 * r['upload_vs_raw']:.0f}%) "
            f"| {m['restore_s']:.2f} s, {r['restore_mbps']:.0f} MB/s = "
            f"**{100 * r['restore_vs_raw']:.0f}%** of raw "
            f"| {r['raw_download_mbps']:.0f} ({r['raw_download_best']}) "
            f"| {m['legacy_restore_s']:.2f} s = {100 * r['legacy_restore_vs_raw']:.0f}% of raw |"
        )
    rows.append("")
    for key, op, bound, what in GOALS:
        for r in results:
            v = r[key]
            ok = v <= bound if op == "<=" else v >= bound
            rows.append(f"- {r['size_mb']} MB: {what} = {100 * v:.1f}% "
                        f"(goal {op} {100 * bound:.0f}%): {'met' if ok else 'NOT met'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100,1000", help="state sizes in MB, comma separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--part-mb", type=int, default=16, help="multipart / ranged GET part size")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    part = args.part_mb << 20
    load_before = os.getloadavg()
    print(f"# load average before: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        server = S3Server(Path(tmp))
        server.start()
        saved_env = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            results = []
            for size in sizes:
                t0 = time.perf_counter()
                results.append(bench_size(server, size, args.repeats, part, args.threads))
                print(f"# {size} MB done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        finally:
            server.stop()
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    doc: dict[str, Any] = {
        "created": time.time(),
        "loadavg_before": load_before,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform()},
        "config": {"part_mb": args.part_mb, "threads": args.threads, "repeats": args.repeats,
                   "store": "SeaweedFS weed mini on loopback"},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp_out, out)
    print(table(results))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
