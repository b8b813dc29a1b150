"""What this host's memory tier holds for a checkpoint location, from the manifests alone
(``hvd-resilient ckpt list``): never a data file, so it is as fast on a tier of hundreds of
GB as on an empty one, and it never maps or copies what a writer may be recycling.

A run's folder under the tier's root is its run key, ``<run_id>.<digest>[.<scope>]``, where
``digest`` is the first 8 hex digits of the sha256 of the run's ``checkpoint_url``
(:attr:`hvd_resilient.training.memory_tier.MemoryCommits.run_key`). Run ids and scopes may
hold dots themselves, so a folder belongs to a location when any dot-separated component
after the first is that location's digest.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from hvd_resilient.checkpoint.memory.segments import (
    DEFAULT_ROOT,
    SegmentDir,
    SegmentError,
    SegmentInfo,
    check_name,
)

ROOT_ENV = "HVD_RESILIENT_MEMORY_TIER_DIR"


def default_root() -> str:
    """Where the tier lives unless told: ``$HVD_RESILIENT_MEMORY_TIER_DIR`` (the variable
    the training config reads for ``memory_tier.dir``), else ``/dev/shm/hvd_resilient``."""
    return os.environ.get(ROOT_ENV) or DEFAULT_ROOT


def url_digest(url: str) -> str:
    """The component of a run key that names its checkpoint location."""
    return hashlib.sha256(url.encode()).hexdigest()[:8]


def key_matches(run_key: str, digests: Iterable[str]) -> bool:
    """``run_key`` is a run whose checkpoint location has one of ``digests``."""
    wanted = set(digests)
    return any(part in wanted for part in run_key.split(".")[1:])


@dataclass
class BadSegment:
    """A step whose manifest exists but cannot be trusted (unreadable, torn, foreign)."""

    owner: str
    step: int
    reason: str


@dataclass
class HeldRun:
    """The segments of one run key on this host."""

    run_key: str
    segments: list[SegmentInfo] = field(default_factory=list)
    """Steps with a manifest that parses and checks (the data itself is not re-hashed),
    oldest first, then by owner."""
    bad: list[BadSegment] = field(default_factory=list)
    """Steps whose manifest does not parse, oldest first."""

    def __bool__(self) -> bool:
        return bool(self.segments or self.bad)


def subdirs(path: str) -> list[str]:
    """The folders directly below ``path`` (none when it cannot be listed)."""
    try:
        with os.scandir(path) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except OSError:  # missing root, a run removed while listing, no permission
        return []


def _plain(name: str) -> bool:
    try:
        check_name(name, "name")
    except ValueError:
        return False
    return True


def _odd_fields(info: SegmentInfo) -> str:
    """Names of the fields a listing prints that hold the wrong type (a manifest whose digest
    matches but that another version, or a hand, wrote)."""
    ints = ("epoch", "world_size", "data_bytes", "index_bytes")
    odd = [n for n in ints if not isinstance(getattr(info, n), int)]
    odd += [n for n in ("created",)
            if not isinstance(info.created, (int, float)) or not 0 <= info.created < 1e11]
    odd += [n for n in ("host",) if not isinstance(info.host, str)]
    return ", ".join(odd)


def held_segments(urls: str | Iterable[str], root: str | None = None) -> dict[str, HeldRun]:
    """Every run key under ``root`` (default: :func:`default_root`) whose checkpoint location
    is one of ``urls``, scoped or not, with the segments each owner holds. Runs without any
    segment (only a writer lock, or everything recycled meanwhile) are left out.

    Reads manifests only. A manifest that vanishes between the listing and its reading was
    recycled by a live writer and is skipped; one that is there and does not parse is
    reported in :attr:`HeldRun.bad`. Never raises for what it finds on disk.
    """
    root = root or default_root()
    digests = {url_digest(u) for u in ([urls] if isinstance(urls, str) else urls)}
    found: dict[str, HeldRun] = {}
    for run_key in subdirs(root):
        if not _plain(run_key) or not key_matches(run_key, digests):
            continue
        run = HeldRun(run_key)
        for owner in filter(_plain, subdirs(os.path.join(root, run_key))):
            seg = SegmentDir(root, run_key, owner)
            for step in sorted(seg.steps()):
                try:
                    info = seg.info(step)
                except SegmentError as e:
                    if os.path.lexists(seg.file(step, ".json")):
                        run.bad.append(BadSegment(owner, step, str(e)))
                    continue
                odd = _odd_fields(info)
                if odd:
                    run.bad.append(BadSegment(owner, step, f"manifest of step {step}: "
                                                           f"unexpected types ({odd})"))
                else:
                    run.segments.append(info)
        run.segments.sort(key=lambda i: (i.step, i.owner))
        run.bad.sort(key=lambda b: (b.step, b.owner))
        if run:
            found[run_key] = run
    return found
