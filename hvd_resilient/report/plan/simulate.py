"""The discrete-event simulation, and the search for the commit and checkpoint intervals.

Why it is fast: what happens to a job splits into two parts. *When* it trains and when it is
down depends only on the failures and the strategy (detection, recovery, restarts, hosts
leaving and joining), not on how often it commits or checkpoints. So a pure-Python pass over
the failures of one seed builds a timeline of "stretches" (training from a resume point until
the next failure, join or the horizon, and how that stretch ends). *How much* of each stretch
is kept depends on the intervals, and has a closed form per stretch; a numpy loop over the
stretches evaluates every seed and every candidate (commit interval, checkpoint interval) at
once. All candidates see the same failures (common random numbers), so comparing them is not
drowned in seed-to-seed noise.

Model (times in seconds, work in seconds of training at full size):

* failures of each class arrive as a Poisson process at rate x GPUs (or at given times);
* a stretch trains in cycles: ``c`` seconds of steps, then a commit stall; every ``m``-th
  commit is followed by a durable checkpoint stall, and that checkpoint becomes usable
  ``upload`` seconds after its stall (a blocking save: at once);
* how a stretch ends: elastic (work since the last commit is redone), restart (work since the
  newest *uploaded* durable checkpoint is redone), graceful (committed at the boundary) or the
  horizon (committed, unless the job is killed there);
* a job short of hosts trains at reduced capacity (`Job.capacity`);
* ETTR = work kept / horizon. Lost time is split into causes that add up to the horizon.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hvd_resilient.errors import ConfigError
from hvd_resilient.report.checkpoints import daly_interval, young_interval
from hvd_resilient.report.plan.model import CLASSES, Inputs, Job
from hvd_resilient.report.plan.strategies import (
    ELASTIC,
    GRACEFUL,
    GRACEFUL_RESTART,
    KIND_NAMES,
    RESTART,
    STRATEGIES,
    Strategy,
    build,
    restart_rate,
)

logger = logging.getLogger(__name__)

END, STOP = 5, 6
"""Stretch ends besides the strategy paths: the horizon, and a job that ended for good."""
CAUSES = ("startup", "detect", "recover", "restart", "join", "rework", "uncommitted", "shrunk",
          "commit", "checkpoint")
"""Where lost time goes. detect: fault -> noticed; recover: in-process reset/sync or a graceful
leave; restart: whole-job relaunch + restore (and a blocking save on notice); join: stalls when
hosts come back; rework: work redone after a rollback; uncommitted: work after the last commit
when the job is killed at the horizon; shrunk: capacity missing while short of hosts;
commit/checkpoint: stalls of in-memory commits and durable checkpoints."""
_C = {c: i for i, c in enumerate(CAUSES)}
NO_CLASS = len(CLASSES)


@dataclass
class Timeline:
    """One seed's stretches and the downtime between them (interval-independent)."""

    a: np.ndarray
    b: np.ndarray
    cap: np.ndarray
    kind: np.ndarray
    cls: np.ndarray
    down: np.ndarray
    """[class (+ one row for no class), cause] seconds of downtime inside the horizon."""
    failures: np.ndarray
    """Failures per class that hit the job inside the horizon."""
    restarts: int


def _pick(samples: tuple[float, ...], r: np.ndarray) -> np.ndarray:
    """One value per draw in [0, 1): measured samples drawn uniformly (bootstrap)."""
    arr = np.asarray(samples, dtype=float)
    return arr[np.minimum((r * len(arr)).astype(np.int64), len(arr) - 1)]


def build_timeline(st: Strategy, job: Job, inp: Inputs, rng: np.random.Generator,
                   times: np.ndarray | None = None) -> Timeline:
    """The stretches of one seed: failures (Poisson, or `times` of class `job.fault_class`),
    then a walk that applies the strategy's path for each, tracking hosts out and back.
    Per-failure draws are made up front with numpy; the walk itself is plain Python over
    floats (scalar numpy indexing would cost more than the arithmetic)."""
    horizon = job.horizon_s
    ncls, ncause = len(CLASSES), len(CAUSES)
    if times is None:
        rates = inp.rates_per_gpu_s()
        lam = np.array([rates[c] for c in CLASSES]) * job.gpus
        total = float(lam.sum())
        n = int(rng.poisson(total * horizon)) if total > 0 else 0
        times = np.sort(rng.uniform(0.0, horizon, n))
        classes = rng.choice(ncls, n, p=lam / total) if n else np.zeros(0, dtype=np.int64)
    else:
        times = np.sort(np.asarray(times, dtype=float))
        n = len(times)
        classes = np.full(n, CLASSES.index(job.fault_class), dtype=np.int64)
    r = rng.random((n, 3))
    det, rec = np.zeros(n), np.zeros(n)
    kinds, rejoin = np.zeros(n, dtype=np.int64), np.full(n, math.inf)
    for j, c in enumerate(CLASSES):
        sel = classes == j
        if sel.any():
            path = st.paths[c]
            det[sel] = _pick(path.detect, r[sel, 0])
            rec[sel] = _pick(path.recover, r[sel, 1])
            kinds[sel] = path.kind
            rejoin[sel] = path.rejoin_s
    giveup = (kinds == ELASTIC) & (r[:, 2] < st.giveup)
    restart_rec = _pick(st.restart, r[:, 1]) if n else np.zeros(0)
    join_stalls = _pick(st.join_stall, rng.random(n + 1)).tolist()
    t_l, c_l, k_l = times.tolist(), classes.tolist(), kinds.tolist()
    d_l, r_l, j_l = det.tolist(), rec.tolist(), rejoin.tolist()
    g_l, rr_l = giveup.tolist(), restart_rec.tolist()

    hosts, host_gpus = job.hosts, job.host_gpus
    replicas = max(1, hosts // job.hosts_per_replica)
    table = inp.capacity_by_size if job.capacity == "measured" else {}
    flat = job.capacity == "time"
    caps: dict[int, float] = {}

    def capacity(missing: int) -> float:
        v = caps.get(missing)
        if v is None:
            size = (hosts - missing) * host_gpus
            lost = min(replicas, missing)
            if missing >= hosts or lost >= replicas:
                v = 0.0
            elif size in table:
                v = table[size]
            else:
                v = 1.0 if flat else (replicas - lost) / replicas
            caps[missing] = v
        return v

    down = [0.0] * ((ncls + 1) * ncause)
    DET, REC, RST, JOIN = _C["detect"], _C["recover"], _C["restart"], _C["join"]

    def add(cls: int, cause: int, t0: float, t1: float) -> None:
        t1 = t1 if t1 < horizon else horizon
        if t1 > t0:
            down[cls * ncause + cause] += t1 - t0

    stretches: list[tuple[float, float, float, int, int]] = []
    failures = [0] * ncls
    restarts = 0
    t_free = 0.0
    if job.include_startup:
        startup = max(0.0, st.restart[0] - inp["restore_s"] - inp["restart_overhead_s"])
        add(NO_CLASS, _C["startup"], 0.0, startup)
        t_free = startup
    a = t_free
    missing = 0
    joins: list[tuple[float, int]] = []
    in_elastic_recovery = False
    i = nj = 0
    inf = math.inf
    while t_free < horizon:
        tf = t_l[i] if i < n else inf
        tj = joins[0][0] if joins else inf
        if tj <= tf:  # a host (or its replacement) is back
            if tj >= horizon:
                break
            _, jcls = heapq.heappop(joins)
            missing -= 1
            if tj < t_free:
                continue  # it joins at the reset in progress, at no extra cost
            stretches.append((a, tj, capacity(missing + 1), GRACEFUL, NO_CLASS))
            stall = join_stalls[nj % len(join_stalls)]
            nj += 1
            add(jcls, JOIN, tj, tj + stall)
            t_free = a = tj + stall
            in_elastic_recovery = False
            continue
        e = tf
        if e >= horizon:
            break
        c, kind, d, rc, rj = c_l[i], k_l[i], d_l[i], r_l[i], j_l[i]
        if kind == ELASTIC and (g_l[i] or capacity(missing + 1) <= 0.0):
            kind, rc = RESTART, rr_l[i]
        overlap = e < t_free
        if overlap and kind == ELASTIC and st.escalate_overlap and in_elastic_recovery:
            kind, rc = RESTART, rr_l[i]
        i += 1
        failures[c] += 1
        if kind == RESTART and not st.restartable:
            kind = STOP
        if overlap:  # the job is down already: only what this failure adds is its cost
            if kind == ELASTIC:
                new_free = max(t_free, e + d + rc)
                add(c, REC, t_free, new_free)
                t_free = a = new_free
                missing += 1
                if rj < inf:
                    heapq.heappush(joins, (e + rj, c))
                in_elastic_recovery = True
            elif kind == RESTART or kind == STOP:
                stretches.append((e, e, capacity(missing), kind, c))  # back to the durable one
                new_free = inf if kind == STOP else max(t_free, e + d + rc)
                add(c, RST, t_free, new_free)
                t_free = a = new_free
                missing, joins = 0, []
                restarts += 1
                in_elastic_recovery = False
            elif kind == GRACEFUL:
                missing += 1
                if rj < inf:
                    heapq.heappush(joins, (e + rj, c))
            continue
        stretches.append((a, e, capacity(missing), kind, c))
        if kind == STOP:
            add(c, DET, e, inf)
            t_free = inf
            break
        if kind == ELASTIC or kind == GRACEFUL:
            if kind == ELASTIC:
                add(c, DET, e, e + d)
            add(c, REC, e + d, e + d + rc)
            missing += 1
            if rj < inf:
                heapq.heappush(joins, (e + rj, c))
            in_elastic_recovery = kind == ELASTIC
        else:  # RESTART, GRACEFUL_RESTART: the whole job again, on spares
            add(c, DET, e, e + d)
            add(c, RST, e + d, e + d + rc)
            missing, joins = 0, []
            restarts += 1
            in_elastic_recovery = False
        t_free = a = e + d + rc
    if t_free < horizon:
        stretches.append((a, horizon, capacity(missing), END, NO_CLASS))
    arr = np.array(stretches, dtype=float).reshape(-1, 5)
    return Timeline(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3].astype(np.int8),
                    arr[:, 4].astype(np.int64), np.array(down).reshape(ncls + 1, ncause),
                    np.array(failures, dtype=float), restarts)


@dataclass
class Evaluation:
    """Per seed and candidate: work kept and lost time by cause (and rework by class)."""

    work: np.ndarray  # (S, G)
    lost: np.ndarray  # (causes, S, G), stretch-side causes only
    rework_by_class: np.ndarray  # (classes + 1, S, G)


def evaluate(tls: list[Timeline], st: Strategy, job: Job, commit_every: np.ndarray,
             every_m: np.ndarray) -> Evaluation:
    """Work kept for every seed (timeline) and every candidate: commit every `commit_every`
    seconds of training, a durable checkpoint every `every_m` commits (both 1-D, paired)."""
    S, G = len(tls), len(commit_every)
    K = max((len(t.a) for t in tls), default=0)
    A, B, CAP = np.zeros((K, S, 1)), np.zeros((K, S, 1)), np.zeros((K, S, 1))
    KIND = np.zeros((K, S, 1), dtype=np.int8)
    CLS = np.full((K, S), NO_CLASS, dtype=np.int64)
    for s, t in enumerate(tls):
        n = len(t.a)
        A[:n, s, 0], B[:n, s, 0], CAP[:n, s, 0] = t.a, t.b, t.cap
        KIND[:n, s, 0], CLS[:n, s] = t.kind, t.cls
    # how each stretch ends, as 0/1 factors (cheaper than np.where in the loop)
    final = job.final_commit
    restart_f = (KIND == RESTART).astype(float)
    settled = (KIND == RESTART) | (KIND == GRACEFUL_RESTART)
    settled_f = settled.astype(float)
    gr_restart = KIND == GRACEFUL_RESTART
    keep_f = ((KIND == GRACEFUL) | gr_restart | ((KIND == END) & final)).astype(float)
    redo_f = ((KIND == ELASTIC) | (KIND == STOP) | (KIND == RESTART)).astype(float)
    lost_tail_f = ((KIND == END) & (not final)).astype(float)
    active = (KIND != 0).any(axis=(1, 2))
    c = np.asarray(commit_every, dtype=float)[None, :]
    m = np.asarray(every_m, dtype=float)[None, :]
    sc, sd, up = st.commit_s, st.ckpt_stall_s, st.ckpt_upload_s
    cyc = c + sc
    L = m * cyc + sd
    W = np.zeros((S, G))
    Wd = np.zeros((S, G))
    Wp = np.zeros((S, G))
    tp = np.full((S, G), np.inf)
    p = np.zeros((S, G))
    shrunk = np.zeros((S, 1))
    commit = np.zeros((S, G))
    ckpt = np.zeros((S, G))
    redo_all = np.zeros((S, G))
    uncommitted = np.zeros((S, G))
    by_cls = np.zeros((len(CLASSES) + 1, S, G))
    seeds = np.arange(S)
    for k in np.flatnonzero(active):
        a, b, cap = A[k], B[k], CAP[k]
        tau = b - a
        # commits done in the stretch: shift the start back by the p commits made since the
        # last durable checkpoint, so cycles of (m commits + one checkpoint stall) line up
        pc = p * cyc
        taup = tau + pc
        q = np.floor(taup / L)
        ip = q * m + np.minimum(m, np.floor((taup - q * L) / cyc))
        i = np.maximum(ip - p, 0.0)
        ip = i + p
        some = i > 0
        J = np.floor(ip / m)
        end_i = (ip * cyc + sd * np.floor((ip - 1) / m) - pc) * some
        dur_after = some & (ip == J * m)
        tail = tau - end_i
        tail_after = tail - np.minimum(tail, sd) * dur_after
        tail_train = np.minimum(c, tail_after)
        commit_stall = i * sc + np.maximum(tail_after - c, 0.0)
        # durable checkpoints: the j-th of the stretch is usable at j*L - pc + upload
        J = J - (dur_after & (tail < sd))  # its stall was cut short: never written
        j_ready = np.maximum(np.minimum(J, np.floor((taup - up) / L)), 0.0)
        old_ready = tp <= b
        Wd = np.where(old_ready, np.maximum(Wd, Wp), Wd)
        ready_now = j_ready >= 1
        Wd = np.where(ready_now, W + (j_ready * m - p) * c * cap, Wd)
        pending = J > j_ready
        Wp = np.where(pending, W + (J * m - p) * c * cap, Wp)
        tp = np.where(pending, a + J * L - pc + up, np.where(ready_now | old_ready, np.inf, tp))
        # how the stretch ends
        tail_w = tail_train * cap
        new_w = W + i * c * cap + keep_f[k] * tail_w
        redo = redo_f[k] * tail_w
        if restart_f[k].any():
            rf = restart_f[k]
            redo = redo + rf * np.maximum(new_w - Wd, 0.0)
            new_w = new_w - rf * np.maximum(new_w - Wd, 0.0)
        if settled[k].any():
            Wd = np.where(gr_restart[k], new_w, Wd)
            tp = np.where(settled[k], np.inf, tp)
            p = np.mod(ip, m) * (1.0 - settled_f[k])
        else:
            p = np.mod(ip, m)
        W = new_w
        shrunk += tau * (1.0 - cap)
        commit += commit_stall * cap
        ckpt += (tau - i * c - tail_train - commit_stall) * cap
        redo_all += redo
        if not final:
            uncommitted += lost_tail_f[k] * tail_w
        by_cls[CLS[k], seeds] += redo
    lost = np.zeros((len(CAUSES), S, G))
    lost[_C["shrunk"]] = shrunk
    lost[_C["commit"]] = commit
    lost[_C["checkpoint"]] = ckpt
    lost[_C["rework"]] = redo_all
    lost[_C["uncommitted"]] = uncommitted
    return Evaluation(W, lost, by_cls)


# -- the search ---------------------------------------------------------------------------------


@dataclass
class Result:
    """One strategy's plan."""

    strategy: str
    title: str
    ettr_mean: float
    ettr_sd: float
    ettr_min: float
    ettr_max: float
    commit_every_s: float | None
    checkpoint_every_s: float
    searched: bool
    lost_by_cause: dict[str, float]
    """Share of the horizon (mean over seeds); adds up to 1 - ETTR."""
    lost_by_class: dict[str, float]
    """Downtime, rework and join stalls each failure class caused (share of the horizon)."""
    failures_per_day: dict[str, float]
    restarts_per_day: float
    young_daly: dict[str, Any]
    paths: dict[str, str]
    ettr_by_seed: list[float] = field(default_factory=list)


@dataclass
class Plan:
    job: Job
    inputs: Inputs
    results: list[Result]
    scale: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    scale_seeds: int = 0

    def result(self, name: str) -> Result:
        return next(r for r in self.results if r.strategy == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": asdict(self.job) | {"hosts": self.job.hosts, "fault_times": None},
            "inputs": self.inputs.describe(),
            "capacity_by_size": self.inputs.capacity_by_size or None,
            "notes": self.inputs.notes,
            "results": [{k: v for k, v in asdict(r).items() if k != "ettr_by_seed"}
                        | {"ettr_by_seed": [round(x, 6) for x in r.ettr_by_seed]}
                        for r in self.results],
            "scale": self.scale, "scale_seeds": self.scale_seeds,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _geo(lo: float, hi: float, n: int) -> np.ndarray:
    if hi <= lo * 1.0001:
        return np.array([lo])
    return np.geomspace(lo, hi, n)


MAX_CHECKPOINT_EVERY_S = 86400.0
"""The search looks no further than a durable checkpoint a day: when no failure takes the
durable path, ETTR keeps rising with the interval, but a job still wants a restore point."""
COARSE_SEEDS = 5
"""Seeds used to place the coarse grid; the fine grid around its best uses every seed."""


def _young_daly(st: Strategy, job: Job, inp: Inputs) -> dict[str, Any]:
    rates = {c: r * job.gpus for c, r in inp.rates_per_gpu_s().items()}
    lam_r, lam_e = restart_rate(st, rates)
    out: dict[str, Any] = {}
    for tier, lam, cost in (("durable", lam_r, st.ckpt_stall_s),
                            ("commit", lam_e if st.commits else 0.0, st.commit_s)):
        mtbf = 1.0 / lam if lam > 0 else None
        young: float | None = None
        daly: float | None = None
        if mtbf is not None and cost > 0:
            young, daly = young_interval(cost, mtbf), daly_interval(cost, mtbf)
        out[tier] = {"mtbf_s": mtbf, "cost_s": cost, "young_s": young, "daly_s": daly}
    return out


def _candidates(st: Strategy, job: Job, yd: dict[str, Any], step: float,
                commit_fixed: float | None, ckpt_fixed: float | None,
                points: int) -> list[tuple[float, float]]:
    """(commit interval, checkpoint interval) pairs around Young's estimates (x/20 .. x20);
    a given interval is not searched."""
    top = min(job.horizon_s, MAX_CHECKPOINT_EVERY_S)

    def around(center: float | None, hi: float) -> np.ndarray:
        if center is None or not math.isfinite(center):
            return _geo(max(step, hi / 1000.0), hi, points)
        return _geo(max(step, center / 20.0), max(step, min(hi, center * 20.0)), points)

    ds = (np.array([ckpt_fixed]) if ckpt_fixed is not None
          else around(yd["durable"]["young_s"], top))
    if not st.commits:
        return [(float(d), float(d)) for d in ds]
    cs = (np.array([commit_fixed]) if commit_fixed is not None
          else around(yd["commit"]["young_s"], top))
    return [(float(cc), float(max(d, cc))) for cc in cs for d in ds]


def _steps(x: float, step: float) -> float:
    return max(step, round(x / step) * step)


def _pairs(st: Strategy, pairs: list[tuple[float, float]], step: float
           ) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]]]:
    """Pairs -> (commit seconds, commits per checkpoint), snapped to whole steps and commits,
    deduplicated; and the pairs as snapped."""
    seen: dict[tuple[float, float], None] = {}
    for cc, d in pairs:
        if st.commits:
            cc = _steps(cc, step)
            seen[(cc, max(1.0, round(d / cc)))] = None
        else:
            seen[(_steps(d, step), 1.0)] = None
    keys = list(seen)
    return (np.array([k[0] for k in keys]), np.array([k[1] for k in keys]),
            [(k[0], k[0] * k[1]) for k in keys])


def _search(tls: list[Timeline], st: Strategy, job: Job, pairs: list[tuple[float, float]],
            step: float) -> tuple[Evaluation, list[tuple[float, float]], int]:
    """Evaluates every pair on every timeline: (evaluation, snapped pairs, best column)."""
    cs, ms, snapped = _pairs(st, pairs, step)
    ev = evaluate(tls, st, job, cs, ms)
    return ev, snapped, int(np.argmax(ev.work.mean(axis=0)))


def plan_strategy(name: str, job: Job, inp: Inputs, *, commit_every_s: float | None = None,
                  checkpoint_every_s: float | None = None, restartable: bool = True,
                  points: int = 7) -> Result:
    """Simulates one strategy over `job.seeds` seeds and picks the intervals with the best
    mean ETTR: a coarse grid around Young's estimates on a few seeds, then a finer one around
    its best (and Young/Daly's own pair, for comparison) on every seed."""
    st = build(name, inp)
    if not restartable:
        st = Strategy(**{**st.__dict__, "restartable": False})
    step = inp["step_s"]
    # every strategy sees the same failures for a seed: spawn per seed, not per strategy
    seeds = np.random.SeedSequence(job.seed).spawn(job.seeds)
    tls = []
    for s, ss in enumerate(seeds):
        times = job.fault_times[s % len(job.fault_times)] if job.fault_times else None
        tls.append(build_timeline(st, job, inp, np.random.default_rng(ss),
                                  None if times is None else np.asarray(times)))
    yd = _young_daly(st, job, inp)
    search_c = st.commits and commit_every_s is None
    search_d = checkpoint_every_s is None
    pairs = _candidates(st, job, yd, step, commit_every_s, checkpoint_every_s, points)
    if len(pairs) > 1:
        ev, snapped, g = _search(tls[:COARSE_SEEDS], st, job, pairs, step)
        bc, bd = snapped[g]
        f = np.geomspace(0.6, 1.0 / 0.6, 5)
        top = min(job.horizon_s, MAX_CHECKPOINT_EVERY_S)
        cs = [min(top, bc * x) for x in f] if search_c else [bc]
        ds = [min(top, bd * y) for y in f] if search_d else [bd]
        pairs = [(cx, max(cx, dy)) for cx in cs for dy in ds] + [(bc, bd)]
    yd_pair = (commit_every_s or yd["commit"]["young_s"] or pairs[-1][0],
               checkpoint_every_s or yd["durable"]["daly_s"] or pairs[-1][1])
    ev, snapped, g = _search(tls, st, job, pairs + [yd_pair], step)
    ysnapped = _pairs(st, [yd_pair], step)[2]
    gy = snapped.index(ysnapped[0])
    yd["pair_s"] = list(ysnapped[0])
    yd["ettr_at_pair"] = float(ev.work[:, gy].mean() / job.horizon_s)
    if not (search_c or search_d):
        g = gy  # nothing searched: the given intervals
    pick = Evaluation(ev.work[:, g:g + 1], ev.lost[:, :, g:g + 1],
                      ev.rework_by_class[:, :, g:g + 1])
    return _result(name, st, job, tls, pick, snapped[g], search_c or search_d, yd)


def _result(name: str, st: Strategy, job: Job, tls: list[Timeline], ev: Evaluation,
            pair: tuple[float, float], searched: bool, yd: dict[str, Any]) -> Result:
    H = job.horizon_s
    ettr = ev.work[:, 0] / H
    down = np.mean([t.down for t in tls], axis=0)  # (classes+1, causes)
    lost = {c: float(ev.lost[_C[c], :, 0].mean() / H) + float(down[:, _C[c]].sum() / H)
            for c in CAUSES}
    by_class = {c: float((down[j].sum() + ev.rework_by_class[j, :, 0].mean()) / H)
                for j, c in enumerate(CLASSES)}
    days = H / 86400.0
    failures = np.mean([t.failures for t in tls], axis=0) / days
    return Result(
        strategy=name, title=st.title, ettr_mean=float(ettr.mean()),
        ettr_sd=float(ettr.std(ddof=1)) if len(ettr) > 1 else 0.0,
        ettr_min=float(ettr.min()), ettr_max=float(ettr.max()),
        commit_every_s=pair[0] if st.commits else None, checkpoint_every_s=pair[1],
        searched=searched, lost_by_cause=lost, lost_by_class=by_class,
        failures_per_day={c: float(failures[j]) for j, c in enumerate(CLASSES)},
        restarts_per_day=float(np.mean([t.restarts for t in tls]) / days),
        young_daly=yd,
        paths={c: f"{KIND_NAMES[p.kind]}: {p.how}" for c, p in st.paths.items()},
        ettr_by_seed=[float(x) for x in ettr],
    )


def simulate(job: Job, inp: Inputs, strategies: tuple[str, ...] = STRATEGIES, *,
             commit_every_s: float | None = None, checkpoint_every_s: float | None = None,
             restartable: bool = True) -> list[Result]:
    """Every strategy's plan for `job` (see `plan_strategy`)."""
    for s in strategies:
        if s not in STRATEGIES:
            raise ConfigError(f"plan: unknown strategy {s!r} (one of {', '.join(STRATEGIES)})")
    for name, v in (("--commit-every", commit_every_s), ("--checkpoint-every",
                                                         checkpoint_every_s)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"plan: {name} must be a positive number of seconds, got {v}")
    return [plan_strategy(s, job, inp, commit_every_s=commit_every_s,
                          checkpoint_every_s=checkpoint_every_s, restartable=restartable)
            for s in strategies]


def plan(job: Job, inp: Inputs, strategies: tuple[str, ...] = STRATEGIES,
         sizes: list[int] | None = None, scale_seeds: int | None = None, *,
         commit_every_s: float | None = None,
         checkpoint_every_s: float | None = None) -> Plan:
    """The plan for `job`, and the ETTR of every strategy at each cluster size in `sizes`
    (each with its own best intervals, over `scale_seeds` seeds)."""
    t0 = time.perf_counter()
    results = simulate(job, inp, strategies, commit_every_s=commit_every_s,
                       checkpoint_every_s=checkpoint_every_s)
    scale: list[dict[str, Any]] = []
    for gpus in sizes or []:
        sjob = Job(**{**asdict(job), "gpus": gpus, "seeds": scale_seeds or job.seeds})
        row: dict[str, Any] = {"gpus": gpus, "hosts": sjob.hosts}
        for r in simulate(sjob, inp, strategies, commit_every_s=commit_every_s,
                          checkpoint_every_s=checkpoint_every_s):
            row[r.strategy] = {"ettr": r.ettr_mean, "sd": r.ettr_sd,
                               "commit_every_s": r.commit_every_s,
                               "checkpoint_every_s": r.checkpoint_every_s}
        scale.append(row)
        logger.debug("scale %d GPUs done at %.2f s", gpus, time.perf_counter() - t0)
    out = Plan(job, inp, results, scale, time.perf_counter() - t0,
               scale_seeds or job.seeds if sizes else 0)
    logger.info("planned %d strategies (%d sizes) in %.2f s", len(results), len(scale),
                out.elapsed_s)
    return out
