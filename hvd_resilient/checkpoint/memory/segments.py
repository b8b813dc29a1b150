"""Commits kept in host memory outside the training process: a file system in RAM
(``/dev/shm``), one folder per run and owner, so that a commit outlives the process that made
it and the next process on the host finds it without any network or store.

Layout: ``<root>/<run_id>/<owner>/step-<10 digits>.{data,index,json}``. ``.data`` holds the
raw tensor bytes of :func:`~hvd_resilient.checkpoint.split.split_state` (each part at a
page-aligned offset), ``.index`` its small index, and ``.json`` the manifest, written LAST by
a rename: a segment without a manifest does not exist, exactly like a durable checkpoint.
The manifest holds the xxh3-128 digest of every part and of the index (sha256 runs at about
1.3 GB/s a core here, xxh3 at about 11 GB/s; corruption, not an attacker, is what this tier
guards against: the files never leave the hosts of the job), and a digest of itself.

Never torn: a writer never touches the files a manifest names. It recycles the older of the
two newest complete segments (manifest removed FIRST, then the data file renamed to the new
step's temporary name), so the newest complete commit stays intact while the next one is
written, and the recycled file keeps its pages (a copy into pages already touched costs a
third of one into fresh memory). At most two data files per owner exist.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hvd_resilient.checkpoint.host_buffers import allocate, populate_pages

FORMAT = "hvd_resilient.memory/1"
ALIGN = 4096
DEFAULT_ROOT = "/dev/shm/hvd_resilient"
_STEP = re.compile(r"^step-(\d{10})\.json$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TMP = ".tmp"


class SegmentError(ValueError):
    """A segment that must not be loaded: missing, torn or corrupt (one line says which)."""


class TierFull(OSError):
    """Writing this commit would pass the tier's cap or fill its file system."""


def digest(data: Any) -> str:
    import xxhash

    return xxhash.xxh3_128(data).hexdigest()


def check_name(name: str, what: str) -> str:
    """Run ids and owners become folder names and URL paths: plain names only."""
    if not _NAME.fullmatch(name):  # not match: "$" also matches before a final "\n"
        raise ValueError(f"{what} {name!r} is not a plain name (letters, digits, . _ -)")
    return name


def stem(step: int) -> str:
    return f"step-{step:010d}"


@dataclass
class SegmentInfo:
    """What a manifest says about one segment."""

    step: int
    epoch: int
    world_size: int
    run_id: str
    owner: str
    parts: list[tuple[int, int, str]]
    """(offset, size, xxh3) of every part inside the data file."""
    data_bytes: int
    index_bytes: int
    index_digest: str
    created: float = 0.0
    host: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + self.index_bytes

    def to_json(self) -> bytes:
        body = asdict(self)
        return json.dumps({"format": FORMAT, "body": body, "xxh3": _body_digest(body)},
                          indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SegmentInfo:
        try:
            doc = json.loads(raw)
            if doc.get("format") != FORMAT:
                raise SegmentError(f"manifest format {doc.get('format')!r}, expected {FORMAT}")
            if doc.get("xxh3") != _body_digest(doc["body"]):
                raise SegmentError("manifest digest does not match its contents")
            body = doc["body"]
            body["parts"] = [tuple(p) for p in body["parts"]]
            return cls(**body)
        except SegmentError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SegmentError(f"manifest unreadable ({type(e).__name__}: {e})") from None


def _body_digest(body: dict[str, Any]) -> str:
    return digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _FileBuffers:
    """The ``buffers`` that :func:`split_state` copies into: slices of one mapped data file,
    so the copy inside the step is the only copy."""

    def __init__(self, prepare: Callable[[int], str]) -> None:
        self._prepare = prepare
        self.path = ""
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.map: mmap.mmap | None = None

    def take(self, sizes: list[int]) -> list[memoryview]:
        self.sizes = list(sizes)
        pos = 0
        for n in sizes:
            self.offsets.append(pos)
            pos = _aligned(pos + n)
        self.path = self._prepare(max(pos, 1))
        with open(self.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), max(pos, 1), flags=mmap.MAP_SHARED)
        populate_pages(self.map)  # pages mapped at once, not one fault each; GIL released
        view = memoryview(self.map)
        return [view[o:o + n] for o, n in zip(self.offsets, sizes, strict=True)]


@dataclass
class Pending:
    """A segment whose bytes are in place but not yet checksummed and published."""

    step: int
    meta: dict[str, Any]
    files: dict[str, Any]
    buffers: _FileBuffers
    stall_seconds: float


class SegmentDir:
    """The segments of one owner (``replicated``, or one rank's shards) of one run on this
    host. One writer per owner and host; any number of readers."""

    def __init__(self, root: str, run_id: str, owner: str, *, max_bytes: int = 0,
                 reserve_fraction: float = 0.1) -> None:
        self.root = root
        self.run_id = check_name(run_id, "run id")
        self.owner = check_name(owner, "owner")
        self.path = os.path.join(root, run_id, owner)
        self.max_bytes = max_bytes
        """Cap on the bytes of every run under ``root`` on this host (0: half the file
        system)."""
        self.reserve_fraction = reserve_fraction
        """Never leave less than this share of the file system free."""

    # -- reading ----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a manifest, newest first (not yet verified)."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        found = [int(m.group(1)) for m in map(_STEP.match, names) if m]
        return sorted(found, reverse=True)

    def file(self, step: int, suffix: str) -> str:
        return os.path.join(self.path, stem(step) + suffix)

    def info(self, step: int) -> SegmentInfo:
        try:
            with open(self.file(step, ".json"), "rb") as f:
                raw = f.read()
        except OSError as e:
            raise SegmentError(f"manifest of step {step} unreadable ({e.strerror})") from None
        info = SegmentInfo.from_json(raw)
        if info.step != step or info.run_id != self.run_id or info.owner != self.owner:
            raise SegmentError(f"manifest of step {step} describes {info.run_id}/{info.owner} "
                               f"step {info.step}")
        return info

    def read(self, step: int) -> tuple[SegmentInfo, dict[str, Any]]:
        """The verified files of a segment in fresh process memory (never a mapping of the
        segment itself: the writer recycles that file later)."""
        info = self.info(step)
        raw: dict[str, Any] = {}
        for suffix in (".data", ".index"):
            path = self.file(step, suffix)
            try:
                buf, got, n = _read_whole(path)
            except OSError as e:
                raise SegmentError(f"step {step}: {os.path.basename(path)} unreadable "
                                   f"({e.strerror})") from None
            if got != n:
                raise SegmentError(f"step {step}: short read of {os.path.basename(path)}")
            raw[suffix] = buf
        return info, files_from(info, raw[".data"], raw[".index"])

    # -- writing ----------------------------------------------------------------------------
    def begin(self, step: int, state: Mapping[str, Any], meta: dict[str, Any]) -> Pending:
        """Inside the step: copies ``state``'s tensors into a data file (the one copy).

        Raises:
            TierFull: the cap or the file system's free space does not allow it (nothing
                written; the previous segments are untouched).
        """
        from hvd_resilient.checkpoint.split import split_state

        t0 = time.perf_counter()
        os.makedirs(self.path, exist_ok=True)
        bufs = _FileBuffers(lambda size: self._prepare(step, size))
        files = split_state(state, buffers=bufs)
        return Pending(step, meta, files, bufs, time.perf_counter() - t0)

    def finish(self, pending: Pending) -> SegmentInfo:
        """Off the step: checksums and the index, then the manifest (the segment exists from
        that rename on), then older segments beyond the two newest are removed."""
        from hvd_resilient.checkpoint.serialize import to_buffer
        from hvd_resilient.checkpoint.split import INDEX_FILE

        bufs, step = pending.buffers, pending.step
        try:
            index_raw = to_buffer(pending.files.pop(INDEX_FILE))
            pending.files.clear()  # the part views: nothing may refer to the mapping now
            assert bufs.map is not None
            with memoryview(bufs.map) as view:
                parts = [(o, n, digest(view[o:o + n]))
                         for o, n in zip(bufs.offsets, bufs.sizes, strict=True)]
            bufs.map.close()
            _write_new(self.file(step, ".index"), index_raw)
            os.replace(bufs.path, self.file(step, ".data"))
            info = SegmentInfo(
                step=step, epoch=int(pending.meta.get("epoch", 0)),
                world_size=int(pending.meta.get("world_size", 0)), run_id=self.run_id,
                owner=self.owner, parts=parts, data_bytes=os.path.getsize(
                    self.file(step, ".data")),
                index_bytes=len(index_raw), index_digest=digest(index_raw),
                created=time.time(), host=socket.gethostname(),
                meta={k: v for k, v in pending.meta.items()
                      if k not in ("epoch", "world_size")})
            _write_new(self.file(step, ".json"), info.to_json())
        except BaseException:
            self._discard_tmp(step)
            raise
        for old in self.steps()[2:]:
            self.drop(old)
        return info

    def drop(self, step: int) -> None:
        for suffix in (".json", ".index", ".data"):  # manifest first
            _remove(self.file(step, suffix))

    def _prepare(self, step: int, size: int) -> str:
        """A data file of ``size`` bytes for ``step``: a recycled one when two complete
        segments exist, else a new one (after checking the cap and free space)."""
        tmp = self.file(step, ".data" + _TMP)
        steps = self.steps()
        old = steps[-1] if len(steps) >= 2 else None
        try:
            have = os.path.getsize(tmp if old is None else self.file(old, ".data"))
        except OSError:
            have = 0
        # before anything changes: a TierFull leaves every segment as it was
        self._check_space(max(size - have, 0))
        if old is not None:
            _remove(self.file(old, ".json"))  # unpublished first: never a manifest over bytes
            _remove(self.file(old, ".index"))
            try:
                os.replace(self.file(old, ".data"), tmp)
            except OSError:
                pass
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return tmp

    def _check_space(self, extra: int) -> None:
        if extra <= 0:
            return
        st = os.statvfs(self.root)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        cap = self.max_bytes or total // 2
        used = tree_bytes(self.root)
        if used + extra > cap:
            raise TierFull(f"memory tier at {self.root} would hold {used + extra} bytes, over "
                           f"its cap of {cap}")
        if free - extra < total * self.reserve_fraction:
            raise TierFull(f"{self.root} has {free} bytes free; writing {extra} would leave "
                           f"less than {self.reserve_fraction:.0%} of it")

    def _discard_tmp(self, step: int) -> None:
        for suffix in (".data", ".index", ".json"):
            _remove(self.file(step, suffix + _TMP))

    def sweep(self) -> None:
        """A new writer: files of a writer that died mid-segment (temporaries, data without
        a manifest) go."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        live = {stem(s) for s in self.steps()}
        for n in names:
            if n.startswith("step-") and (n.endswith(_TMP) or n.split(".", 1)[0] not in live):
                _remove(os.path.join(self.path, n))

    def clear(self) -> None:
        """Every segment of this owner (the lock file stays)."""
        for step in self.steps():
            self.drop(step)
        self.sweep()

    def remove(self) -> None:
        """This owner's segments, all of them (the run ended)."""
        shutil.rmtree(self.path, ignore_errors=True)


READ_PIECE = 64 << 20


def _read_threads() -> int:
    """Threads a restore reads with: the cores this process may run on, at most 8. A restore
    is bound by the kernel supplying fresh pages (about 1.4 GB/s a core here), and those
    faults run in parallel on the faulting threads' own cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _read_whole(path: str) -> tuple[memoryview, int, int]:
    """A whole file into fresh memory, big files in pieces on several threads (``preadv``
    releases the GIL); returns (buffer, bytes read, file size)."""
    from concurrent.futures import ThreadPoolExecutor

    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        n = os.fstat(fd).st_size
        if n == 0:
            return memoryview(bytearray()), 0, 0
        threads = min(_read_threads(), -(-n // READ_PIECE))
        buf = memoryview(allocate(n, populate=threads == 1))[:n]
        if threads == 1:
            return buf, f.readinto(buf), n

        def piece(off: int) -> int:
            end, done = min(off + READ_PIECE, n), 0
            while off + done < end:
                got = os.preadv(fd, [buf[off + done:end]], off + done)
                if got == 0:
                    break
                done += got
            return done

        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(piece, range(0, n, READ_PIECE)))
        return buf, got, n


def files_from(info: SegmentInfo, data: Any, index_raw: Any) -> dict[str, Any]:
    """Checks every digest and returns the files :func:`join_state` takes.

    Raises:
        SegmentError: a size or digest that does not match (one line naming the part).
    """
    from hvd_resilient.checkpoint.serialize import from_bytes
    from hvd_resilient.checkpoint.split import INDEX_FILE, part_name

    where = f"memory segment {info.owner} step {info.step}"
    if len(data) != info.data_bytes or len(index_raw) != info.index_bytes:
        raise SegmentError(f"{where}: {len(data)}+{len(index_raw)} bytes, manifest says "
                           f"{info.data_bytes}+{info.index_bytes}")
    if digest(index_raw) != info.index_digest:
        raise SegmentError(f"{where}: index digest mismatch")
    view = memoryview(data).cast("B")
    files: dict[str, Any] = {}
    for i, (offset, size, want) in enumerate(info.parts):
        part = view[offset:offset + size]
        if len(part) != size or digest(part) != want:
            raise SegmentError(f"{where}: part {i} digest mismatch (corrupt copy)")
        files[part_name(i)] = part
    try:
        files[INDEX_FILE] = from_bytes(index_raw)
    except Exception as e:
        raise SegmentError(f"{where}: index does not load ({type(e).__name__})") from None
    return files


def tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, n))
            except OSError:
                pass
    return total


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_new(path: str, data: Any) -> None:
    """``path`` appears whole or not at all (written under a temporary name, renamed)."""
    tmp = path + _TMP
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
