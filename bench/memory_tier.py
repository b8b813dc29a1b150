"""Memory tier benchmark: what a commit into ``/dev/shm`` costs the step, and how fast a
restore from it is (not a test; one process, no store server).

1. Cost at a commit every 10 steps, for the small GPT of ``examples/gpt.py`` with AdamW on
   CPU: the median training step (forward + backward + optimizer step on one small batch),
   the in-step stall of ``SegmentDir.begin`` (the one copy of every tensor of
   ``{"model": ..., "optimizer": ...}`` into the mapped data file) and the off-step
   ``finish`` (xxh3-128 digests, index, manifest). Steady state: the median over commits that
   recycled an older data file (from the third commit on); the first commit (a fresh file)
   is shown apart. Cost = stall / (10 x step time), goal <= 3%. For comparison: the durable
   path's snapshot (``split_state`` into the process's reused host buffers).
2. Restore of a 1 GiB state (``--state-mb`` of float32 in 8 tensors) into a model of the
   same shapes, GB/s (1 GB = 1e9 bytes): (a) memory tier ``read`` + ``join_state``,
   (b) (a) + ``load_state_dict``, (c) the durable path from a ``file://`` CheckpointManager
   on ``/dev/shm`` (``load_latest(decode=decode_file)`` + ``join_state``, xxh3-128 digests),
   (c') (c) + ``load_state_dict``, (d) the reference: a copy of the 1 GiB into fresh memory.
   Shown to explain (a): the plain read of the data file into fresh memory (what ``read``
   does before its digests) and xxh3-128 over 1 GiB in memory. Also the write stall per GB
   (``begin`` on 1 GiB, steady state) and ``finish`` per GB. Goal: restore >= 2 GB/s.

Everything on ``/dev/shm`` lives in one folder made for this run (``mkdtemp``), removed at
the end even on error; at most two 1 GiB data files exist at once (the memory tier's own
bound), and the segments are gone before the durable copy is written.

Usage: ``.venv/bin/python bench/memory_tier.py --repeats 7``; prints markdown tables with
the goal checks and writes ``bench/results/memory_tier.json`` (with the load average before
and after: the machine is shared, read the min-max with it).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from gpt import GPT, VOCAB, lm_loss  # noqa: E402

from hvd_resilient.checkpoint import CheckpointManager, to_buffer  # noqa: E402
from hvd_resilient.checkpoint.host_buffers import HostBufferPool, allocate  # noqa: E402
from hvd_resilient.checkpoint.memory import SegmentDir  # noqa: E402
from hvd_resilient.checkpoint.memory.segments import digest  # noqa: E402
from hvd_resilient.checkpoint.split import (  # noqa: E402
    INDEX_FILE,
    decode_file,
    join_state,
    split_state,
)

GB = 1e9
MB = 1e6
COMMIT_EVERY = 10
WARM_COMMITS = 2  # the first two commits write fresh files; the third recycles the first


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


class Samples:
    """Wall and CPU seconds (this process, every thread: what a contended machine changes
    least) of each measured thing, by name."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, key: str, wall: float, cpu: float) -> None:
        self.wall.setdefault(key, []).append(wall)
        self.cpu.setdefault(key, []).append(cpu)

    def timed(self, key: str | None, fn: Any, *a: Any, **kw: Any) -> Any:
        """``fn(*a, **kw)``, its times recorded under ``key`` (None: not recorded, a
        warm-up); the last times stay in ``last``."""
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(*a, **kw)
        self.last = (time.perf_counter() - t0, time.process_time() - c0)
        if key is not None:
            self.add(key, *self.last)
        return out

    def median(self, key: str) -> float:
        return median(self.wall[key])

    def report(self) -> dict[str, Any]:
        return {"wall": {k: spread(v) for k, v in self.wall.items()},
                "cpu": {k: spread(v) for k, v in self.cpu.items()},
                "samples_wall": self.wall, "samples_cpu": self.cpu}


class TimedPrepare:
    """Wraps ``SegmentDir._prepare`` (listing, free-space check, rename, ftruncate) to time
    that part of ``begin`` apart from the copy."""

    def __init__(self, d: SegmentDir) -> None:
        self.inner, self.seconds = d._prepare, 0.0
        d._prepare = self  # type: ignore[method-assign]

    def __call__(self, step: int, size: int) -> str:
        t0 = time.perf_counter()
        try:
            return self.inner(step, size)
        finally:
            self.seconds = time.perf_counter() - t0


# -- 1. tiny LM: stall of a commit every 10 steps ----------------------------------------------
def bench_lm(root: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(block=args.block, dim=args.dim, layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)

    def step(x: torch.Tensor) -> None:
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def batch() -> torch.Tensor:
        return torch.randint(0, VOCAB, (args.batch, args.block + 1), generator=gen)

    S = Samples()
    for _ in range(5):  # warm-up: allocator, AdamW state
        S.timed(None, step, batch())
    d = SegmentDir(root, "lm", "replicated")
    prep = TimedPrepare(d)
    snap_pool = HostBufferPool()
    first: dict[str, float] = {}
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    state_bytes = 0
    n_commits = WARM_COMMITS + args.lm_commits
    for c in range(n_commits):
        steady = c >= WARM_COMMITS
        interval = [0.0, 0.0]
        for _ in range(COMMIT_EVERY):
            S.timed("step" if steady else None, step, batch())
            interval = [interval[0] + S.last[0], interval[1] + S.last[1]]
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        pending = S.timed("stall" if steady else None, d.begin, (c + 1) * COMMIT_EVERY,
                          state, {"epoch": 0, "world_size": 1})
        stall = S.last
        if steady:
            S.add("prepare", prep.seconds, 0.0)
            # the stall against the 10 steps just before it: load hits both alike
            ratios["wall"].append(stall[0] / interval[0])
            ratios["cpu"].append(stall[1] / interval[1])
        info = S.timed("finish" if steady else None, d.finish, pending)
        fin = S.last[0]
        snap = S.timed("durable_snapshot" if steady else None, split_state, state,
                       buffers=snap_pool)
        del snap, state
        state_bytes = info.data_bytes
        if c == 0:
            first = {"stall": stall[0], "stall_cpu": stall[1], "prepare": prep.seconds,
                     "finish": fin, "interval": interval[0], "interval_cpu": interval[1]}
        print(f"# lm commit {c + 1}/{n_commits}: 10 steps {interval[0]:.2f} s, stall "
              f"{stall[0] * 1e3:.2f} ms, finish {fin * 1e3:.2f} ms", file=sys.stderr,
              flush=True)
    assert len(d.steps()) == 2, d.steps()
    # the newest commit restores bit-identical
    _, files = d.read(d.steps()[0])
    back = join_state(files)
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    del back, files
    d.remove()
    n_tensors = len(model.state_dict()) + sum(
        sum(isinstance(v, torch.Tensor) for v in st.values())
        for st in opt.state_dict()["state"].values())
    ten = COMMIT_EVERY * S.median("step")
    return {
        "params": params, "state_bytes": state_bytes, "tensors": n_tensors,
        "config": {"dim": args.dim, "layers": args.layers, "block": args.block,
                   "batch": args.batch, "commit_every": COMMIT_EVERY,
                   "steady_commits": args.lm_commits},
        **S.report(),
        "first_commit": first,
        "cost": spread(ratios["wall"]),
        "cost_cpu": spread(ratios["cpu"]),
        "cost_of_medians": S.median("stall") / ten,
        "first_cost": first["stall"] / first["interval"],
        "finish_share": S.median("finish") / ten,
        "durable_snapshot_cost": S.median("durable_snapshot") / ten,
    }


# -- 2. 1 GiB: write stall, restore GB/s -----------------------------------------------------
class Big(nn.Module):
    def __init__(self, shapes: list[int]) -> None:
        super().__init__()
        for i, n in enumerate(shapes):
            self.register_parameter(f"w{i}", nn.Parameter(torch.zeros(n)))


def _fresh(nbytes: int, huge: bool = False) -> Any:
    """Fresh process memory as ``read`` allocates it (``host_buffers.allocate``), optionally
    with ``MADV_HUGEPAGE`` (2 MB pages where THP is ``madvise``, as here)."""
    buf = allocate(nbytes)
    if huge:
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _read_file(path: str, buf: Any) -> None:
    with open(path, "rb", buffering=0) as f:
        assert f.readinto(memoryview(buf)) == len(buf)


def _copy_into(buf: Any, tensors: list[torch.Tensor]) -> None:
    """Every tensor into ``buf``, back to back (the raw copy of the reference)."""
    pos = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos).view(t.dtype).copy_(t)
        pos += n


def _read_fresh(path: str, nbytes: int, huge: bool) -> Any:
    buf = _fresh(nbytes, huge)
    _read_file(path, buf)
    return buf


def _fault_in(nbytes: int) -> Any:
    """Fresh memory touched once per 4 KB page: the page faults alone."""
    buf = _fresh(nbytes)
    torch.frombuffer(buf, dtype=torch.uint8)[::4096].fill_(1)
    return buf


def _copy_fresh(tensors: list[torch.Tensor], nbytes: int, huge: bool) -> Any:
    buf = _fresh(nbytes, huge)
    _copy_into(buf, tensors)
    return buf


def _copy_into_file(path: str, tensors: list[torch.Tensor], populate: bool) -> None:
    """What ``begin`` does to a recycled data file (a new shared mapping, then the copy),
    with or without ``MAP_POPULATE`` (the page tables filled in one go by the kernel)."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size, flags=flags)
    try:
        _copy_into(m, tensors)
    finally:
        m.close()


def restore_child(root: str, step: int, shapes: list[int], mode: str) -> None:
    """A restart's restore: the first read of a process that has just started (its memory is
    fresh to it, which a benchmark loop inside one process never sees again). ``mode``:
    ``all`` (every core, as ``read`` does), ``one`` (one thread), ``raw`` (the reference: the
    data file read into fresh memory on every core, nothing verified or built). Prints the
    times of read, join and ``load_state_dict`` into a model built beforehand, as JSON."""
    from hvd_resilient.checkpoint.memory import segments

    if mode == "one":
        segments._read_threads = lambda: 1  # type: ignore[assignment]
    target = Big(shapes)
    d = SegmentDir(root, "big", "replicated")
    S = Samples()
    if mode == "raw":
        S.timed("fresh_raw_read", segments._read_whole, d.file(step, ".data"))
    else:
        _, files = S.timed("fresh_read", d.read, step)
        sd = S.timed("fresh_join", join_state, files)
        S.timed("fresh_load_state_dict", target.load_state_dict, sd)
    print(json.dumps({k: [S.wall[k][0], S.cpu[k][0]] for k in S.wall}))


def _restart_restore(root: str, step: int, shapes: list[int], mode: str
                     ) -> dict[str, list[float]]:
    out = subprocess.run([sys.executable, __file__, "--restore-child", root, str(step),
                          ",".join(map(str, shapes)), mode],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_restore(root: str, args: argparse.Namespace) -> dict[str, Any]:
    n_total = int(args.state_mb * (1 << 20)) // 4
    shapes = [n_total // 8] * 8
    torch.manual_seed(0)
    src = Big(shapes)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_()
    state = src.state_dict()
    tensors = list(state.values())
    nbytes = sum(t.numel() * 4 for t in tensors)
    target = Big(shapes)  # a freshly built model: its parameters are touched memory
    r = args.repeats
    S = Samples()
    timed = S.timed
    first: dict[str, float] = {}
    label = f"{nbytes / GB:.2f} GB"

    # writes: 2 fresh files, then steady state (recycled); at most 2 data files on /dev/shm
    d = SegmentDir(root, "big", "replicated")
    prep = TimedPrepare(d)
    for c in range(WARM_COMMITS + r):
        steady = c >= WARM_COMMITS
        pending = timed("begin" if steady else None, d.begin, c + 1, state, {})
        stall = S.last
        timed("finish" if steady else None, d.finish, pending)
        fin = S.last[0]
        if c == 0:
            first = {"begin": stall[0], "begin_cpu": stall[1], "begin_prepare": prep.seconds,
                     "finish": fin}
        if steady:
            S.add("begin_prepare", prep.seconds, 0.0)
        print(f"# {label} commit {c + 1}/{WARM_COMMITS + r}: begin {stall[0]:.3f} s, finish "
              f"{fin:.3f} s", file=sys.stderr, flush=True)
    newest = d.steps()[0]
    data_path = d.file(newest, ".data")
    seg_bytes = os.path.getsize(data_path)
    touched = _fresh(seg_bytes)
    torch.frombuffer(touched, dtype=torch.uint8).fill_(0)

    for i in range(r):  # every variant once per repeat: the load of the machine hits all
        # (a), (b): memory tier
        _, files = timed("read", d.read, newest)
        sd = timed("join", join_state, files)
        timed("load_state_dict", target.load_state_dict, sd)
        if i == 0:
            assert all(torch.equal(sd[k], v) for k, v in state.items())
            assert all(torch.equal(p, state[k]) for k, p in target.state_dict().items())
            with torch.no_grad():
                for p in target.parameters():
                    p.zero_()
        del sd, files
        # what read() is made of: the file into fresh memory, the digests; and the variants
        buf = _fresh(seg_bytes)
        timed("file_read_fresh", _read_file, data_path, buf)
        timed("xxh3", digest, buf)
        del buf
        timed("file_read_touched", _read_file, data_path, touched)
        # each fresh buffer lives past its timing: freeing 1 GiB is not part of a restore
        buf = timed("file_read_fresh_huge", _read_fresh, data_path, seg_bytes, True)
        buf = timed("fault_in_fresh", _fault_in, seg_bytes)
        # (d): the reference copies
        buf = timed("raw_copy_fresh", _copy_fresh, tensors, nbytes, False)
        timed("raw_copy_touched", _copy_into, touched, tensors)
        buf = timed("raw_copy_fresh_huge", _copy_fresh, tensors, nbytes, True)
        del buf
        w = {k: v[-1] for k, v in S.wall.items()}
        print(f"# {label} restore {i + 1}/{r}: read {w['read']:.3f} s, join "
              f"{w['join']:.4f} s, load_state_dict {w['load_state_dict']:.3f} s, "
              f"raw copy {w['raw_copy_fresh']:.3f} s", file=sys.stderr, flush=True)
    # (e): a restart's restore, in a process of its own: read on every core (as ``read`` does),
    # and on one thread (what it did before)
    for i in range(r):
        for mode, suffix in (("all", ""), ("one", "_1thread"), ("raw", "")):
            got = _restart_restore(root, newest, shapes, mode)
            for key, (wall, cpu) in got.items():
                S.add(key + suffix, wall, cpu)
        print(f"# {label} restart restore {i + 1}/{r}: read "
              f"{S.wall['fresh_read'][-1]:.3f} s (one thread "
              f"{S.wall['fresh_read_1thread'][-1]:.3f} s, raw "
              f"{S.wall['fresh_raw_read'][-1]:.3f} s)", file=sys.stderr, flush=True)
    # the write into a recycled file as begin does it, and with MAP_POPULATE (this garbles
    # the newest segment's bytes: it is removed right after)
    for _ in range(r):
        timed("write_mapped_file", _copy_into_file, data_path, tensors, False)
        timed("write_mapped_file_populate", _copy_into_file, data_path, tensors, True)
    del touched
    d.remove()  # the segments go before the durable copy is written: /dev/shm stays bounded

    # (c): the durable path, file:// on /dev/shm, written the way DurableCheckpoints writes
    durable_dir = os.path.join(root, "durable")
    mgr = CheckpointManager(Path(durable_dir).as_uri(), keep_last=0)
    files = split_state(state, buffers=HostBufferPool(enabled=False))
    files[INDEX_FILE] = to_buffer(files[INDEX_FILE])
    mgr.save(1, 0, 1, files)
    del files
    for i in range(r):
        found = timed("durable_load", mgr.load_latest, decode=decode_file)
        assert found is not None
        sd = timed("durable_join", join_state, found[1])
        timed("durable_load_state_dict", target.load_state_dict, sd)
        if i == 0:
            assert all(torch.equal(sd[k], v) for k, v in state.items())
        del sd, found
        print(f"# {label} durable restore {i + 1}/{r}: load_latest "
              f"{S.wall['durable_load'][-1]:.3f} s", file=sys.stderr, flush=True)
    shutil.rmtree(durable_dir, ignore_errors=True)

    gbs = nbytes / GB
    s = S.wall

    def rate(*keys: str) -> dict[str, float]:
        tot = [sum(v) for v in zip(*(s[k] for k in keys), strict=True)]
        return {"median": gbs / median(tot), "min": gbs / max(tot), "max": gbs / min(tot)}

    def cpu_rate(*keys: str) -> float:
        return gbs / median([sum(v) for v in zip(*(S.cpu[k] for k in keys), strict=True)])

    def per_gb(key: str) -> dict[str, float]:
        return {"median": median(s[key]) / gbs, "min": min(s[key]) / gbs,
                "max": max(s[key]) / gbs, "cpu_median": median(S.cpu[key]) / gbs}

    paths = {
        "a_memory_read_join": ("read", "join"),
        "b_memory_read_join_load": ("read", "join", "load_state_dict"),
        "c_durable_load_join": ("durable_load", "durable_join"),
        "c_durable_load_join_load": ("durable_load", "durable_join",
                                     "durable_load_state_dict"),
        "d_raw_copy_fresh": ("raw_copy_fresh",),
        "e_restart_read_join": ("fresh_read", "fresh_join"),
        "e_restart_read_join_load": ("fresh_read", "fresh_join", "fresh_load_state_dict"),
        "e_restart_read_join_1thread": ("fresh_read_1thread", "fresh_join_1thread"),
        "e_restart_raw_read": ("fresh_raw_read",),
        **{k: (k,) for k in ("raw_copy_touched", "raw_copy_fresh_huge", "fault_in_fresh",
                             "file_read_fresh", "file_read_touched", "file_read_fresh_huge",
                             "xxh3", "load_state_dict")},
    }
    return {
        "state_bytes": nbytes, "segment_bytes": seg_bytes, "tensors": len(shapes),
        **S.report(),
        "first_commit": first,
        "gbps": {k: rate(*keys) for k, keys in paths.items()},
        "gb_per_cpu_second": {k: cpu_rate(*keys) for k, keys in paths.items()},
        "s_per_gb": {k: per_gb(k) for k in ("begin", "begin_prepare", "finish",
                                            "write_mapped_file", "write_mapped_file_populate",
                                            "raw_copy_touched")},
        "first_begin_s_per_gb": first["begin"] / gbs,
    }


# -- report ----------------------------------------------------------------------------------
def _ms(x: dict[str, float]) -> str:
    return f"{x['median'] * 1e3:.2f} ({x['min'] * 1e3:.2f}-{x['max'] * 1e3:.2f})"


def _rate(x: dict[str, float]) -> str:
    return f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"


def _pct(x: dict[str, float]) -> str:
    return f"{100 * x['median']:.2f}% ({100 * x['min']:.2f}-{100 * x['max']:.2f})"


def tables(lm: dict[str, Any], big: dict[str, Any]) -> str:
    w, c, first, cfg = lm["wall"], lm["cpu"], lm["first_commit"], lm["config"]

    def cpu_ms(k: str) -> str:
        return f"{c[k]['median'] * 1e3:.2f}"

    rows = [
        f"### 1. Commit every {COMMIT_EVERY} steps: GPT of examples/gpt.py, dim {cfg['dim']}, "
        f"{cfg['layers']} layers, {lm['params'] / 1e6:.2f} M params, AdamW, batch "
        f"{cfg['batch']}x{cfg['block']} tokens, CPU; state {lm['state_bytes'] / MB:.1f} MB "
        f"in {lm['tensors']} tensors; median (min-max) over {w['stall']['n']} steady commits",
        "",
        "| what | wall ms | CPU ms | share of the 10 steps before it: wall (CPU) |",
        "| --- | --- | --- | --- |",
        f"| training step | {_ms(w['step'])} | {cpu_ms('step')} | |",
        f"| **in-step stall: `begin`**, steady (recycled file) | {_ms(w['stall'])} "
        f"| {cpu_ms('stall')} | **{_pct(lm['cost'])}** ({100 * lm['cost_cpu']['median']:.2f}%)"
        f" |",
        f"| of which `_prepare` (listing, space check, rename, ftruncate) "
        f"| {_ms(w['prepare'])} | | |",
        f"| first commit's stall (fresh file) | {first['stall'] * 1e3:.2f} "
        f"| {first['stall_cpu'] * 1e3:.2f} | {100 * first['stall'] / first['interval']:.2f}% "
        f"({100 * first['stall_cpu'] / first['interval_cpu']:.2f}%) |",
        f"| off-step `finish` (xxh3, index, manifest) | {_ms(w['finish'])} "
        f"| {cpu_ms('finish')} | {100 * lm['finish_share']:.2f}% (off the step) |",
        f"| for comparison: durable snapshot (`split_state` into reused buffers) "
        f"| {_ms(w['durable_snapshot'])} | {cpu_ms('durable_snapshot')} "
        f"| {100 * lm['durable_snapshot_cost']:.2f}% |",
        "",
    ]
    s, g, gc, pg = big["wall"], big["gbps"], big["gb_per_cpu_second"], big["s_per_gb"]
    size = f"{big['state_bytes'] / GB:.2f} GB"

    def sec_of(*keys: str) -> str:
        return f"{sum(s[k]['median'] for k in keys):.3f}"

    def line(what: str, key: str, *keys: str, bold: bool = False) -> str:
        r = f"**{_rate(g[key])}**" if bold else _rate(g[key])
        return f"| {what} | {r} | {sec_of(*keys)} | {gc[key]:.2f} |"

    def per_gb(key: str, bold: bool = False) -> str:
        x = pg[key]
        r = f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})"
        return f"{'**' + r + '**' if bold else r} | {x['cpu_median']:.3f}"

    rows += [
        f"### 2. Restore of a {size} state ({big['tensors']} float32 tensors) into a model of "
        f"the same shapes; median (min-max) of {s['read']['n']}",
        "",
        "| path | GB/s | median s | GB per CPU s |",
        "| --- | --- | --- | --- |",
        line("(a) memory tier `read` + `join_state`", "a_memory_read_join", "read", "join",
             bold=True),
        line("(b) (a) + `load_state_dict`", "b_memory_read_join_load", "read", "join",
             "load_state_dict", bold=True),
        line("(c) durable `file://` on /dev/shm: `load_latest` (xxh3) + `join_state`",
             "c_durable_load_join", "durable_load", "durable_join"),
        line("(c') (c) + `load_state_dict`", "c_durable_load_join_load", "durable_load",
             "durable_join", "durable_load_state_dict"),
        line("**(e) a restart's restore**: (a) as the first read of a new process (every core)",
             "e_restart_read_join", "fresh_read", "fresh_join", bold=True),
        line("(e') (e) + `load_state_dict`", "e_restart_read_join_load", "fresh_read",
             "fresh_join", "fresh_load_state_dict"),
        line("what if: (e) on one thread", "e_restart_read_join_1thread", "fresh_read_1thread",
             "fresh_join_1thread"),
        line("(e'') reference: the data file read into a new process's fresh memory (every "
             "core, nothing verified)", "e_restart_raw_read", "fresh_raw_read"),
        line("(d) reference: copy into fresh memory (4 KB pages, as `read` allocates)",
             "d_raw_copy_fresh", "raw_copy_fresh"),
        line("copy into fresh memory with MADV_HUGEPAGE", "raw_copy_fresh_huge",
             "raw_copy_fresh_huge"),
        line("copy into touched memory", "raw_copy_touched", "raw_copy_touched"),
        line("inside (a): plain read of the data file into fresh memory", "file_read_fresh",
             "file_read_fresh"),
        line("inside (a): xxh3-128 over the bytes in memory", "xxh3", "xxh3"),
        line("inside (a): page faults alone (fresh memory, one write per 4 KB page)",
             "fault_in_fresh", "fault_in_fresh"),
        line("what if: the read into touched memory", "file_read_touched",
             "file_read_touched"),
        line("what if: the read into fresh memory with MADV_HUGEPAGE",
             "file_read_fresh_huge", "file_read_fresh_huge"),
        line("inside (b): `load_state_dict` alone", "load_state_dict", "load_state_dict"),
        "",
        f"| write of the {size} state | wall s per GB | CPU s per GB |",
        "| --- | --- | --- |",
        f"| in-step stall `begin`, steady (recycled file) | {per_gb('begin', True)} |",
        f"| of which `_prepare` | {per_gb('begin_prepare')} |",
        f"| first `begin` (fresh file) | {big['first_begin_s_per_gb']:.3f} "
        f"| {big['first_commit']['begin_cpu'] / (big['state_bytes'] / GB):.3f} |",
        f"| off-step `finish` | {per_gb('finish')} |",
        f"| what if: the copy into a new mapping of the recycled file, as `begin` maps it "
        f"| {per_gb('write_mapped_file')} |",
        f"| what if: the same with MAP_POPULATE | {per_gb('write_mapped_file_populate')} |",
        f"| for comparison: copy into touched process memory | {per_gb('raw_copy_touched')} |",
        "",
    ]
    checks = [
        (f"commit cost (stall / the {COMMIT_EVERY} steps before it)", lm["cost"]["median"],
         "<=", 0.03, True),
        ("restore (a) read + join_state GB/s", g["a_memory_read_join"]["median"], ">=", 2.0,
         False),
        ("restore (b) + load_state_dict GB/s", g["b_memory_read_join_load"]["median"], ">=",
         2.0, False),
        ("a restart's restore (e) read + join_state GB/s", g["e_restart_read_join"]["median"],
         ">=", 2.0, False),
    ]
    for what, v, op, bound, pct in checks:
        ok = v <= bound if op == "<=" else v >= bound
        val, b = (f"{100 * v:.2f}%", f"{100 * bound:.0f}%") if pct else (f"{v:.2f}", bound)
        rows.append(f"- {what} = {val} (goal {op} {b}): {'met' if ok else 'NOT met'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="1 GiB writes and restores")
    p.add_argument("--lm-commits", type=int, default=10, help="steady-state LM commits")
    p.add_argument("--state-mb", type=float, default=1024, help="restore state, MiB")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory_tier.json"))
    p.add_argument("--restore-child", nargs=4, metavar=("ROOT", "STEP", "SHAPES", "MODE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restore_child:
        root, step, shapes, mode = args.restore_child
        restore_child(root, int(step), [int(n) for n in shapes.split(",")], mode)
        return 0
    if args.repeats < 5 or args.lm_commits < 5:
        p.error("take medians of at least 5 repeats")
    load_before = os.getloadavg()
    print(f"# load average before: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}", file=sys.stderr)
    t_start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="hvd-memory-tier-bench-", dir=args.shm)
    try:
        lm = bench_lm(root, args)
        big = bench_restore(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t_start
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    doc: dict[str, Any] = {
        "command": " ".join(["python bench/memory_tier.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "wall_seconds": wall,
        "goals": {"commit_cost <= 0.03": lm["cost"]["median"] <= 0.03,
                  "restore_read_join_gbps >= 2": big["gbps"]["a_memory_read_join"]["median"]
                  >= 2.0,
                  "restart_restore_read_join_gbps >= 2":
                      big["gbps"]["e_restart_read_join"]["median"] >= 2.0,
                  "restore_with_load_state_dict_gbps >= 2":
                      big["gbps"]["b_memory_read_join_load"]["median"] >= 2.0},
        "lm": lm, "restore_1gb": big,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp_out, out)
    print(tables(lm, big))
    print(f"\nwall {wall:.0f} s; load average after: {doc['loadavg_after'][0]:.2f}")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
