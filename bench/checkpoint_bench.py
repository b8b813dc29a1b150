"""Checkpoint benchmark against a SeaweedFS it starts itself (not a test).

For states of ``--sizes`` MB (10 float32 tensors each), median of ``--repeats``:

- stall: what the training step pays. Async writer = snapshot + submit; sync = torch.save
  into memory + upload (what a naive loop blocks on).
- end to end: from the start of the snapshot until ``checkpoint_saved``.
- upload MB/s of ``CheckpointManager.save`` (hashing overlapped) vs raw boto3 of the same
  bytes: one ``put_object`` and ``upload_fileobj`` with a TransferConfig of the same part
  size and threads (the best boto3 gives).
- restore: ``load_latest`` (download + sha256 verify) + ``torch.load``; our store's ranged
  download alone vs raw boto3 ``get_object`` and ``download_fileobj``.

Usage: ``python bench/checkpoint_bench.py --sizes 10,100 --repeats 3``; prints a markdown
table and writes ``bench/results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from s3_server import S3Server  # noqa: E402

from hvd_resilient.checkpoint import (  # noqa: E402
    AsyncCheckpointWriter,
    CheckpointManager,
    from_bytes,
    snapshot_state_dict,
    to_buffer,
)

MB = 1_000_000


def make_state(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * MB // 4 // 10
    return {f"layer{i}.weight": torch.randn(n) for i in range(10)}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


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
        "sync_stall", "raw_put_s", "raw_multipart_put_s", "load_s", "torch_load_s",
        "restore_s", "store_get_s", "raw_get_s", "raw_ranged_get_s",
    )}
    nbytes = 0
    for r in range(repeats):
        mgr.store.delete(mgr.store.list())
        events: list[tuple[str, dict]] = []
        writer = AsyncCheckpointWriter(
            mgr, on_event=lambda n, f, events=events: events.append((n, f)), prune=False
        )
        # async: the step pays for the snapshot only
        t0 = time.perf_counter()
        snap = snapshot_state_dict(state)
        t1 = time.perf_counter()
        writer.submit(2 * r + 1, 0, 1, {"state.pt": snap}, stall_seconds=t1 - t0)
        stall = time.perf_counter() - t0
        del snap
        assert writer.close(600), "async save did not finish"
        saved = [f for n, f in events if n == "checkpoint_saved"]
        assert saved, events
        ev = saved[0]
        s["snapshot"].append(t1 - t0)
        s["async_stall"].append(stall)
        s["async_end_to_end"].append(ev["stall_seconds"] + ev["seconds"])
        s["serialize"].append(ev["serialize_seconds"])
        s["upload_s"].append(ev["upload_seconds"])
        nbytes = ev["bytes"]
        # sync: torch.save + upload inside the step
        t0 = time.perf_counter()
        blob = to_buffer(state)
        mgr.save(2 * r + 2, 0, 1, {"state.pt": blob})
        s["sync_stall"].append(time.perf_counter() - t0)
        # raw boto3 uploads of the same bytes
        raw = bytes(blob)
        del blob
        t0 = time.perf_counter()
        client.put_object(Bucket=server.bucket, Key=f"{prefix}/raw-put", Body=raw)
        s["raw_put_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.upload_fileobj(io.BytesIO(raw), server.bucket, f"{prefix}/raw-mp", Config=tconf)
        s["raw_multipart_put_s"].append(time.perf_counter() - t0)
        # restore
        t0 = time.perf_counter()
        info, files = mgr.load_latest()
        t1 = time.perf_counter()
        obj = from_bytes(files["state.pt"])
        t2 = time.perf_counter()
        assert torch.equal(obj["layer0.weight"], state["layer0.weight"])
        del obj, files
        s["load_s"].append(t1 - t0)
        s["torch_load_s"].append(t2 - t1)
        s["restore_s"].append(t2 - t0)
        t0 = time.perf_counter()
        got = mgr.store.get_into(info.key("state.pt"), info.files["state.pt"].size)
        s["store_get_s"].append(time.perf_counter() - t0)
        del got
        t0 = time.perf_counter()
        body = client.get_object(Bucket=server.bucket, Key=f"{prefix}/raw-put")["Body"].read()
        s["raw_get_s"].append(time.perf_counter() - t0)
        assert len(body) == len(raw)
        del body
        buf = io.BytesIO()
        t0 = time.perf_counter()
        client.download_fileobj(server.bucket, f"{prefix}/raw-mp", buf, Config=tconf)
        s["raw_ranged_get_s"].append(time.perf_counter() - t0)
        del buf, raw
    mgr.store.delete(mgr.store.list())
    m = {k: median(v) for k, v in s.items()}
    mbs = nbytes / MB
    raw_up = mbs / min(m["raw_put_s"], m["raw_multipart_put_s"])
    raw_down = mbs / min(m["raw_get_s"], m["raw_ranged_get_s"])
    return {
        "size_mb": size_mb,
        "bytes": nbytes,
        "repeats": repeats,
        "median_seconds": m,
        "samples": s,
        "upload_mbps": mbs / m["upload_s"],
        "raw_upload_mbps": raw_up,
        "upload_vs_raw": (mbs / m["upload_s"]) / raw_up,
        "store_download_mbps": mbs / m["store_get_s"],
        "raw_download_mbps": raw_down,
        "download_vs_raw": (mbs / m["store_get_s"]) / raw_down,
        "load_verified_mbps": mbs / m["load_s"],
    }


def table(results: list[dict]) -> str:
    rows = [
        "| size | async stall (snapshot) | sync stall (save+upload) | async end-to-end "
        "| upload MB/s (raw best) | restore (load+verify / torch.load) "
        "| download MB/s (raw best) | verified load MB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        m = r["median_seconds"]
        rows.append(
            f"| {r['size_mb']} MB | {m['async_stall']:.3f} s | {m['sync_stall']:.2f} s "
            f"| {m['async_end_to_end']:.2f} s "
            f"| {r['upload_mbps']:.0f} ({r['raw_upload_mbps']:.0f}, "
            f"{100 * r['upload_vs_raw']:.0f}%) "
            f"| {m['restore_s']:.2f} s ({m['load_s']:.2f} / {m['torch_load_s']:.2f}) "
            f"| {r['store_download_mbps']:.0f} ({r['raw_download_mbps']:.0f}, "
            f"{100 * r['download_vs_raw']:.0f}%) | {r['load_verified_mbps']:.0f} |"
        )
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
