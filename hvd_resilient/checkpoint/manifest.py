"""The checkpoint layout and its manifest.

Layout: ``<base>/step-<10-digit step>/<files...>`` plus ``manifest.json``, written LAST. The
manifest holds every file's size and sha256, so a checkpoint whose upload died halfway (no
manifest) does not exist, and one whose bytes rotted afterwards (checksum mismatch) is
detected before it is loaded.

Two layouts share this manifest: ``replicated`` (rank 0 wrote the whole state)
and ``sharded`` (FSDP: every rank wrote its own shard files under ``shards/`` with
``torch.distributed.checkpoint``, rank 0 the small ``run_state.pt`` of counters and sampler).
Manifests from before the field existed are replicated.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "hvd_resilient.checkpoint/1"
REPLICATED, SHARDED = "replicated", "sharded"
LAYOUTS = (REPLICATED, SHARDED)
SHARD_DIR = "shards/"
"""Where a sharded checkpoint keeps the files of `torch.distributed.checkpoint`."""
_STEP_DIR = re.compile(r"^step-(\d{10,})$")


class ManifestError(ValueError):
    """A manifest that cannot be parsed or is inconsistent; its checkpoint does not exist."""


def step_dir(step: int) -> str:
    """The folder name of the checkpoint of ``step``: zero-padded so names sort like steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a folder name made by :func:`step_dir`, or ``None`` for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def library_version() -> str:
    try:
        import hvd_resilient

        return str(getattr(hvd_resilient, "__version__", "0"))
    except ImportError:  # pragma: no cover - we are inside the package
        return "0"


def torch_version() -> str:
    # Read the installed metadata rather than importing torch: listing checkpoints from the
    # CLI should not pay torch's import time.
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


@dataclass(frozen=True)
class FileEntry:
    """One stored file of a checkpoint."""

    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointInfo:
    """What a manifest says about one checkpoint, plus where it lives.

    ``prefix`` is the store key of the checkpoint folder (``step-0000000100``); ``url`` the
    same below the store's base URL, without credentials.
    """

    step: int
    epoch: int
    world_size: int
    files: dict[str, FileEntry]
    run_id: str = ""
    created: float = 0.0
    library_version: str = "0"
    torch_version: str = "none"
    meta: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""
    url: str = ""
    layout: str = REPLICATED
    """replicated (one full state) or sharded (one shard per rank at ``world_size``)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def shard_files(self) -> int:
        """Data files of a sharded checkpoint (its DCP ``.metadata`` not counted); 0 if
        replicated."""
        return sum(1 for n in self.files if n.startswith(SHARD_DIR)
                   and not n[len(SHARD_DIR):].startswith("."))

    def key(self, name: str) -> str:
        """The store key of file ``name`` of this checkpoint."""
        return f"{self.prefix}/{name}"

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT,
            "layout": self.layout,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "run_id": self.run_id,
            "created": self.created,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "files": {k: dataclasses.asdict(v) for k, v in sorted(self.files.items())},
            "meta": self.meta,
        }
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(
        cls, data: bytes | bytearray, *, prefix: str = "", url: str = ""
    ) -> CheckpointInfo:
        """Parse and validate a manifest.

        Raises:
            ManifestError: not JSON, wrong format, missing or ill-typed fields, or a step that
                disagrees with the folder name in ``prefix``.
        """
        try:
            doc = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON ({e.msg})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ManifestError(f"manifest format is not {FORMAT!r}")
        try:
            files = {
                str(name): FileEntry(size=_int(f["size"]), sha256=_sha(f["sha256"]))
                for name, f in doc["files"].items()
            }
            info = cls(
                step=_int(doc["step"]),
                epoch=_int(doc["epoch"]),
                world_size=_int(doc["world_size"]),
                files=files,
                run_id=str(doc.get("run_id", "")),
                created=float(doc.get("created", 0.0)),
                library_version=str(doc.get("library_version", "0")),
                torch_version=str(doc.get("torch_version", "none")),
                meta=dict(doc.get("meta") or {}),
                prefix=prefix,
                url=url,
                layout=str(doc.get("layout", REPLICATED)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"manifest field missing or malformed: {e}") from None
        if info.layout not in LAYOUTS:
            raise ManifestError(f"manifest layout {info.layout!r} is not one of "
                                f"{', '.join(LAYOUTS)} (written by a newer version?)")
        folder = prefix.rstrip("/").rsplit("/", 1)[-1]
        if prefix and parse_step_dir(folder) != info.step:
            raise ManifestError(f"manifest says step {info.step} but lives in {folder!r}")
        return info


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def _sha(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise ValueError(f"expected a sha256 hex digest, got {v!r}")
    return v


def new_info(
    step: int,
    epoch: int,
    world_size: int,
    files: dict[str, FileEntry],
    *,
    run_id: str = "",
    meta: dict[str, Any] | None = None,
    prefix: str = "",
    url: str = "",
    layout: str = REPLICATED,
) -> CheckpointInfo:
    """A manifest for a checkpoint being written now (stamps time and versions)."""
    return CheckpointInfo(
        step=step,
        epoch=epoch,
        world_size=world_size,
        files=dict(files),
        run_id=run_id,
        created=time.time(),
        library_version=library_version(),
        torch_version=torch_version(),
        meta=dict(meta or {}),
        prefix=prefix,
        url=url,
        layout=layout,
    )
