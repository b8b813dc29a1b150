"""One typed training config, from a file, environment variables and CLI flags.

Precedence: defaults < config file (YAML or JSON) < `HVD_RESILIENT_<FIELD>` environment
variables < command-line flags. Every value is checked in `__post_init__`, so a bad value stops
the job before any worker trains, with one line that names the field and how to set it.

Settings that belong to one concern live in a section (`store`, `recovery`, `observability`,
`data`):
`cfg.store.sse` is set by `--store-sse`, `HVD_RESILIENT_STORE_SSE` or `store: {sse: ...}` in
the file. This module is the only place that reads them; everything below gets them passed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hvd_resilient.errors import SUPERVISED_ENV, ConfigError
from hvd_resilient.masking import has_credentials, mask_url, scrub

ENV_PREFIX = "HVD_RESILIENT_"
LR_SCALING = ("none", "linear")
SSE_MODES = ("", "AES256", "aws:kms")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _where(name: str) -> str:
    return f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}"


def _require(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config: {name} must be {what}, got {value!r} ({_where(name)})")


@dataclass(kw_only=True)
class StoreOptions:
    """How checkpoints are written to their store."""

    sse: str = ""
    """S3 server-side encryption of every object written: AES256 or aws:kms ('' : the
    bucket's default)."""
    sse_kms_key_id: str = ""
    """KMS key id or ARN for sse=aws:kms (implies it)."""
    snapshot_reuse: bool = True
    """Reuse the snapshot buffers from one checkpoint to the next (false: give them back after
    every checkpoint, paying the first touch of fresh memory each time)."""
    memory_tier: bool = True
    """Keep every commit in host memory outside the process too (memory_dir), so a restart of
    every worker resumes from the last commit instead of the last durable checkpoint
    (docs/memory-tier.md). Off where memory_dir cannot be written, with an event."""
    memory_dir: str = "/dev/shm/hvd_resilient"
    """Where the memory tier lives on each host: a RAM file system (or a fast local disk)."""
    memory_max_bytes: int = 0
    """Cap on the memory tier of each host, all runs together (0: half of memory_dir's file
    system); a commit that does not fit is kept in the process only, with an event."""
    memory_max_age_hours: float = 24.0
    """Segments of runs idle this long are removed by the next job on the host."""
    memory_scope: str = ""
    """Separates one history of a run from another in the memory tier (`hvd-resilient run
    --fresh-start` sets it, so a fresh start never resumes from the old history's memory)."""

    def __post_init__(self) -> None:
        _require(self.memory_max_bytes >= 0, "store_memory_max_bytes", ">= 0",
                 self.memory_max_bytes)
        _require(self.memory_max_age_hours > 0, "store_memory_max_age_hours", "> 0",
                 self.memory_max_age_hours)
        _require(self.memory_dir.startswith("/"), "store_memory_dir", "an absolute path",
                 self.memory_dir)
        _require(all(c.isalnum() or c in "._-" for c in self.memory_scope),
                 "store_memory_scope", "letters, digits, . _ - only", self.memory_scope)
        if self.sse_kms_key_id and not self.sse:
            self.sse = "aws:kms"
        _require(self.sse in SSE_MODES, "store_sse", "AES256, aws:kms or empty", self.sse)
        _require(not self.sse_kms_key_id or self.sse == "aws:kms", "store_sse_kms_key_id",
                 "set only with store_sse=aws:kms", self.sse_kms_key_id)

    def store_options(self, url: str) -> dict[str, Any]:
        """Keyword arguments for `open_store(url, ...)`; encryption is refused for a store that
        cannot do it rather than silently not applied."""
        if not self.sse:
            return {}
        _require(url.startswith("s3://"), "store_sse", "empty for a non-S3 checkpoint_url",
                 self.sse)
        return {"sse": self.sse, "sse_kms_key_id": self.sse_kms_key_id or None}


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

    def __post_init__(self) -> None:
        _require(self.pg_timeout_seconds > 0, "recovery_pg_timeout_seconds", "> 0",
                 self.pg_timeout_seconds)
        for name in ("progress_timeout_seconds", "heartbeat_timeout_seconds"):
            _require(getattr(self, name) >= 0, f"recovery_{name}", ">= 0", getattr(self, name))
        for name in ("progress_floor_seconds", "progress_factor", "first_step_seconds"):
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


SECTIONS: dict[str, type] = {"store": StoreOptions, "recovery": RecoveryOptions,
                             "observability": ObservabilityOptions, "data": DataOptions,
                             "recipe": RecipeOptions}
"""Section name -> its dataclass; a setting's flat name is `<section>_<field>`."""

ENV_ALIASES = {"HVD_RESILIENT_SNAPSHOT_REUSE": "store_snapshot_reuse",
               "HVD_RESILIENT_PG_TIMEOUT": "recovery_pg_timeout_seconds",
               "HVD_RESILIENT_LOG_LEVEL": "observability_log_level"}
"""Environment names these settings had before they had a section; still read."""


@dataclass(kw_only=True)
class TrainConfig:
    """What a training run does and where it keeps what must survive."""

    run_id: str = "run"
    """Names the run; a restarted job with the same id resumes from its checkpoints."""
    run_dir: str = ""
    """Folder for the event log (shared by all hosts). Default: runs/<run_id>."""
    checkpoint_url: str = ""
    """file:///path or s3://bucket/prefix for checkpoints (default <run_dir>/checkpoints)."""
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: no limit)."""
    batch_size: int = 32
    """Samples per worker per step."""
    commit_every: int = 10
    """In-memory commit every N steps: at most this many steps are redone after a worker dies."""
    checkpoint_every: int = 0
    """Durable checkpoint every N steps (0: only at the end of each epoch and of training)."""
    keep_last: int = 3
    """Durable checkpoints kept (the newest verified one is never removed)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    seed: int = 0
    """Seeds the data order, the model init in the examples and every rank's random streams."""
    shuffle: bool = True
    """Shuffle the data order each epoch (deterministically from seed and epoch)."""
    lr_scaling: str = "none"
    """How the learning rate follows the world size: none, or linear (lr x world size)."""
    resume: bool = True
    """Resume from the newest verified checkpoint of this run, if there is one. With --no-resume
    a run refuses to start while checkpoints exist at checkpoint_url (they are never rewritten);
    `hvd-resilient run --fresh-start` or `hvd-resilient ckpt supersede` sets them aside first."""
    deterministic: bool = False
    """Bit-identical results at a fixed world size for any number of ranks (gradients reduced
    in one fixed order, whatever the timing); what it costs: docs/determinism.md."""
    store_wait_seconds: float = 60.0
    """At start, how long an unreachable checkpoint store is retried before the run stops
    (it never starts from scratch over checkpoints it could not read)."""
    grace_seconds: float = 60.0
    """On SIGTERM/SIGUSR1, time allowed for the final synchronous checkpoint."""
    log_every: int = 50
    """Progress line every N steps on rank 0."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state across ranks (FSDP2, torchrun only);
    checkpoints are then sharded too and reshard when resumed at another world size."""
    store: StoreOptions = field(default_factory=StoreOptions)
    recovery: RecoveryOptions = field(default_factory=RecoveryOptions)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)
    data: DataOptions = field(default_factory=DataOptions)
    recipe: RecipeOptions = field(default_factory=RecipeOptions)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "commit_every", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"config: {name} must be >= 1, got {getattr(self, name)} ({_where(name)})"
                )
        for name in ("max_steps", "checkpoint_every", "keep_every"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"config: {name} must be >= 0, got {getattr(self, name)} ({_where(name)})"
                )
        if self.store_wait_seconds < 0:
            raise ConfigError(
                f"config: store_wait_seconds must be >= 0, got {self.store_wait_seconds} "
                f"({_where('store_wait_seconds')})"
            )
        if self.grace_seconds <= 0:
            raise ConfigError(
                f"config: grace_seconds must be > 0, got {self.grace_seconds} "
                f"({_where('grace_seconds')})"
            )
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
        if not self.checkpoint_url:
            self.checkpoint_url = Path(self.run_dir, "checkpoints").as_uri()
        scheme = self.checkpoint_url.split("://", 1)[0] if "://" in self.checkpoint_url else ""
        if scheme not in ("file", "s3"):
            raise ConfigError(
                f"config: checkpoint_url must start with file:// or s3://, got "
                f"{self.checkpoint_url!r} ({_where('checkpoint_url')})"
            )
        self.store.store_options(self.checkpoint_url)  # sse on a file:// URL stops here
        if self.fsdp and self.recipe.ema_decay:
            raise ConfigError("config: recipe_ema_decay needs a replicated model; with fsdp "
                              "keep the EMA in your own loop (--recipe-ema-decay / "
                              f"{ENV_PREFIX}RECIPE_EMA_DECAY)")

    # -- sources ------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one flag per field; defaults are None so unset flags do not override."""
        groups = {"": parser.add_argument_group("training config")}
        groups[""].add_argument("--config", dest="config_file", default=None,
                                help="YAML or JSON file with these fields")
        for st in settings():
            if st.section not in groups:
                groups[st.section] = parser.add_argument_group(
                    f"{st.section} ({SECTIONS[st.section].__doc__.strip().rstrip('.')})")
            doc = f"{st.doc} (default: {st.default!r})"
            if st.type == "bool":
                groups[st.section].add_argument(st.flag, dest=st.name, default=None,
                                                action=argparse.BooleanOptionalAction, help=doc)
            else:
                groups[st.section].add_argument(st.flag, dest=st.name, default=None, help=doc)

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
        values: dict[str, Any] = {}
        file = file or (getattr(args, "config_file", None) if args else None)
        if file or env.get(ENV_PREFIX + "CONFIG"):
            values.update(_flatten(load_file(file or env[ENV_PREFIX + "CONFIG"])))
        known = {st.name: st for st in settings()}
        for old, name in ENV_ALIASES.items():
            if old in env:
                values[name] = env[old]
        for name in known:
            if ENV_PREFIX + name.upper() in env:
                values[name] = env[ENV_PREFIX + name.upper()]
        if args is not None:
            for name in known:
                v = getattr(args, name, None)
                if v is not None:
                    values[name] = v
        values.update({k: v for k, v in _flatten(overrides).items() if v is not None})
        refuse_unknown(values, set(known), "config")
        if env.get(SUPERVISED_ENV) == "1":
            _refuse_disagreement(values, env)
        top: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for name, v in values.items():
            st = known[name]
            (parts[st.section] if st.section else top)[st.field] = _coerce(name, st.type, v)
        sections = {section: SECTIONS[section](**kw) for section, kw in parts.items()}
        cfg = cls(**top, **sections)
        refuse_credentials(cfg.checkpoint_url,
                           f"config: checkpoint_url ({_where('checkpoint_url')})")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The config as it may be recorded (the `start` event): credentials masked."""
        return scrub(dataclasses.asdict(self))


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


@dataclass(frozen=True)
class Setting:
    """One setting as a user meets it: its flag, its environment variable, its default."""

    name: str
    """Flat name: the field, or `<section>_<field>`."""
    section: str
    field: str
    type: str
    default: Any
    doc: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def settings() -> list[Setting]:
    """Every setting of TrainConfig and its sections, in declaration order (the flags, the
    reference page and its test all come from here)."""
    out: list[Setting] = []
    for cls, section in [(TrainConfig, ""), *((c, n) for n, c in SECTIONS.items())]:
        docs = _docs_from_source(cls)
        for f in fields(cls):
            if section == "" and f.name in SECTIONS:
                continue
            t = f.type if isinstance(f.type, str) else f.type.__name__
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append(Setting(f"{section}_{f.name}" if section else f.name, section, f.name, t,
                               default, docs.get(f.name, "")))
    return out


def _flatten(values: Mapping[str, Any]) -> dict[str, Any]:
    """`store: {sse: AES256}` -> `store_sse: AES256`; a section given as an object too."""
    out: dict[str, Any] = {}
    for key, v in values.items():
        if key in SECTIONS and dataclasses.is_dataclass(v):
            v = dataclasses.asdict(v)  # type: ignore[arg-type]
        if key in SECTIONS and isinstance(v, Mapping):
            out.update({f"{key}_{str(k).replace('-', '_')}": x for k, x in v.items()})
        else:
            out[key] = v
    return out


def _coerce(name: str, type_name: str, value: Any) -> Any:
    try:
        if type_name == "bool":
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if type_name == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if type_name == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"config: {name} must be a {type_name}, got {value!r} ({_where(name)})"
        ) from None


def refuse_unknown(values: Mapping[str, Any], known: set[str] | frozenset[str],
                   what: str) -> None:
    """One line naming each unknown key and the closest known one (a typo never passes
    silently: `max_restart: 0` would otherwise leave the default in force)."""
    unknown = sorted(set(values) - set(known))
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        parts.append(f"{key} (did you mean {close[0]}?)" if close else key)
    raise ConfigError(f"{what}: unknown field{'s' if len(unknown) > 1 else ''} "
                      f"{', '.join(parts)}; known: {', '.join(sorted(known))}")


def refuse_credentials(url: str, what: str) -> None:
    """A checkpoint URL with user:password@ would put a secret into process lists, logs and
    events; the store refuses it anyway, so say so at once, masked."""
    if has_credentials(url):
        raise ConfigError(
            f"{what}: {mask_url(url)} embeds credentials; use the AWS credential chain "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role) instead"
        )


def load_file(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"config: cannot read config file {path}: {e.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types; both mean "fix the file"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config: {path} is not valid {p.suffix or 'JSON'}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of field: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _docs_from_source(cls: type) -> dict[str, str]:
    """Field docstrings (the string under each field) become the --help texts."""
    import ast
    import inspect

    out: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return out
    body = tree.body[0].body  # type: ignore[attr-defined]
    for a, b in zip(body, body[1:], strict=False):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(
            getattr(b, "value", None), ast.Constant
        ):
            out[a.target.id] = " ".join(str(b.value.value).split())  # type: ignore[union-attr]
    return out

