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
   the formation waits, and whether the process and its CUDA context survive the failure (in
   a child process with a limit: on an H200, NCCL 2.28, the formation never returned);
4. re-attach: a DDP model built on generation 1, the group replaced, DDP built again on
   generation 2 over the same module (parameters unchanged); FSDP2 through the in-place
   backend's own holder (`backends.inplace.fsdp.Resharded`): sharded, a step, the group
   replaced, re-sharded and reloaded from the full state, compared exactly, a step again;
5. a peer that dies mid-job: two ranks (two processes, one GPU, or two where there are two)
   form a group and allreduce; rank 1 SIGKILLs itself; rank 0 enqueues the next allreduce
   (it can never complete) and waits on it, while another thread aborts the group 0.5 s later:
   whether the wait returns, how long after the abort, whether CUDA is healthy after it, and
   whether a new one-rank group forms and allreduces in the same process. This is what the
   in-place backend needs of NCCL: survivors keep their processes. Where NCCL refuses two
   ranks on one device, that is recorded.

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
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        how = abort()
        rows.append({"generation": g, "seconds": round(time.perf_counter() - t0, 4),
                     "form_and_allreduce_s": round(t1 - t0, 4),
                     "teardown_s": round(time.perf_counter() - t1, 4),
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
        from hvd_resilient.backends.torchdist import fsdp

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


def in_child(name: str, limit_s: float, extra_env: dict[str, str] | None = None
             ) -> dict[str, Any]:
    """Runs probe `name` in a child process of this script: a probe that hangs (NCCL's
    formation waits for a missing rank without a timeout) is recorded as hung, and the probes
    after it still run."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        out = Path(tmp) / "out.json"
        t0 = time.perf_counter()
        env = {**os.environ, **CHILD_ENV.get(name, {}), **(extra_env or {})}
        p = subprocess.Popen([sys.executable, __file__, "--child", name, "--out", str(out)],
                             env=env)
        try:
            code: Any = p.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            code = None
        got = json.loads(out.read_text()) if out.exists() else {}
        return {**got, "hung": code is None, "child_exit": code,
                "child_seconds": round(time.perf_counter() - t0, 3)}


CHILD_ENV = {"missing_peer_nonblocking": {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}}
"""The variant that asks torch for NCCL's non-blocking communicators (whose formation can be
timed out and aborted)."""


ABORT_VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "no_monitoring": {"TORCH_NCCL_ENABLE_MONITORING": "0"},
    "coord_check_50ms": {"TORCH_NCCL_COORD_CHECK_MILSEC": "50"},
    "no_monitoring_coord_50ms": {"TORCH_NCCL_ENABLE_MONITORING": "0",
                                 "TORCH_NCCL_COORD_CHECK_MILSEC": "50"},
    "async_error_handling_0": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    "destroy": {"HVDR_TEARDOWN": "destroy"},
    "abort_on_side_thread": {"HVDR_TEARDOWN": "side"},
}
"""Where a one-rank NCCL abort's second goes (measured 0.97-1.00 s, 20 of 20): each variant in
a fresh child process; `abort_on_side_thread` aborts generation g on a thread while g+1 forms."""


def abort_cycles(generations: int = 4) -> dict[str, Any]:
    """A child's part of `abort_variants`: generations formed, an allreduce, torn down as
    HVDR_TEARDOWN says (abort, destroy, or abort on a side thread while the next forms)."""
    store_file = tempfile.NamedTemporaryFile(prefix="abort-cycles-", delete=False).name
    store = dist.FileStore(store_file, -1)
    how = os.environ.get("HVDR_TEARDOWN", "abort")
    rows, pending = [], None
    c10d = dist.distributed_c10d
    for g in range(generations):
        t0 = time.perf_counter()
        if how == "side" and g:
            # the old group stays the default until the new one forms: hand it to a thread
            old = c10d._get_default_group()
            c10d._world.pg_map.pop(old, None)
            c10d._world.pg_names.pop(old, None)
            c10d._update_default_pg(None)
            side: dict[str, float] = {}

            def side_abort(pg: Any = old, into: dict[str, float] = side) -> None:
                t = time.perf_counter()
                pg.abort()
                into["took"] = time.perf_counter() - t

            pending = threading.Thread(target=side_abort, daemon=True)
            pending.start()
        form(store, g, 0, 1, 30)
        t = torch.ones(1 << 20, device=device())
        dist.all_reduce(t)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t1 = time.perf_counter()
        teardown = 0.0
        if how == "destroy":
            dist.destroy_process_group()
            teardown = time.perf_counter() - t1
        elif how == "abort" or g == generations - 1:
            abort()
            teardown = time.perf_counter() - t1
        if pending is not None:
            pending.join(30)
            teardown = side.get("took", -1.0)  # off the critical path: what it took aside
        rows.append({"generation": g, "form_and_allreduce_s": round(t1 - t0, 4),
                     "teardown_s": round(teardown, 4),
                     "side_abort_done": pending is None or not pending.is_alive(),
                     "healthy": healthy()})
    os.unlink(store_file)
    return {"teardown": how, "cycles": rows}


def abort_variants() -> dict[str, Any]:
    return {name: in_child("abort_cycles", 60, env) for name, env in ABORT_VARIANTS.items()}


def missing_peer_alone() -> dict[str, Any]:
    store_file = tempfile.NamedTemporaryFile(prefix="missing-peer-", delete=False).name
    try:
        return missing_peer(dist.FileStore(store_file, -1))
    finally:
        os.unlink(store_file)


def peer_dies(timeout_s: float = 60) -> dict[str, Any]:
    """Runs `peer_dies_rank` in two processes of this script and gathers what they wrote."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="peer-dies-") as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--peer-dies-rank", str(r),
                                   "--port", str(port), "--out", f"{tmp}/{r}.json"])
                 for r in (0, 1)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(f"killed after {timeout_s} s")
        out: dict[str, Any] = {"exit_codes": codes}
        for r in (0, 1):
            f = Path(f"{tmp}/{r}.json")
            out[f"rank{r}"] = json.loads(f.read_text()) if f.exists() else None
    return out


def peer_dies_rank(rank: int, port: int, out_path: str) -> int:
    """One rank of probe 5 (see the module's docstring); writes what it saw as it goes, so a
    rank that hangs still leaves its last stage."""
    import signal

    seen: dict[str, Any] = {"rank": rank, "stage": "start"}

    def note(**kw: Any) -> None:
        seen.update(kw)
        Path(out_path).write_text(json.dumps(seen))

    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count())) \
        if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    try:
        dist.init_process_group(backend(), store=dist.PrefixStore("g5000/", store), rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=30),
                                device_id=dev if dev.type == "cuda" else None)
        x = torch.full((1 << 20,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        note(stage="formed", device=str(dev), allreduce_ok=float(x[0]) == 3.0)
    except Exception as e:  # NCCL may refuse two ranks on one device: that is the finding
        note(stage="form_failed", error=f"{type(e).__name__}: {str(e)[:300]}")
        return 0
    if rank == 1:
        store.set("rank1_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    pid = int(store.get("rank1_pid"))
    t_dead = time.perf_counter()
    while process_alive(pid) and time.perf_counter() - t_dead < 30:
        time.sleep(0.01)
    note(stage="peer_dead", peer_gone=not process_alive(pid))
    work = dist.all_reduce(x, async_op=True)  # can never complete: its peer is gone
    aborted: dict[str, float] = {}

    def abort_later() -> None:
        time.sleep(0.5)
        aborted["at"] = time.perf_counter()
        try:
            aborted["how"] = abort()  # type: ignore[assignment]
        except Exception as e:
            aborted["error"] = f"{type(e).__name__}: {str(e)[:200]}"  # type: ignore[assignment]
        aborted["took"] = time.perf_counter() - aborted["at"]

    threading.Thread(target=abort_later, daemon=True).start()
    t0 = time.perf_counter()
    error = None
    try:
        work.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize()  # the enqueued kernel: only an abort can end it
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    ended = time.perf_counter()
    while "took" not in aborted and time.perf_counter() - ended < 30:
        time.sleep(0.01)
    note(stage="waited", wait_error=error, wait_s=round(ended - t0, 3),
         ended_after_abort_s=round(ended - aborted.get("at", ended), 3),
         abort=aborted.get("how", aborted.get("error")),
         abort_took_s=round(aborted.get("took", -1.0), 3), healthy_after_abort=healthy())
    try:  # the survivor forms the next generation alone, in the same process
        t1 = time.perf_counter()
        form(store, 5001, 0, 1, 30)
        y = torch.ones(4, device=dev)
        dist.all_reduce(y)
        note(stage="reformed", reform_s=round(time.perf_counter() - t1, 3),
             reformed_ok=float(y.sum()) == 4.0, healthy_after_reform=healthy())
        abort()
    except Exception as e:
        note(stage="reform_failed", error=f"{type(e).__name__}: {str(e)[:300]}")
    return 0


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def probe(name: str, fn: Callable[[], dict[str, Any]], out: dict[str, Any], path: str) -> None:
    """Runs one probe and writes everything so far: a later probe that hangs past an outer
    limit loses only itself."""
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception:
        out[name] = {"error": traceback.format_exc(limit=3)}
    out[name]["probe_seconds"] = round(time.perf_counter() - t0, 3)
    if name == "abort_variants":
        for variant, got in out[name].items():
            if isinstance(got, dict):
                cycles = got.get("cycles", [])
                print(f"  {variant}: teardown_s {[c.get('teardown_s') for c in cycles]} "
                      f"form_and_allreduce_s {[c.get('form_and_allreduce_s') for c in cycles]} "
                      f"hung={got.get('hung')} exit={got.get('child_exit')}", flush=True)
    shown = {k: v for k, v in out[name].items() if k != "cycles"}
    if "cycles" in out[name]:
        for k in ("seconds", "form_and_allreduce_s", "teardown_s"):
            shown[k] = [c.get(k) for c in out[name]["cycles"]]
        shown["healthy"] = all(c["healthy"] for c in out[name]["cycles"])
    print(f"{name}: {json.dumps(shown)}", flush=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"
                                        / "gpu_inproc_check.json"))
    p.add_argument("--peer-dies-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["missing_peer", "missing_peer_nonblocking",
                                       "abort_cycles"],
                   default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", default="", help="comma-separated probes (default: all)")
    a = p.parse_args()
    if a.peer_dies_rank is not None:
        return peer_dies_rank(a.peer_dies_rank, a.port, a.out)
    if a.child is not None:
        got = abort_cycles() if a.child == "abort_cycles" else missing_peer_alone()
        Path(a.out).write_text(json.dumps(got))
        os._exit(0)  # a group left formed must not hold the exit
    store_file = tempfile.NamedTemporaryFile(prefix="inproc-check-", delete=False).name
    store = dist.FileStore(store_file, -1)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "environment": environment()}
    print(f"environment: {json.dumps(out['environment'])}", flush=True)
    probes: dict[str, Callable[[], dict[str, Any]]] = {
        "one_rank_cycles": lambda: one_rank_cycles(store),
        "missing_peer": lambda: in_child("missing_peer", 30),
        "missing_peer_nonblocking": lambda: in_child("missing_peer_nonblocking", 30),
        "reattach": lambda: reattach(store),
        "peer_dies": peer_dies,
        "abort_variants": abort_variants}
    only = [n for n in a.only.split(",") if n]
    for name, fn in probes.items():
        if not only or name in only:
            probe(name, fn, out, a.out)
    os.unlink(store_file)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
