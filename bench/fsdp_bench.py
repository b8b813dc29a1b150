"""FSDP checkpoint benchmark: sharded async save vs rank-0 full state-dict save (not a test).

``--nproc`` Gloo ranks (spawned here, no torchrun needed) shard a model of ``--size-mb`` MB
(float32 ``Linear`` layers, plain SGD: the checkpoint is the model) with FSDP2 and save it, per
store (``file://`` in a temp dir, and S3 on a SeaweedFS this script starts), median of
``--repeats``:

- sharded async (what ``--fsdp`` does): every rank ``dcp.async_save``s its shard and uploads
  it; stall = what the step is blocked for (sharded state dict + staging copy), end to end =
  until rank 0 has written the manifest (the ``checkpoint_saved`` event);
- rank-0 full (what a replicated checkpoint of an FSDP model would have to do): gather the
  full state dict onto rank 0, ``torch.save`` it, upload it and write the manifest, all inside
  the step (stall = end to end); the gather alone is reported too.

Usage: ``python bench/fsdp_bench.py --size-mb 300 --repeats 3``; prints a markdown table and
writes ``bench/results/fsdp.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the checkout's tests.support

MB = 1_000_000
LAYERS = 12


def build_model(size_mb: int) -> torch.nn.Module:
    d = int(math.sqrt(size_mb * MB / 4 / LAYERS))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(LAYERS)])


def bench_store(url: str, model: Any, opt: Any, rank: int, world: int, group: Any,
                repeats: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hvd_resilient.backends.torchdist import fsdp
    from hvd_resilient.checkpoint import CheckpointManager, to_buffer
    from hvd_resilient.checkpoint.sharded.checkpointer import ShardedCheckpointer

    mgr = CheckpointManager(url, keep_last=1)
    saved: list[dict[str, Any]] = []
    saver = ShardedCheckpointer(mgr, rank=rank, world_size=world, group=group,
                                on_event=lambda n, f: saved.append(f) if n == "checkpoint_saved"
                                else None)
    s: dict[str, list[float]] = {k: [] for k in (
        "sharded_stall", "sharded_end_to_end", "full_gather", "full_end_to_end")}
    nbytes = {"sharded": 0, "full": 0}
    step = 0
    for _ in range(repeats):
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        state = fsdp.sharded_state(model, opt)
        s["sharded_stall"].append(saver.save(
            step, 0, state, {"run_state.pt": b"counters"} if rank == 0 else None,
            stall_before=time.perf_counter() - t0))
        del state
        saver.wait()
        dist.barrier()
        if rank == 0:
            s["sharded_end_to_end"].append(saved[-1]["stall_seconds"] + saved[-1]["seconds"])
            nbytes["sharded"] = saved[-1]["bytes"]

        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        t1 = time.perf_counter()
        if rank == 0:
            blob = to_buffer({"model": full})
            info = mgr.save(step, 0, world, {"state.pt": blob})
            nbytes["full"] = info.total_bytes
            del blob
        del full
        dist.barrier()  # the other ranks wait for rank 0 at the next collective anyway
        s["full_gather"].append(t1 - t0)
        s["full_end_to_end"].append(time.perf_counter() - t0)
    saver.close()
    dist.barrier()
    if rank == 0:
        mgr.store.delete(mgr.store.list())
    return {"url_scheme": url.split("://")[0], "bytes": nbytes, "samples": s,
            "median_seconds": {k: statistics.median(v) for k, v in s.items() if v}}


def worker(rank: int, world: int, port: int, args: argparse.Namespace,
           urls: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from hvd_resilient.backends.torchdist import fsdp

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=10))
    model = build_model(args.size_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = fsdp.shard(model, opt, torch.device("cpu"))
    # one checkpoint group per store: a checkpointer's close() releases the group it was given
    results = {name: bench_store(url, model, opt, rank, world, dist.new_group(
        backend="gloo", timeout=datetime.timedelta(minutes=10)), args.repeats)
        for name, url in urls.items()}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def table(size_mb: int, results: dict[str, Any]) -> str:
    lines = [
        "| store | state | sharded async: stall | sharded async: end-to-end | rank-0 full: gather "
        "| rank-0 full: stall = end-to-end | stall, sharded / full |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        m = r["median_seconds"]
        lines.append(
            f"| {name} | {r['bytes']['sharded'] / MB:.0f} MB (model {size_mb} MB) "
            f"| {m['sharded_stall']:.2f} s | {m['sharded_end_to_end']:.2f} s "
            f"| {m['full_gather']:.2f} s | {m['full_end_to_end']:.2f} s "
            f"| {m['sharded_stall'] / m['full_end_to_end']:.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from tests.support.s3_server import S3Server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stores", default="file,s3", help="comma-separated: file, s3")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fsdp.json"))
    args = p.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-") as tmp:
        server = None
        urls = {}
        if "file" in stores:
            urls["file://"] = Path(tmp, "ckpt").as_uri()
        if "s3" in stores:
            server = S3Server(Path(tmp, "s3"))
            server.start()
            os.environ.update(server.env())  # the spawned ranks inherit it
            urls["SeaweedFS (S3)"] = f"s3://{server.bucket}/fsdp-bench-{uuid.uuid4().hex[:8]}"
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            out = str(Path(tmp, "results.json"))
            mp.start_processes(worker, args=(args.nproc, port, args, urls, out),
                               nprocs=args.nproc, start_method="spawn")
            results = json.loads(Path(out).read_text())
        finally:
            if server is not None:
                server.stop()
    doc = {
        "size_mb": args.size_mb, "nproc": args.nproc, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "loadavg_1min_after": os.getloadavg()[0]},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(table(args.size_mb, results))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
