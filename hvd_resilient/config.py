"""One typed training config, from a file, environment variables and CLI flags.

Precedence: defaults < config file (YAML or JSON) < `HVD_RESILIENT_<FIELD>` environment
variables < command-line flags. Every value is checked in `__post_init__`, so a bad value stops
the job before any worker trains, with one line that names the field and how to set it.

Settings that belong to one concern live in a section (`checkpoint`, `store`, `memory_tier`,
`recovery`, `observability`, `data`, `recipe`): `cfg.store.sse` is set by `--store-sse`,
`HVD_RESILIENT_STORE_SSE` or `store: {sse: ...}` in the file. Each setting has that one name
(no release shipped with another, so none is kept for old spellings). This module is the only
place that reads them; everything below gets them passed in. How flags, files and
the environment become values is `hvd_resilient.settings`, shared with `hvd-resilient run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_resilient.errors import SUPERVISED_ENV, ConfigError
from hvd_resilient.masking import has_credentials, mask_url, scrub
from hvd_resilient.settings import Schema, Setting

ENV_PREFIX = "HVD_RESILIENT_"
LR_SCALING = ("none", "linear")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

__all__ = ["ENV_PREFIX", "TrainConfig", "refuse_credentials", "settings"]


def _where(name: str) -> str:
    return f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}"


def _require(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config: {name} must be {what}, got {value!r} ({_where(name)})")


@dataclass(kw_only=True)
class CheckpointOptions:
    """Where durable checkpoints go, how often, and how many stay."""

    url: str = ""
    """{store_urls} for checkpoints (default <run_dir>/checkpoints)."""
    every: int = 0
    """Durable checkpoint every N steps (0: only at the end of each epoch and of training)."""
    keep_last: int = 3
    """Durable checkpoints kept (the newest verified one is never removed)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    resume: bool = True
    """Resume from the newest verified checkpoint of this run, if there is one. With
    --no-checkpoint-resume a run refuses to start while checkpoints exist at checkpoint_url
    (they are never rewritten); `hvd-resilient run --fresh-start` or `hvd-resilient ckpt
    supersede` sets them aside first."""
    store_wait_seconds: float = 60.0
    """At start, how long an unreachable checkpoint store is retried before the run stops
    (it never starts from scratch over checkpoints it could not read)."""
    grace_seconds: float = 60.0
    """On SIGTERM/SIGUSR1, time allowed for the final synchronous checkpoint."""
    snapshot_reuse: bool = True
    """Reuse the snapshot buffers from one checkpoint to the next (false: give them back after
    every checkpoint, paying the first touch of fresh memory each time)."""
    lease_epoch: int = 0
    """The run's lease epoch this job holds, set by `hvd-resilient run` (0: none, unfenced). A
    checkpoint is published only while the run's fence is not newer (a relaunch took it over)."""

    def __post_init__(self) -> None:
        _require(self.keep_last >= 1, "checkpoint_keep_last", ">= 1", self.keep_last)
        for name in ("every", "keep_every", "store_wait_seconds", "lease_epoch"):
            _require(getattr(self, name) >= 0, f"checkpoint_{name}", ">= 0",
                     getattr(self, name))
        _require(self.grace_seconds > 0, "checkpoint_grace_seconds", "> 0", self.grace_seconds)


@dataclass(kw_only=True)
class StoreOptions:
    """Settings of the checkpoint store, each read by the kind of store checkpoint_url
    names; one set for a store that does not read it stops the run."""

    sse: str = ""
    """S3 server-side encryption of every object written: AES256 or aws:kms ('' : the
    bucket's default)."""
    sse_kms_key_id: str = ""
    """KMS key id or ARN for sse=aws:kms (implies it)."""

    def store_options(self, url: str) -> dict[str, Any]:
        """Keyword arguments for `open_store(url, ...)`, checked by the store `url` names
        (`checkpoint.stores.store_options`): encryption is refused for a store that cannot
        do it rather than silently not applied."""
        from hvd_resilient.checkpoint import stores

        return stores.store_options(url, dataclasses.asdict(self))


@dataclass(kw_only=True)
class MemoryTierOptions:
    """The memory tier: every commit also in host memory outside the process
    (docs/memory-tier.md)."""

    enabled: bool = True
    """Keep every commit in host memory outside the process too (dir), so a restart of every
    worker resumes from the last commit instead of the last durable checkpoint. Off where dir
    cannot be written, with an event."""
    dir: str = "/dev/shm/hvd_resilient"
    """Where the memory tier lives on each host: a RAM file system (or a fast local disk)."""
    max_bytes: int = 0
    """Cap on the memory tier of each host, all runs together (0: half of dir's file
    system); a commit that does not fit is kept in the process only, with an event."""
    max_age_hours: float = 24.0
    """Segments of runs idle this long are removed by the next job on the host."""
    scope: str = ""
    """Separates one history of a run from another in the memory tier (`hvd-resilient run
    --fresh-start` sets it, so a fresh start never resumes from the old history's memory)."""

    def __post_init__(self) -> None:
        _require(self.max_bytes >= 0, "memory_tier_max_bytes", ">= 0", self.max_bytes)
        _require(self.max_age_hours > 0, "memory_tier_max_age_hours", "> 0",
                 self.max_age_hours)
        _require(self.dir.startswith("/"), "memory_tier_dir", "an absolute path", self.dir)
        _require(all(c.isalnum() or c in "._-" for c in self.scope),
                 "memory_tier_scope", "letters, digits, . _ - only", self.scope)


@dataclass(kw_only=True)
class RecoveryOptions:
    """How failures are detected and waited for."""

    pg_timeout_seconds: float = 300.0
    """torchrun: seconds torch.distributed waits to form the process group and its store."""
    progress_timeout_seconds: float = 0.0
    """A rank with no step ended for this long is hung: its stacks are written and it is
    ended (0: adaptive, progress_factor x the slowest step, at least progress_floor_seconds)."""
    progress_floor_seconds: float = 30.0
    """The adaptive progress timeout never goes below this."""
    progress_factor: float = 10.0
    """The adaptive progress timeout is this many times the slowest step seen so far."""
    first_step_seconds: float = 600.0
    """Budget of the first step (compilation, data loader warm-up)."""
    heartbeat_timeout_seconds: float = 1.5
    """A peer silent this long is frozen or cut off and is evicted (0: no heartbeats; such
    failures then wait for the Gloo or process-group timeout)."""
    generation_timeout_seconds: float = 120.0
    """inplace: seconds a member waits for the next generation after a fault; a wait on
    members busy in a declared section (an evaluation) lasts as long as they are."""
    host_check_every: int = 1
    """Horovod elastic: every N steps the ranks ask whether discovery changed the hosts (one
    one-element broadcast), so that a scale change waits for no commit (0: only at commits)."""

    def __post_init__(self) -> None:
        _require(self.host_check_every >= 0, "recovery_host_check_every", ">= 0 (0: only at "
                 "commits)", self.host_check_every)
        _require(self.pg_timeout_seconds > 0, "recovery_pg_timeout_seconds", "> 0",
                 self.pg_timeout_seconds)
        for name in ("progress_timeout_seconds", "heartbeat_timeout_seconds"):
            _require(getattr(self, name) >= 0, f"recovery_{name}", ">= 0", getattr(self, name))
        for name in ("progress_floor_seconds", "progress_factor", "first_step_seconds",
                     "generation_timeout_seconds"):
            _require(getattr(self, name) > 0, f"recovery_{name}", "> 0", getattr(self, name))
        _require(self.heartbeat_timeout_seconds in (0, 0.0) or
                 self.heartbeat_timeout_seconds >= 0.5, "recovery_heartbeat_timeout_seconds",
                 "0 (off) or >= 0.5", self.heartbeat_timeout_seconds)


@dataclass(kw_only=True)
class ObservabilityOptions:
    """What the job says about itself."""

    log_level: str = "INFO"
    """Level of the library's loggers on rank 0 (other ranks log warnings and above)."""
    metrics_port: int = 0
    """Rank 0 serves Prometheus metrics over HTTP on this port (0: off); docs/observability.md
    lists them."""
    metrics_addr: str = "0.0.0.0"
    """Address the metrics endpoint listens on (0.0.0.0: every interface, so that the
    cluster's scraper reaches it; 127.0.0.1: this machine only)."""
    straggler_window_steps: int = 50
    """Steps per straggler window: every rank's median compute time over it is exchanged once
    (one small allgather per window, never per step; 0: no straggler detection)."""
    straggler_ratio: float = 1.3
    """A rank is slow in a window when its median compute time is above this many times the
    median of the other ranks' medians."""
    straggler_windows: int = 3
    """A rank slow in this many consecutive windows is reported as a straggler (a `straggler`
    event, a warning on rank 0)."""
    straggler_min_seconds: float = 0.02
    """A slow window also needs the rank's median to be at least this many seconds above the
    others' (a ratio between steps of a few milliseconds is scheduling noise, not a slow
    machine)."""
    straggler_evict: bool = False
    """Treat a reported straggler as failed: it records `straggler_evicted` and exits (code
    77), and the elastic job goes on without it (its slot waits out its cooldown)."""

    def __post_init__(self) -> None:
        self.log_level = str(self.log_level).upper()
        _require(self.log_level in LOG_LEVELS, "observability_log_level",
                 f"one of {', '.join(LOG_LEVELS)}", self.log_level)
        _require(0 <= self.metrics_port <= 65535, "observability_metrics_port",
                 "0 (off) or a TCP port (1-65535)", self.metrics_port)
        _require(bool(self.metrics_addr.strip()), "observability_metrics_addr",
                 "an address to listen on (0.0.0.0: every interface)", self.metrics_addr)
        _require(self.straggler_window_steps == 0 or self.straggler_window_steps >= 4,
                 "observability_straggler_window_steps", "0 (off) or >= 4 (a median of fewer "
                 "steps is noise)", self.straggler_window_steps)
        _require(self.straggler_ratio > 1.0, "observability_straggler_ratio", "> 1",
                 self.straggler_ratio)
        _require(self.straggler_windows >= 1, "observability_straggler_windows", ">= 1",
                 self.straggler_windows)
        _require(self.straggler_min_seconds >= 0, "observability_straggler_min_seconds",
                 ">= 0", self.straggler_min_seconds)


BAD_SAMPLE_ACTIONS = ("fatal", "skip")


@dataclass(kw_only=True)
class DataOptions:
    """How batches are loaded ahead of the step."""

    num_workers: int = 0
    """Loader worker processes per rank (0: samples are loaded in the training process, at the
    step). Loading and augmentation then run in these processes, ahead of the step."""
    prefetch_factor: int = 2
    """Batches each loader worker prepares ahead (with num_workers > 0)."""
    pin_memory: bool = False
    """Put loaded batches in page-locked memory, for faster copies to a GPU (ignored without
    one)."""
    persistent_workers: bool = True
    """Keep the loader workers from one epoch to the next (false: new workers every epoch, as
    a plain DataLoader does)."""
    on_bad_sample: str = "fatal"
    """A sample that raises while loading, or a shard that cannot be read: fatal (stop the job
    with one line naming it) or skip (leave it out and record a bad_sample event)."""
    readahead_shards: int = 2
    """Streamed shards: how many shards each rank fetches ahead of the one it reads."""
    cache_dir: str = ""
    """Streamed shards from S3 are downloaded here (default: a temporary folder per process,
    removed at the end)."""

    def __post_init__(self) -> None:
        _require(self.num_workers >= 0, "data_num_workers", ">= 0", self.num_workers)
        _require(self.prefetch_factor >= 1, "data_prefetch_factor", ">= 1",
                 self.prefetch_factor)
        _require(self.on_bad_sample in BAD_SAMPLE_ACTIONS, "data_on_bad_sample",
                 f"one of {', '.join(BAD_SAMPLE_ACTIONS)}", self.on_bad_sample)
        _require(self.readahead_shards >= 0, "data_readahead_shards", ">= 0",
                 self.readahead_shards)


PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(kw_only=True)
class RecipeOptions:
    """What the step does beyond forward, backward and step (docs/recipes.md)."""

    grad_accum: int = 1
    """Micro-batches of batch_size per optimizer step (gradients reduced once, on the last);
    every micro-batch's samples are counted exactly once."""
    clip_grad_norm: float = 0.0
    """Clip the reduced gradients to this global L2 norm before the step (0: no clipping)."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, CPU and GPU) or fp16 (autocast with a GradScaler whose state is
    committed and checkpointed)."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay (e.g. 0.999; 0:
    none); committed, synced and checkpointed as the `ema` component."""

    def __post_init__(self) -> None:
        _require(self.grad_accum >= 1, "recipe_grad_accum", ">= 1", self.grad_accum)
        _require(self.clip_grad_norm >= 0, "recipe_clip_grad_norm", ">= 0 (0: off)",
                 self.clip_grad_norm)
        _require(self.precision in PRECISIONS, "recipe_precision",
                 f"one of {', '.join(PRECISIONS)}", self.precision)
        _require(self.ema_decay == 0 or 0 < self.ema_decay < 1, "recipe_ema_decay",
                 "0 (off) or between 0 and 1", self.ema_decay)


@dataclass(kw_only=True)
class TrainConfig:
    """What a training run does and where it keeps what must survive."""

    run_id: str = "run"
    """Names the run; a restarted job with the same id resumes from its checkpoints."""
    run_dir: str = ""
    """Folder for the event log (shared by all hosts). Default: runs/<run_id>."""
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no limit)."""
    batch_size: int = 32
    """Samples per worker per step."""
    commit_every: int = 10
    """In-memory commit every N steps: at most this many steps are redone after a worker dies."""
    seed: int = 0
    """Seeds the data order, the model init in the examples and every rank's random streams."""
    shuffle: bool = True
    """Shuffle the data order each epoch (deterministically from seed and epoch)."""
    lr_scaling: str = "none"
    """How the learning rate follows the world size: none, or linear (lr x world size)."""
    deterministic: bool = False
    """Bit-identical results at a fixed world size for any number of ranks (gradients reduced
    in one fixed order, whatever the timing); what it costs: docs/determinism.md."""
    log_every: int = 50
    """Progress line every N steps on rank 0."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state across ranks (FSDP2; torchrun, or the
    inplace backend, where the survivors of a fault re-shard in their processes); checkpoints
    are then sharded too and reshard when resumed at another world size."""
    fault: str = ""
    """Fault injection for tests and benchmarks (`training/faults.py`):
    `kill:rank=R:step=S[:at=step|upload]`, also `raise`, `abort`, `stall`, `hang`, `freeze`,
    `sever` (a collective failure without a death), and `slow:rank=R:step=S:seconds=X` (that
    process sleeps X s in every step from S on); several separated by commas, each fired once
    per run."""
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    store: StoreOptions = field(default_factory=StoreOptions)
    memory_tier: MemoryTierOptions = field(default_factory=MemoryTierOptions)
    recovery: RecoveryOptions = field(default_factory=RecoveryOptions)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)
    data: DataOptions = field(default_factory=DataOptions)
    recipe: RecipeOptions = field(default_factory=RecipeOptions)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "commit_every", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"config: {name} must be >= 1, got {getattr(self, name)} ({_where(name)})"
                )
        if self.max_steps < 0:
            raise ConfigError(f"config: max_steps must be >= 0, got {self.max_steps} "
                              f"({_where('max_steps')})")
        if self.lr_scaling not in LR_SCALING:
            raise ConfigError(
                f"config: lr_scaling must be one of {', '.join(LR_SCALING)}, got "
                f"{self.lr_scaling!r} ({_where('lr_scaling')})"
            )
        if not self.run_id or any(c in self.run_id for c in "/\\ \t\n") or self.run_id in (
            ".", ".."
        ):
            raise ConfigError(
                f"config: run_id must be a non-empty name without slashes or spaces, got "
                f"{self.run_id!r} ({_where('run_id')})"
            )
        if not self.run_dir:
            self.run_dir = str(Path("runs") / self.run_id)
        self.run_dir = str(Path(self.run_dir).absolute())
        if not self.checkpoint.url:
            self.checkpoint.url = Path(self.run_dir, "checkpoints").as_uri()
        if not has_credentials(self.checkpoint.url):  # from_sources refuses those, masked
            self._check_store()
        if self.fsdp and self.recipe.ema_decay:
            raise ConfigError("config: recipe_ema_decay needs a replicated model; with fsdp "
                              "keep the EMA in your own loop (--recipe-ema-decay / "
                              f"{ENV_PREFIX}RECIPE_EMA_DECAY)")

    def _check_store(self) -> None:
        """The checkpoint URL and the store settings, checked by the store the URL names
        (before anything trains; nothing is opened): a bad one stops here, naming its
        setting. Normalised values are kept (a KMS key implies sse=aws:kms)."""
        from hvd_resilient.checkpoint import stores

        if "://" not in self.checkpoint.url:  # a path would mean another place on each host
            raise ConfigError(f"config: checkpoint_url must be a URL, {stores.SUPPORTED_URLS}, "
                              f"got {self.checkpoint.url!r} ({_where('checkpoint_url')})")
        try:
            checked = stores.store_options(self.checkpoint.url, dataclasses.asdict(self.store))
        except stores.StoreSettingError as e:
            name = f"store_{e.setting}"
            raise ConfigError(f"config: {name} {e.detail}, got {e.value!r} ({_where(name)})"
                              ) from None
        except stores.StoreConfigError as e:
            raise ConfigError(f"config: checkpoint_url: {e} ({_where('checkpoint_url')})"
                              ) from None
        for f in dataclasses.fields(self.store):
            if f.name in checked:
                setattr(self.store, f.name, checked[f.name])

    # -- sources ------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one flag per setting; defaults are None so unset flags do not override."""
        titles = {"": "training config", **{
            name: f"{name} ({(section.__doc__ or '').split('.')[0].strip()})"
            for name, section in SECTIONS.items()}}
        SCHEMA.add_arguments(parser, titles)
        parser.add_argument("--config", dest="config_file", default=None,
                            help="YAML or JSON file with these fields")

    @classmethod
    def from_sources(
        cls,
        args: argparse.Namespace | None = None,
        *,
        file: str | None = None,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> TrainConfig:
        """Merges defaults < file < environment < flags < overrides, then validates."""
        env = os.environ if env is None else env
        file = file or (getattr(args, "config_file", None) if args else None) or \
            env.get(ENV_PREFIX + "CONFIG")
        values = SCHEMA.read(file=file, env=env, args=args, overrides=overrides)
        if env.get(SUPERVISED_ENV) == "1":
            _refuse_disagreement(values, env)
        cfg: TrainConfig = SCHEMA.build(values)
        refuse_credentials(cfg.checkpoint.url,
                           f"config: checkpoint_url ({_where('checkpoint_url')})")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The config as it may be recorded (the `start` event): credentials masked."""
        return scrub(dataclasses.asdict(self))


SECTIONS: dict[str, type] = {"checkpoint": CheckpointOptions, "store": StoreOptions,
                             "memory_tier": MemoryTierOptions, "recovery": RecoveryOptions,
                             "observability": ObservabilityOptions, "data": DataOptions,
                             "recipe": RecipeOptions}
"""Section name -> its dataclass; a setting's flat name is `<section>_<field>`."""


def doc_values() -> dict[str, str]:
    """What `{store_urls}` in a setting's docstring stands for: the checkpoint URLs there are
    stores for (imported when the docs are first needed, never at import)."""
    from hvd_resilient.checkpoint.stores import SUPPORTED_URLS

    return {"store_urls": SUPPORTED_URLS}


SCHEMA = Schema("config", TrainConfig, SECTIONS, env_prefix=ENV_PREFIX, doc_values=doc_values)
"""Every setting of TrainConfig: its flags, its environment variables, its file keys."""

def settings() -> list[Setting]:
    """Every setting of TrainConfig and its sections, in declaration order (the flags, the
    reference page and its test all come from here)."""
    return SCHEMA.settings


SUPERVISOR_OWNED = ("run_id", "run_dir", "checkpoint_url")
"""What `hvd-resilient run` decides for its workers: its relaunches and its report read the
run folder and checkpoints it chose, so a worker writing elsewhere would be lost to both."""


def _same(name: str, a: str, b: str) -> bool:
    if name == "run_dir":
        return Path(a).absolute() == Path(b).absolute()
    return a.rstrip("/") == b.rstrip("/")


def _refuse_disagreement(values: Mapping[str, Any], env: Mapping[str, str]) -> None:
    for name in SUPERVISOR_OWNED:
        given, chosen = values.get(name), env.get(ENV_PREFIX + name.upper())
        if given is not None and chosen is not None and not _same(name, str(given), chosen):
            flag = "--checkpoint" if name == "checkpoint_url" else "--" + name.replace("_", "-")
            raise ConfigError(
                f"config: the training command sets {name}={mask_url(str(given))!r} but "
                f"hvd-resilient run uses {mask_url(chosen)!r}; pass {flag} to hvd-resilient "
                "run only")


def refuse_credentials(url: str, what: str) -> None:
    """A checkpoint URL with user:password@ would put a secret into process lists, logs and
    events; the store refuses it anyway, so say so at once, masked."""
    if has_credentials(url):
        raise ConfigError(
            f"{what}: {mask_url(url)} embeds credentials; use the AWS credential chain "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role) instead"
        )
