"""What in-place recovery needs from NCCL, checked in one go on a machine with one GPU.

    python bench/gpu_inproc_check.py --out bench/results/gpu_inproc_check.json

Under ten minutes; CI never runs it. Without CUDA it runs the same probes on Gloo (so the
script itself is exercised here) and says so in the JSON. Each probe is feature-detected at run
time, never pinned to a version; a probe that cannot run here records why.

1. environment: torch, CUDA, NCCL versions; which abort/shrink entry points this torch has;
   the NCCL settings that decide whether a failure kills the process we keep
   (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, `TORCH_NCCL_BLOCKING_WAIT`, the watchdog's timeout);
2. one-rank cycles: a generation formed, an allreduce, the group aborted (or destroyed) and
   formed again, N times; threads, descriptors, RSS and GPU memory counted after each, and a
   CUDA health check (a kernel and a synchronize) after each abort;
3. a peer that never arrives: a two-rank group with one rank only, a short timeout: how long
   the formation waits, and whether the process and its CUDA context survive the failure;
4. re-attach: a DDP model built on generation 1, the group replaced, DDP built again on
   generation 2 over the same module (parameters unchanged); FSDP2 through the in-place
   backend's own holder (`backends.inplace.fsdp.Resharded`): sharded, a step, the group
   replaced, re-sharded and reloaded from the full state, compared exactly, a step again;
5. two ranks on one GPU: recorded as skipped for now (NCCL refuses two ranks per device by
   default); to be written with the NCCL path of the backend.

Not covered yet: the NCCL watchdog's interplay with a hung collective (its timeout against
ours, `TORCH_NCCL_ASYNC_ERROR_HANDLING` 0 vs 3). The in-place backend itself runs Gloo only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

CYCLES = 20


def counts() -> dict[str, Any]:
    out: dict[str, Any] = {"threads": threading.active_count(),
                           "fds": len(os.listdir("/proc/self/fd")),
                           "rss_bytes": psutil.Process().memory_info().rss}
    if torch.cuda.is_available():
        out["cuda_allocated"] = torch.cuda.memory_allocated()
        out["cuda_reserved"] = torch.cuda.memory_reserved()
    return out


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def healthy() -> bool:
    """A kernel runs and the device synchronizes (a sticky CUDA error fails here)."""
    if not torch.cuda.is_available():
        return True
    try:
        x = torch.ones(1024, device="cuda")
        torch.cuda.synchronize()
        return float(x.sum()) == 1024.0
    except RuntimeError:
        return False


def form(store: Any, generation: int, rank: int, size: int, timeout_s: float) -> None:
    dist.init_process_group(backend(), store=dist.PrefixStore(f"g{generation}/", store),
                            rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device() if torch.cuda.is_available() else None)


def abort() -> str:
    """The strongest local teardown this torch offers: an abort where there is one (NCCL:
    never waits on a peer), else destroy."""
    fn = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if fn is not None and backend() == "nccl":
        fn()
        return "abort"
    dist.destroy_process_group()
    return "destroy"


def environment() -> dict[str, Any]:
    c10d = dist.distributed_c10d
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available()
        else None,
        "backend": backend(), "host": platform.node(),
        "abort_process_group": hasattr(c10d, "_abort_process_group"),
        "shrink_group": hasattr(c10d, "shrink_group") or hasattr(dist, "shrink_group"),
        "nonblocking_config": hasattr(torch.distributed, "ProcessGroupNCCL")
        and hasattr(getattr(dist, "ProcessGroupNCCL", object), "Options"),
        "env": {k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                               "TORCH_NCCL_BLOCKING_WAIT",
                                               "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
                                               "NCCL_COMM_BLOCKING")},
    }


def one_rank_cycles(store: Any) -> dict[str, Any]:
    rows = []
    for g in range(CYCLES):
        t0 = time.perf_counter()
        form(store, g, 0, 1, 30)
        t = torch.ones(1 << 20, device=device())
        dist.all_reduce(t)
        how = abort()
        rows.append({"generation": g, "seconds": round(time.perf_counter() - t0, 4),
                     "teardown": how, "healthy": healthy(), **counts()})
    first, last = rows[2], rows[-1]
    return {"cycles": rows, "flat": {k: last[k] - first[k] for k in first
                                     if isinstance(first[k], int) and k != "generation"}}


def missing_peer(store: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        form(store, 1000, 0, 2, 3)
        t = torch.ones(4, device=device())
        dist.all_reduce(t)  # NCCL forms lazily: the wait may be here
        error = None
    except Exception as e:  # the probe records whatever this build raises
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    waited = time.perf_counter() - t0
    with_group = dist.is_initialized()
    if with_group:
        abort()
    return {"waited_s": round(waited, 3), "error": error, "process_alive": True,
            "healthy_after": healthy(), **counts()}


def reattach(store: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {}
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(device())
    before = [p.detach().clone() for p in model.parameters()]
    form(store, 2000, 0, 1, 30)
    ids = [0] if torch.cuda.is_available() else None
    DDP(model, device_ids=ids)(torch.randn(4, 64, device=device())).sum().backward()
    abort()
    form(store, 2001, 0, 1, 30)
    ddp = DDP(model, device_ids=ids)
    ddp(torch.randn(4, 64, device=device())).sum().backward()
    out["ddp_rebuilt_on_new_group"] = all(torch.equal(a, b) for a, b in
                                          zip(before, model.parameters(), strict=True))
    abort()
    try:  # the shipped path: the in-place backend's holder, re-sharded, reloaded
        from torch.utils._pytree import tree_map_only

        from hvd_resilient.backends.inplace.fsdp import Resharded
        from hvd_resilient.backends.torchrun import fsdp

        form(store, 2002, 0, 1, 30)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        held = Resharded(model, opt, device())
        held(torch.randn(4, 64, device=device())).sum().backward()
        opt.step()
        # copies, as the memory tier's segments are (at one rank a full state dict is a view
        # of the shards, which the re-shard frees)
        model_sd, optim_sd = (tree_map_only(torch.Tensor, torch.clone, sd)
                              for sd in fsdp.full_state(held, opt))
        abort()
        form(store, 2003, 0, 1, 30)
        held.reshard()
        fsdp.apply_full_state(held, opt, {"model": model_sd, "optim": optim_sd})
        again, again_optim = fsdp.full_state(held, opt)
        # after the earlier probes' groups, this torch handed back DTensors here at one rank
        # (not in a fresh process): recorded, and compared whole
        out["full_state_types"] = sorted({type(t).__name__ for t in model_sd.values()})

        def whole(t: Any) -> Any:
            return t.full_tensor() if hasattr(t, "full_tensor") else t

        same = all(torch.equal(whole(model_sd[k]), whole(again[k])) for k in model_sd) and all(
            torch.equal(whole(a), whole(again_optim["state"][k][n]))
            for k, st in optim_sd["state"].items() for n, a in st.items()
            if isinstance(a, torch.Tensor))
        held(torch.randn(4, 64, device=device())).sum().backward()
        opt.step()
        out["fsdp2_resharded_and_reloaded"] = same
        abort()
    except Exception as e:
        out["fsdp2_resharded_and_reloaded"] = f"{type(e).__name__}: {str(e)[:200]}"
        if dist.is_initialized():
            abort()
    out["healthy_after"] = healthy()
    return out


def two_ranks_one_gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    return {"skipped": "needs NCCL_ALLOW_TWO_RANKS_PER_DEVICE-style support: run with two "
                       "processes by hand if this NCCL allows it (docs/architecture.md)"}


def probe(name: str, fn: Callable[[], dict[str, Any]], out: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception:
        out[name] = {"error": traceback.format_exc(limit=3)}
    out[name]["probe_seconds"] = round(time.perf_counter() - t0, 3)
    print(f"{name}: {json.dumps(out[name])[:300]}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"
                                        / "gpu_inproc_check.json"))
    a = p.parse_args()
    store_file = tempfile.NamedTemporaryFile(prefix="inproc-check-", delete=False).name
    store = dist.FileStore(store_file, -1)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "environment": environment()}
    print(f"environment: {json.dumps(out['environment'])}", flush=True)
    probe("one_rank_cycles", lambda: one_rank_cycles(store), out)
    probe("missing_peer", lambda: missing_peer(store), out)
    probe("reattach", lambda: reattach(store), out)
    probe("two_ranks_one_gpu", two_ranks_one_gpu, out)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    os.unlink(store_file)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
