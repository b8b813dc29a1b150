"""Every input of the planner, its default, and where that default comes from.

A plan is only as good as its numbers, so each one travels with its source: ``published``
(a paper or a vendor's documentation, cited), ``measured`` (this project's benchmarks on its
2-core test machine, or the run folder the plan was made from), ``project default`` (a default
of `hvd-resilient run`) or ``assumption`` (no published or measured number: a guess, said so).
The command prints the source of every input it used, so nobody mistakes a guess for data.

Failure rates are per 1000 GPU-days and scale linearly with the job's GPU count (the model of
Kokolis et al., "Revisiting Reliability in Large-Scale ML Research Clusters", HPCA 2025, where
a job's MTTF falls as 1/N). The defaults split the 419 unexpected interruptions of Llama 3's
54-day pre-training on 16,384 H100s (Dubey et al., "The Llama 3 Herd of Models",
arXiv:2407.21783, Table 5) into this planner's classes; the split (which component failure a
runtime sees as which class) is this planner's assumption, the counts are the paper's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient.errors import ConfigError
from hvd_resilient.report.plan.measured import CHECKPOINT_FIT, CHECKPOINT_SOURCE, MEASURED

CLASSES = ("crash", "host_loss", "silent_host_loss", "hang", "preempt_notice",
           "preempt_no_notice")
"""Failure classes. crash: one process dies, its host is fine (a software bug). host_loss: a
host must be replaced, its processes die and their connections close (GPU, HBM, Xid errors).
silent_host_loss: a host vanishes without closing its connections (power, NIC, switch, cable):
peers learn only at a timeout. hang: a rank stops making progress without dying. preempt_notice
/ preempt_no_notice: the host is taken away, with a warning or without."""

LLAMA3 = "published: Llama 3 (arXiv:2407.21783, Table 5; 54 days x 16,384 GPUs)"
LLAMA3_KGPU_DAYS = 16_384 * 54 / 1000.0
"""The exposure behind the Llama 3 counts, in thousands of GPU-days (884.7)."""

VANILLA_RECOVER = (0.272, 0.884, 1.05, 0.294, 0.306, 0.174, 0.16, 0.181)


@dataclass(frozen=True)
class Param:
    """One input: its flag is ``--`` + name with dashes; its help line says unit and source."""

    name: str
    default: float
    unit: str
    help: str
    source: str
    minimum: float = 0.0
    maximum: float = math.inf
    samples: tuple[float, ...] = ()
    """Measured samples behind a default; the simulation draws one per failure."""


def _llama(count: int, what: str) -> tuple[float, str]:
    return round(count / LLAMA3_KGPU_DAYS, 5), f"{LLAMA3}: {what}"


def _measured(name: str, unit: str, help: str, maximum: float = math.inf) -> Param:
    """An input whose default `bench/plan_constants.py` derived from the benchmark results."""
    m = MEASURED[name]
    return Param(name, float(m["value"]), unit, help, str(m["source"]), maximum=maximum,
                 samples=tuple(float(x) for x in m["samples"]))


_RATES = {
    "crash": _llama(56, "software bug 54 + dependency 2"),
    "host_loss": _llama(309, "faulty GPU 148, HBM3 72, GPU SRAM 19, GPU system processor 17, "
                             "unplanned host maintenance 32, silent data corruption 6, GPU "
                             "thermal 6, SSD 3, CPU 2, system memory 2, IO expansion board 2"),
    "silent_host_loss": _llama(47, "network switch/cable 35, NIC 7, power supply 3, server "
                                   "chassis 2"),
    "hang": _llama(7, "NCCL watchdog timeouts 7"),
    "preempt_notice": _llama(47, "the 47 planned interruptions (automated maintenance)"),
    "preempt_no_notice": (0.0, "assumption: none in an owned fleet; set it for spot capacity"),
}

PARAMS: tuple[Param, ...] = (
    *(Param(f"rate_{c}", r, "per 1000 GPU-days", f"rate of {c.replace('_', ' ')} failures", s)
      for c, (r, s) in _RATES.items()),
    Param("preempt_notice_s", 120.0, "s", "warning before a preemption with notice",
          "published: AWS EC2 Spot interruption notice, two minutes"),
    Param("gloo_timeout_s", 30.0, "s",
          "Horovod's Gloo timeout: how long survivors wait on a silent or hung peer",
          "measured: Horovod's default, seen as 30.1-31.0 s recoveries of vanilla Horovod "
          "(bench/results/recovery-failures.json)"),
    Param("nccl_timeout_s", 600.0, "s",
          "torchrun/NCCL collective timeout: when a silent or hung peer is noticed",
          "published: PyTorch's default NCCL process-group timeout, 10 minutes "
          "(pytorch/pytorch#110947)"),
    # -- this project's stack (Horovod backend) --
    _measured("ours_detect_s", "s", "ours: fault -> the first survivor notices (hang-up watch)"),
    _measured("ours_recover_s", "s", "ours: noticed -> training again at N-1 (reset + sync "
              "from the in-memory commit)"),
    _measured("ours_join_stall_s", "s", "ours: stall of the running job when a host joins "
              "(standby workers, the reset held until they are warm)"),
    _measured("ours_leave_stall_s", "s", "ours: stall when a host leaves on notice (removed "
              "via discovery)"),
    _measured("ours_rejoin_s", "s", "ours: a crashed worker's host back in the job (blacklist "
              "cooldown + start)"),
    Param("ours_silent_detect_s", 1.5, "s", "ours (Horovod): a frozen or cut-off peer found by "
          "the peer heartbeats", "project default: recovery.heartbeat_timeout_seconds; "
          "measured: detect 1.50 s (bench/results/recovery-silent.json, partition.json)"),
    Param("ours_hang_detect_s", math.nan, "s", "ours: a rank alive without progress ended by the "
          "progress watchdog (its death then resets the others at once)",
          "project default: max(recovery.progress_floor_seconds 30, progress_factor 10 x "
          "step_s)"),
    Param("ours_pg_timeout_s", 300.0, "s", "ours under torchrun: collective timeout that ends "
          "a wait on a silent peer (no heartbeats under torchrun)",
          "project default: recovery.pg_timeout_seconds"),
    _measured("ours_giveup", "probability", "ours: an in-process recovery fails and the "
              "supervisor restarts the job from the durable checkpoint", maximum=1.0),
    Param("supervisor_delay_s", 1.0, "s", "ours: the supervisor's first relaunch backoff",
          "project default (hvd-resilient run backoff 1-60 s)"),
    _measured("ours_torchrun_restart_s", "s", "ours under torchrun: kill -> resumed step "
              "(warm forked workers), before the restore"),
    # -- vanilla Horovod Elastic --
    Param("vanilla_recover_s", 0.24, "s", "vanilla Horovod: after the Gloo timeout -> "
          "training again", "measured: bench/results/recovery-failures.json + "
          "recovery-idle.json, the 8 vanilla kill runs that recovered (first step - 30 s "
          "timeout)", samples=VANILLA_RECOVER),
    Param("vanilla_rejoin_s", 600.0, "s", "vanilla Horovod: a failed worker's host back "
          "(without --blacklist-cooldown-range Horovod blacklists it for good: a spare comes "
          "through discovery)", "assumption: as replace_s"),
    Param("vanilla_join_stall_s", 8.066, "s", "vanilla Horovod: stall when a host joins",
          "measured: recovery.json host_added, median of 3", samples=(8.128, 7.56, 8.066)),
    Param("vanilla_leave_stall_s", 0.549, "s", "vanilla Horovod: stall when a host leaves on "
          "notice", "measured: recovery.json host_removed, median of 3",
          samples=(0.232, 0.707, 0.549)),
    Param("vanilla_giveup", 0.273, "probability", "vanilla Horovod: a recovery never finishes "
          "and the job must be resubmitted", "measured: 3 of 11 vanilla kill runs never "
          "recovered (recovery-failures.json, recovery-idle.json)", maximum=1.0),
    # -- plain torchrun --
    Param("torchrun_restart_s", 11.906, "s", "plain torchrun (DDP): kill -> resumed step "
          "(cold workers), before the restore", "measured: recovery-failures.json "
          "torchrun_kill vanilla, median of the runs that finished"),
    # -- any full restart --
    _measured("cold_start_s", "s", "a relaunched Horovod job: launch -> training"),
    Param("restart_overhead_s", 0.0, "s", "extra cost of a whole-job restart at scale "
          "(scheduler, rendezvous of thousands of hosts)", "assumption: none added; no "
          "published number used"),
    Param("replace_s", 600.0, "s", "a lost host replaced by a spare (elastic stacks run "
          "shrunk meanwhile; restart-all stacks restart on a spare at once)",
          "assumption: no published number used"),
    # -- checkpoints --
    Param("step_s", 1.0, "s", "one training step: commits and checkpoints happen between steps",
          "assumption", minimum=1e-6),
    Param("checkpoint_gb", 1.0, "GB", "checkpoint bytes each writer writes (writers write in "
          "parallel)", "assumption: inside the 1 MB-4 GB per GPU of Llama 3's checkpoints "
          "(arXiv:2407.21783)", minimum=1e-9),
    Param("ckpt_async_stall_s", math.nan, "s", "stall of an async durable checkpoint",
          CHECKPOINT_SOURCE),
    Param("ckpt_sync_s", math.nan, "s", "stall of a synchronous durable checkpoint",
          CHECKPOINT_SOURCE),
    Param("ckpt_upload_s", math.nan, "s", "background upload of an async checkpoint (not "
          "durable until it ends)", CHECKPOINT_SOURCE),
    Param("restore_s", math.nan, "s", "load and verify a durable checkpoint", CHECKPOINT_SOURCE),
    Param("commit_s", math.nan, "s", "stall of an in-memory commit", "assumption: copies the "
          "state like the async snapshot (bench/results/checkpoint.json)"),
)
"""Every numeric input; NaN defaults are derived from `checkpoint_gb` (see `derived`)."""

PARAM = {p.name: p for p in PARAMS}
SIZE_DEPENDENT = ("ckpt_async_stall_s", "ckpt_sync_s", "ckpt_upload_s", "restore_s", "commit_s")


@dataclass(frozen=True)
class Value:
    """A number, where it came from, and the measured samples behind it when there are some
    (the simulation draws recoveries from samples: a rare 30 s stall matters more than a
    median says)."""

    value: float
    source: str
    samples: tuple[float, ...] = ()


def derived(name: str, checkpoint_gb: float, step_s: float = 1.0) -> float:
    """The default of an input that follows another: checkpoint costs follow `checkpoint_gb`,
    the watchdog's budget follows `step_s`."""
    if name == "ours_hang_detect_s":
        return max(30.0, 10.0 * step_s)
    if name == "commit_s":
        a, b = CHECKPOINT_FIT["ckpt_async_stall_s"]
        return max(0.0, a + b * checkpoint_gb)
    a, b = CHECKPOINT_FIT[name]
    return max(0.0, a + b * checkpoint_gb)


@dataclass
class Inputs:
    """The inputs of one plan: every `Param` with its value and source, plus what a run
    folder can add that is not a single number (throughput by world size)."""

    values: dict[str, Value] = field(default_factory=dict)
    capacity_by_size: dict[int, float] = field(default_factory=dict)
    """Measured throughput at each world size / throughput at the largest (from the report's
    `throughput_by_size`); empty: throughput proportional to the workers left."""
    notes: list[str] = field(default_factory=list)
    """What calibration found worth saying (a measured value it could not use, and why)."""

    @staticmethod
    def defaults(overrides: Mapping[str, float] | None = None,
                 measured: Mapping[str, Value] | None = None) -> Inputs:
        """Defaults < measured < overrides (flags). Derived checkpoint costs follow
        `checkpoint_gb` unless measured or given."""
        overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        measured = dict(measured or {})
        for name in list(overrides) + list(measured):
            if name not in PARAM:
                raise ConfigError(f"plan: unknown input {name!r}")
        if "checkpoint_gb" in overrides:
            # costs measured at the run's checkpoint size say nothing about another size
            for name in SIZE_DEPENDENT:
                measured.pop(name, None)
        vals: dict[str, Value] = {}
        for p in PARAMS:
            if p.name in overrides:
                vals[p.name] = Value(float(overrides[p.name]), "flag")
            elif p.name in measured:
                vals[p.name] = measured[p.name]
            elif not math.isnan(p.default):
                vals[p.name] = Value(p.default, p.source, p.samples)
        gb, step = vals["checkpoint_gb"].value, vals["step_s"].value
        for p in PARAMS:
            if p.name not in vals:
                at = f"step_s {step:.3g} s" if p.name == "ours_hang_detect_s" else f"{gb:g} GB"
                vals[p.name] = Value(derived(p.name, gb, step), f"{p.source} at {at}")
        inputs = Inputs(vals)
        inputs.validate()
        return inputs

    def validate(self) -> None:
        for name, v in self.values.items():
            p = PARAM[name]
            if not (math.isfinite(v.value) and p.minimum <= v.value <= p.maximum):
                hi = "" if math.isinf(p.maximum) else f" and <= {p.maximum:g}"
                raise ConfigError(f"plan: --{name.replace('_', '-')} must be a number >= "
                                  f"{p.minimum:g}{hi}, got {v.value!r}")

    def __getitem__(self, name: str) -> float:
        return self.values[name].value

    def samples(self, name: str) -> tuple[float, ...]:
        """Measured samples of `name`, else its one value."""
        v = self.values[name]
        return v.samples if v.samples else (v.value,)

    def source(self, name: str) -> str:
        return self.values[name].source

    def rates_per_gpu_s(self) -> dict[str, float]:
        """Failure rate of each class per GPU-second."""
        return {c: self[f"rate_{c}"] / 1000.0 / 86400.0 for c in CLASSES}

    def describe(self) -> list[dict[str, Any]]:
        """[{name, value, unit, kind, source}] for the output: kind is measured, flag,
        published, project default or assumption."""
        out = []
        for p in PARAMS:
            v = self.values[p.name]
            out.append({"name": p.name, "value": v.value, "unit": p.unit,
                        "kind": kind_of(v.source), "source": v.source,
                        "samples": len(v.samples) or None})
        return out


def kind_of(source: str) -> str:
    for kind in ("measured", "published", "project default", "assumption", "flag"):
        if source.startswith(kind):
            return kind
    return "measured" if "measured" in source else "assumption"


@dataclass(frozen=True)
class Job:
    """The job and the simulation: shape, horizon, seeds, and how the bench differs."""

    gpus: int = 16_384
    gpus_per_host: int = 8
    hosts_per_replica: int = 1
    """Hosts that hold one data-parallel replica: losing one takes its replica out."""
    horizon_s: float = 30 * 86400.0
    seeds: int = 20
    seed: int = 0
    include_startup: bool = True
    """Count the first launch's cold start as lost (a benchmark that starts its clock at the
    first step does not)."""
    final_commit: bool = True
    """The job commits at the horizon (a benchmark that kills it there does not: work since
    the last commit is then lost)."""
    capacity: str = "linear"
    """"linear": a job short of k of its N replicas trains at (N-k)/N; "time": any training
    counts in full (what `hvd-resilient report` counts as productive time); "measured": the
    run folder's throughput by world size."""
    fault_times: tuple[tuple[float, ...], ...] = ()
    """Given fault times per seed (a benchmark's schedule) instead of Poisson arrivals."""
    fault_class: str = "crash"
    """The class of given fault times."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError(f"plan: --gpus must be >= 1, got {self.gpus}")
        if self.gpus_per_host < 1:
            raise ConfigError(f"plan: --gpus-per-host must be >= 1, got {self.gpus_per_host}")
        if self.hosts_per_replica < 1:
            raise ConfigError("plan: --hosts-per-replica must be >= 1, got "
                              f"{self.hosts_per_replica}")
        if not (self.horizon_s > 0 and math.isfinite(self.horizon_s)):
            raise ConfigError(f"plan: --days must be > 0, got {self.horizon_s / 86400:g}")
        if not 1 <= self.seeds <= 10_000:
            raise ConfigError(f"plan: --seeds must be 1..10000, got {self.seeds}")
        if self.capacity not in ("linear", "time", "measured"):
            raise ConfigError(f"plan: capacity must be linear, time or measured, "
                              f"got {self.capacity!r}")
        if self.fault_class not in CLASSES:
            raise ConfigError(f"plan: unknown failure class {self.fault_class!r}")

    @property
    def hosts(self) -> int:
        return max(1, math.ceil(self.gpus / min(self.gpus_per_host, self.gpus)))

    @property
    def host_gpus(self) -> int:
        return min(self.gpus_per_host, self.gpus)


def parse_sizes(text: str) -> list[int]:
    """'1,1k,16k,100000' -> [1, 1000, 16000, 100000] (k = 1000, K = 1024)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        mult = 1000 if part.endswith("k") else 1024 if part.endswith("K") else 1
        try:
            n = int(float(part[:-1] if mult > 1 else part) * mult)
        except ValueError:
            raise ConfigError(f"plan: --sizes: {part!r} is not a GPU count") from None
        if n < 1:
            raise ConfigError(f"plan: --sizes: {part!r} must be >= 1")
        out.append(n)
    if not out:
        raise ConfigError("plan: --sizes is empty")
    return sorted(set(out))

