"""One typed training config, from a file, environment variables and CLI flags.

Precedence: defaults < config file (YAML or JSON) < `HVD_RESILIENT_<FIELD>` environment
variables < command-line flags. Every value is checked in `__post_init__`, so a bad value stops
the job before any worker trains, with one line that names the field and how to set it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hvd_resilient.errors import ConfigError
from hvd_resilient.masking import has_credentials, mask_url, scrub

ENV_PREFIX = "HVD_RESILIENT_"
LR_SCALING = ("none", "linear")


def _where(name: str) -> str:
    return f"--{name.replace('_', '-')} / {ENV_PREFIX}{name.upper()}"


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

    # -- sources ------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one flag per field; defaults are None so unset flags do not override."""
        group = parser.add_argument_group("training config")
        group.add_argument("--config", dest="config_file", default=None,
                           help="YAML or JSON file with these fields")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            doc = _field_doc(f.name)
            if f.type in ("bool", bool):
                group.add_argument(flag, dest=f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=doc)
            else:
                group.add_argument(flag, dest=f.name, default=None, help=doc)

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
            values.update(load_file(file or env[ENV_PREFIX + "CONFIG"]))
        names = {f.name for f in fields(cls)}
        for name in names:
            if ENV_PREFIX + name.upper() in env:
                values[name] = env[ENV_PREFIX + name.upper()]
        if args is not None:
            for name in names:
                v = getattr(args, name, None)
                if v is not None:
                    values[name] = v
        values.update({k: v for k, v in overrides.items() if v is not None})
        refuse_unknown(values, names, "config")
        cfg = cls(**{k: _coerce(k, cls._type_of(k), v) for k, v in values.items()})
        refuse_credentials(cfg.checkpoint_url,
                           f"config: checkpoint_url ({_where('checkpoint_url')})")
        return cfg

    @classmethod
    def _type_of(cls, name: str) -> str:
        t = {f.name: f.type for f in fields(cls)}[name]
        return t if isinstance(t, str) else t.__name__

    def to_dict(self) -> dict[str, Any]:
        """The config as it may be recorded (the `start` event): credentials masked."""
        return scrub(dataclasses.asdict(self))


def _field_doc(name: str) -> str:
    return _DOCS.get(name, "")


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


def _docs_from_source() -> dict[str, str]:
    """Field docstrings (the string under each field) become the --help texts."""
    import ast
    import inspect

    out: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(TrainConfig))
    except (OSError, TypeError):
        return out
    body = tree.body[0].body  # type: ignore[attr-defined]
    for a, b in zip(body, body[1:], strict=False):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(
            getattr(b, "value", None), ast.Constant
        ):
            out[a.target.id] = str(b.value.value)  # type: ignore[union-attr]
    return out


_DOCS = _docs_from_source()

