"""GPU memory tier benchmark: in-step stall per GB of copying a CUDA model + AdamW state into
the memory tier (not a test; needs a CUDA device). Compared: ``SegmentDir.begin`` as the code
is (``split_state`` ``copy_``-s each CUDA tensor into the mapped /dev/shm file: pageable, so
synchronous); a copy with ``non_blocking=True`` on a side ``torch.cuda.Stream`` into one
pinned buffer (enqueue time = the stall if the step waits for the event only before the next
optimizer step; completion = waiting at once), then off the step into a new mapping of the
file; and the file's mapping itself pinned by ``cudaHostRegister`` (DMA into /dev/shm).
Medians (min-max) of ``--repeats`` after 2 warm-ups (the tier recycles files from the 3rd).

Usage: ``python bench/gpu_memory_tier.py --params-gb 1 --repeats 7``; prints a markdown
table, writes ``gpu_memory_tier.json`` to ``$OUT`` when set, else to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvd_resilient.checkpoint.memory import SegmentDir  # noqa: E402

GB = 1e9
DEVICE = "cuda"
LABELS = {
    "begin": "in the step: `begin` as today (copy_ into the mapped file)",
    "finish": "off the step: `finish` (xxh3, index, manifest)",
    "pinned_enqueue": "in the step: pinned + side stream, copies enqueued",
    "pinned_complete": "pinned + side stream, until its event completed",
    "pinned_to_file": "off the step: pinned bytes into a new mapping of the file",
    "registered_enqueue": "in the step: registered file + side stream, enqueued",
    "registered_complete": "registered file + side stream, until its event completed",
}


def make_state(params_gb: float) -> tuple[dict, list[torch.Tensor]]:
    n = int(params_gb * GB) // 4 // 8
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n, device=DEVICE))
                                   for _ in range(8))
    opt = torch.optim.AdamW(model.parameters())
    for w in model:
        w.grad = torch.ones_like(w)
    opt.step()  # the optimizer state exists (exp_avg, exp_avg_sq on the GPU)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    return state, list(state["model"].values()) + [
        v for st in state["optimizer"]["state"].values() for v in st.values()]


def copy_async(tensors: list[torch.Tensor], dst: torch.Tensor,
               stream: torch.cuda.Stream) -> tuple[float, float]:
    """Every tensor into ``dst`` (pinned bytes) on ``stream``: (enqueue s, completed s)."""
    t0 = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream())
    pos = 0
    with torch.cuda.stream(stream):
        for t in tensors:
            n = t.numel() * t.element_size()
            dst[pos:pos + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            pos = -(-(pos + n) // 64) * 64
        done = torch.cuda.Event()
        done.record(stream)
    enqueued = time.perf_counter() - t0
    done.synchronize()
    return enqueued, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params-gb", type=float, default=1.0, help="model size; state is ~3x")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shm", default="/dev/shm")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_memory_tier: no CUDA device (torch.cuda.is_available() is False); run it on "
              "a GPU machine", file=sys.stderr)
        return 2
    state, tensors = make_state(a.params_gb)
    nbytes = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in tensors)
    gbs, free = nbytes / GB, shutil.disk_usage(a.shm).free
    if free < 4 * nbytes:
        print(f"gpu_memory_tier: {a.shm} has {free / GB:.1f} GB free, needs {4 * gbs:.1f} "
              f"(lower --params-gb or pass --shm)", file=sys.stderr)
        return 2
    s: dict[str, list[float]] = {}

    def add(i: int, **times: float) -> None:
        for k, v in times.items() if i >= 2 else ():  # warm-ups are not kept
            s.setdefault(k, []).append(v)

    root = tempfile.mkdtemp(prefix="hvd-gpu-memory-tier-", dir=a.shm)
    try:
        d = SegmentDir(root, "gpu", "replicated")
        for i in range(2 + a.repeats):  # as the code is today
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pending = d.begin(i + 1, state, {})
            t1 = time.perf_counter()
            d.finish(pending)
            add(i, begin=t1 - t0, finish=time.perf_counter() - t1)
        d.remove()
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream()
        scratch = os.path.join(root, "scratch.data")
        with open(scratch, "wb") as f:
            f.truncate(nbytes)
        for i in range(2 + a.repeats):  # pinned buffer + side stream, then into the file
            torch.cuda.synchronize()
            enq, done = copy_async(tensors, pinned, stream)
            t0 = time.perf_counter()
            with open(scratch, "r+b") as f:
                m = mmap.mmap(f.fileno(), nbytes)
            torch.frombuffer(m, dtype=torch.uint8).copy_(pinned)
            m.close()
            add(i, pinned_enqueue=enq, pinned_complete=done,
                pinned_to_file=time.perf_counter() - t0)
        with open(scratch, "r+b") as f:  # the file's mapping itself pinned
            m = mmap.mmap(f.fileno(), nbytes)
        view, cudart = torch.frombuffer(m, dtype=torch.uint8), torch.cuda.cudart()
        t0 = time.perf_counter()
        rc = int(cudart.cudaHostRegister(view.data_ptr(), nbytes, 0))
        register_s = time.perf_counter() - t0
        for i in range(2 + a.repeats if rc == 0 else 0):
            torch.cuda.synchronize()
            enq, done = copy_async(tensors, view, stream)
            add(i, registered_enqueue=enq, registered_complete=done)
        if rc == 0:
            cudart.cudaHostUnregister(view.data_ptr())
        del view
        m.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in s.items()}
    rows = [f"state {gbs:.2f} GB in {len(tensors)} tensors on {torch.cuda.get_device_name()};"
            f" median (min-max) of {a.repeats}", "",
            "| copy | s per GB | GB/s |", "| --- | --- | --- |"]
    rows += [f"| {LABELS[k]} | {med[k] / gbs:.4f} ({min(v) / gbs:.4f}-{max(v) / gbs:.4f}) "
             f"| {gbs / med[k]:.1f} |" for k, v in s.items()]
    rows.append(f"| cudaHostRegister of the mapped file (once) | {register_s / gbs:.4f} | "
                f"{'ok' if rc == 0 else f'failed: cudaError {rc}'} |")
    print("\n".join(rows))
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results") / "gpu_memory_tier.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python bench/gpu_memory_tier.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "state_bytes": nbytes, "tensors": len(tensors),
        "register_seconds": register_s, "register_rc": rc,
        "s_per_gb": {k: v / gbs for k, v in med.items()}, "samples": s}, indent=1) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
