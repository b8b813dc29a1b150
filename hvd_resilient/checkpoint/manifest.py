"""The checkpoint layout and its manifest.

Layout: ``<base>/step-<10-digit step>/<files...>`` plus ``manifest.json``, written LAST. The
manifest holds every file's size and digest, so a checkpoint whose upload died halfway (no
manifest) does not exist, and one whose bytes rotted afterwards (checksum mismatch) is
detected before it is loaded.

Each file's entry names its digest's algorithm by its key: ``{"size": N, "xxh3_128": "<32
hex>"}`` since format ``/3``, ``{"size": N, "sha256": "<64 hex>"}`` before. A reader verifies
with the algorithm the entry names (:mod:`~hvd_resilient.checkpoint.digest`), so old
checkpoints keep their sha256 check. A manifest is written in the oldest format that can
hold it: ``/3`` only once an entry is not sha256, so an older version refuses it as newer
(and never mistakes it for a torn folder to overwrite or prune) instead of failing on a
missing ``sha256``.

The manifest checks itself too: ``manifest_sha256`` is the sha256 of the manifest's own bytes
with that value replaced by 64 zeros, so ANY change of a byte (a flipped bit included) is
refused on every read, and a duplicated key is refused by the parser (JSON would keep the last
one). Manifests of format ``/1`` (written before the field existed) carry no such checksum and
still load; any manifest carrying the field is checked whatever format it claims, so no single
flip of the format turns a newer manifest into an old one that skips the check. The manifest's
own checksum stays sha256: it is a few KB, and changing it would change every format.

Two layouts share this manifest: ``replicated`` (rank 0 wrote the whole state)
and ``sharded`` (FSDP: every rank wrote its own shard files under ``shards/`` with
``torch.distributed.checkpoint``, rank 0 the small ``run_state.pt`` of counters and sampler).
Manifests from before the field existed are replicated.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from hvd_resilient.checkpoint.digest import ALGORITHMS, SHA256, check_hex
from hvd_resilient.checkpoint.stores import validate_key

MANIFEST_NAME = "manifest.json"
FORMAT = "hvd_resilient.checkpoint/3"
"""Manifests written now: :data:`CHECKSUM_FIELD`, and file digests other than sha256."""
SHA256_FORMAT = "hvd_resilient.checkpoint/2"
"""Manifests with :data:`CHECKSUM_FIELD` whose files all have sha256 digests: what versions
before xxh3-128 wrote, and what is still written for such files (older versions read it)."""
LEGACY_FORMAT = "hvd_resilient.checkpoint/1"
"""Manifests written before the self-checksum existed; still read (without that check)."""
_FORMATS = (FORMAT, SHA256_FORMAT, LEGACY_FORMAT)
CHECKSUM_FIELD = "manifest_sha256"
_ZEROS = "0" * 64
REPLICATED, SHARDED = "replicated", "sharded"
LAYOUTS = (REPLICATED, SHARDED)
SHARD_DIR = "shards/"
"""Where a sharded checkpoint keeps the files of `torch.distributed.checkpoint`."""
_STEP_DIR = re.compile(r"^step-(\d{10,})$")


class ManifestError(ValueError):
    """A manifest that cannot be parsed or is inconsistent; its checkpoint does not exist."""


class NewerManifestError(ManifestError):
    """A manifest of a format newer than this version reads: not loaded, and never
    overwritten either (it may be a good checkpoint of a newer version)."""


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
    """One stored file of a checkpoint: its size and its digest by ``algorithm`` (one of
    :data:`~hvd_resilient.checkpoint.digest.ALGORITHMS`).

    ``algorithm`` defaults to sha256 because a two-field entry always meant that; saves pass
    the digest module's ``DEFAULT``. The digest is checked against the algorithm here, so an
    xxh3 digest can never be filed as a sha256 one (it would fail every verification).

    Raises:
        ValueError: an unknown algorithm or a digest that is not its hex form.
    """

    size: int
    digest: str
    algorithm: str = SHA256

    def __post_init__(self) -> None:
        check_hex(self.digest, self.algorithm)

    def to_json(self) -> dict[str, Any]:
        """The manifest entry: the algorithm is the key of its digest."""
        return {"size": self.size, self.algorithm: self.digest}

    @classmethod
    def from_json(cls, doc: Any) -> FileEntry:
        """Parse one manifest entry: exactly one digest of a known algorithm.

        Raises:
            ValueError, TypeError, KeyError, AttributeError: malformed (the caller words it).
        """
        found = [a for a in ALGORITHMS if a in doc]
        if len(found) != 1:
            raise ValueError(f"expected one digest ({' or '.join(ALGORITHMS)}) per file, "
                             f"found {found or 'none'}")
        return cls(size=_int(doc["size"]), digest=doc[found[0]], algorithm=found[0])


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

    def to_json(self, *, legacy: bool = False) -> bytes:
        """The manifest's bytes with its own checksum (see the module doc), in format ``/3``,
        or ``/2`` when every file has a sha256 digest (byte for byte what versions before
        xxh3-128 wrote).

        ``legacy=True`` writes what versions before the checksum wrote (format ``/1``, no
        checksum): for tests and for tools that must feed an older reader.

        Raises:
            ValueError: ``legacy`` with a file whose digest is not sha256 (format ``/1``
                cannot hold it).
        """
        sha256_only = all(f.algorithm == SHA256 for f in self.files.values())
        if legacy and not sha256_only:
            raise ValueError(f"format {LEGACY_FORMAT!r} holds sha256 digests only")
        doc: dict[str, Any] = {
            "format": LEGACY_FORMAT if legacy else SHA256_FORMAT if sha256_only else FORMAT,
            "layout": self.layout,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "run_id": self.run_id,
            "created": self.created,
            "library_version": self.library_version,
            "torch_version": self.torch_version,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
            "meta": self.meta,
        }
        if legacy:
            return _dumps(doc)
        doc[CHECKSUM_FIELD] = _ZEROS
        blank = _dumps(doc)
        digest = hashlib.sha256(blank).hexdigest()
        old, new = _checksum_item(_ZEROS), _checksum_item(digest)
        if blank.count(old) != 1:  # pragma: no cover - a file digest of 64 zeros
            raise ManifestError("cannot place the manifest checksum")
        return blank.replace(old, new)

    @classmethod
    def from_json(
        cls, data: bytes | bytearray, *, prefix: str = "", url: str = ""
    ) -> CheckpointInfo:
        """Parse and validate a manifest: the one reading that listing, ``ckpt verify``,
        resume and retention all go through.

        Raises:
            ManifestError: not UTF-8 JSON, a duplicated key, an unknown format, a checksum
                that does not match the bytes (format ``/2``, or any manifest carrying one),
                missing or ill-typed fields, or a step that disagrees with the folder name in
                ``prefix``.
        """
        raw = bytes(data)
        try:
            doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON ({getattr(e, 'msg', e)})") from None
        except _BadJSONError as e:
            raise ManifestError(f"manifest {e}") from None
        fmt = doc.get("format") if isinstance(doc, dict) else None
        newer = re.fullmatch(r"hvd_resilient\.checkpoint/([1-9][0-9]{0,5})", str(fmt))
        if newer and int(newer.group(1)) > _version(FORMAT):
            raise NewerManifestError(f"manifest format {fmt!r} is newer than this version "
                                     f"reads ({FORMAT!r}); upgrade hvd_resilient")
        if fmt not in _FORMATS:
            raise ManifestError(f"manifest format is not {FORMAT!r} (nor an older one: "
                                f"{', '.join(map(repr, _FORMATS[1:]))})")
        if doc["format"] != LEGACY_FORMAT or CHECKSUM_FIELD in doc:
            _check_checksum(raw, doc.get(CHECKSUM_FIELD))
        try:
            files = {_name(name): FileEntry.from_json(f) for name, f in doc["files"].items()}
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


def _dumps(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _checksum_item(value: str) -> bytes:
    """How the checksum field appears in the manifest's bytes (``_dumps``' separators)."""
    return f'"{CHECKSUM_FIELD}": "{value}"'.encode()


def _check_checksum(raw: bytes, value: Any) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ManifestError(f"manifest lacks a valid {CHECKSUM_FIELD}")
    item = _checksum_item(value)
    if raw.count(item) != 1:
        raise ManifestError(f"manifest {CHECKSUM_FIELD} is not where it is written")
    if hashlib.sha256(raw.replace(item, _checksum_item(_ZEROS))).hexdigest() != value:
        raise ManifestError("manifest checksum mismatch (its bytes changed after writing)")


class _BadJSONError(Exception):
    """JSON that parses but is no manifest: its message completes "manifest ..."."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a repeated key is an error, not "the last one wins"."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _BadJSONError(f"repeats the key {k!r}")
        out[k] = v
    return out



def _name(v: Any) -> str:
    """A file name of the checkpoint: a store key inside its folder, not the manifest."""
    if v == MANIFEST_NAME:
        raise ValueError(f"the manifest lists itself ({MANIFEST_NAME!r})")
    return validate_key(v)


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def _version(fmt: str) -> int:
    return int(fmt.rsplit("/", 1)[1])


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
