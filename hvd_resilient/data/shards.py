"""Streamed shards: webdataset tar files on a file:// or s3:// location, read ahead in the
background, addressed by sample id so that the elastic shard sampler can split them.

Format: webdataset's (a POSIX tar; the members of one sample share a key, `000017.txt`,
`000017.cls`), written with webdataset's own `TarWriter`, so the shards are read by
`webdataset.WebDataset` and by any tar tool as they are. Beside them `index.json` (written
last: a location without it holds no shards) lists each shard with its sample count, size and
sha256. The counts are what lets every rank compute every other rank's shard cursors
(`ElasticShardSampler`) without reading a byte; the checksums catch a torn or replaced shard.

Reading: the training process fetches the shards its rank will read next into a local cache
(a thread pool; S3 objects by ranged GETs with the checksum computed on the way), a few
shards ahead of the one being read, and drops the ones no undelivered batch needs. Loader
workers then read samples from the local files by offset (each worker indexes a shard's tar
headers once). A file:// location is read in place; its coming shards are only announced to
the kernel (`posix_fadvise(WILLNEED)`). An unreadable shard (missing, truncated, not a tar,
checksum mismatch) is reported once (`bad_shard`) and each of its samples then fails to load,
which `data.on_bad_sample` turns into a stop or a skip.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.data.errors import BadShardError, DataError

logger = logging.getLogger(__name__)

INDEX_KEY = "index.json"
FORMAT = "webdataset-tar"
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext rule


@dataclass(frozen=True)
class ShardInfo:
    key: str
    """Relative to the location's URL (or an absolute path for local files without index)."""
    samples: int
    bytes: int
    sha256: str = ""


@dataclass
class ShardIndex:
    """The shards of one data set, in order; sample ids run over them in this order."""

    url: str
    shards: list[ShardInfo]
    format: str = FORMAT

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "shards": [asdict(s) for s in self.shards]},
                          indent=1)

    @classmethod
    def from_json(cls, url: str, text: str) -> ShardIndex:
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise DataError(f"data: {url}/{INDEX_KEY} is not a shard index of format {FORMAT}")
        return cls(url, [ShardInfo(**s) for s in d["shards"]])


def _store(url: str, options: Mapping[str, Any] | None) -> Any:
    from hvd_resilient.checkpoint.stores import open_store

    return open_store(url, **dict(options or {}))


def write_shards(samples: Iterable[Mapping[str, Any]], url: str, *, samples_per_shard: int,
                 name: str = "shard", store_options: Mapping[str, Any] | None = None
                 ) -> ShardIndex:
    """Writes `samples` (webdataset dicts: `__key__` plus one entry per member, bytes or str or
    anything webdataset's encoder takes) as tar shards of `samples_per_shard` to `url`, then
    the index. Shards are written with put_new and fixed member times, so writers racing with
    the same samples (every rank preparing the same data) agree instead of conflicting.

    Raises:
        DataError: the location already holds a different data set's shards.
        StoreError: the store failed (after its retries).
    """
    import webdataset as wds

    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    store = _store(url, store_options)
    try:
        shards: list[ShardInfo] = []
        buf: io.BytesIO | None = None
        writer: Any = None
        count = 0

        def flush() -> None:
            nonlocal buf, writer, count
            if writer is None:
                return
            writer.close()
            data = buf.getvalue()  # type: ignore[union-attr]
            key = f"{name}-{len(shards):06d}.tar"
            store.put_new(key, data)
            shards.append(ShardInfo(key, count, len(data), hashlib.sha256(data).hexdigest()))
            buf, writer, count = None, None, 0

        for sample in samples:
            if writer is None:
                buf = io.BytesIO()
                writer = wds.TarWriter(buf, mtime=0)  # an int: a float adds a pax header
            writer.write(dict(sample))
            count += 1
            if count == samples_per_shard:
                flush()
        flush()
        if not shards:
            raise ValueError("no samples to write")
        index = ShardIndex(store.url, shards)
        store.put_new(INDEX_KEY, index.to_json().encode())
        return index
    except Exception as e:
        from hvd_resilient.checkpoint.stores import StoreExistsError

        if isinstance(e, StoreExistsError):
            raise DataError(f"data: {store.url} already holds other shards; write to a new "
                            "location") from None
        raise
    finally:
        store.close()


def read_index(url: str, store_options: Mapping[str, Any] | None = None) -> ShardIndex:
    """The index of the shards at `url`.

    Raises:
        DataError: no index there (no shards, or their writing never finished).
    """
    from hvd_resilient.checkpoint.stores import StoreNotFoundError

    store = _store(url, store_options)
    try:
        return ShardIndex.from_json(store.url, bytes(store.get(INDEX_KEY)).decode())
    except StoreNotFoundError:
        raise DataError(f"data: no {INDEX_KEY} at {store.url}: no shards there, or their "
                        "writing did not finish") from None
    finally:
        store.close()


def index_files(paths: Sequence[str]) -> ShardIndex:
    """An index for local tar files that have none (their headers are read to count)."""
    shards = []
    for p in paths:
        path = os.path.abspath(p)
        t = _TarShard(path, path)
        t.close()
        shards.append(ShardInfo(path, len(t.samples), os.path.getsize(path)))
    return ShardIndex("", shards)


# -- reading one local shard (in loader workers) ----------------------------------------------
def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large numbers
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b" \0") or b"0", 8)


def scan_tar(fd: int, name: str) -> list[tuple[str, int, int]]:
    """(member name, data offset, size) of every regular file of the tar open at `fd`.

    Reads only the 512-byte headers (ustar, pax and GNU long names), by offset: tarfile's
    parser costs ~0.3 ms a member here, which every worker would pay for every shard.

    Raises:
        BadShardError: a header's checksum is wrong, or the file ends inside a member.
    """
    size = os.fstat(fd).st_size
    out: list[tuple[str, int, int]] = []
    pos = 0
    pax: dict[str, str] = {}
    long_name: str | None = None
    while pos + 512 <= size:
        hdr = os.pread(fd, 512, pos)
        if hdr.count(0) == 512:
            return out  # end-of-archive blocks
        try:
            ok = _octal(hdr[148:156]) == sum(hdr[:148]) + 256 + sum(hdr[156:])
        except ValueError:
            ok = False
        if not ok:
            raise BadShardError(name, f"not a tar file (bad header at byte {pos})")
        member = hdr[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        prefix = hdr[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
        if hdr[257:262] == b"ustar" and prefix:
            member = f"{prefix}/{member}"
        msize = _octal(hdr[124:136])
        kind = hdr[156:157]
        data = pos + 512
        if data + msize > size:
            raise BadShardError(name, f"truncated inside member {member}")
        if kind in (b"x", b"L"):
            body = os.pread(fd, msize, data)
            if kind == b"L":
                long_name = body.split(b"\0", 1)[0].decode("utf-8", "replace")
            else:  # records "LEN key=value\n"
                text, i = body.decode("utf-8", "replace"), 0
                try:
                    while i < len(text):
                        length = int(text[i:text.index(" ", i)])
                        k, _, v = text[text.index(" ", i) + 1:i + length - 1].partition("=")
                        pax[k] = v
                        i += length
                except ValueError:
                    raise BadShardError(name, f"bad pax header at byte {pos}") from None
        else:
            if "size" in pax:
                msize = int(pax["size"])
            if kind in (b"0", b"\0", b"7"):
                out.append((pax.get("path") or long_name or member, data, msize))
            pax, long_name = {}, None
            if data + msize > size:
                raise BadShardError(name, f"truncated inside member {member}")
        pos = data + (msize + 511) // 512 * 512
    if pos != size:
        raise BadShardError(name, "truncated (no end-of-archive)")
    return out


class _TarShard:
    """Sample k of a local tar shard, read by offset."""

    def __init__(self, path: str, name: str, expect: int | None = None) -> None:
        self.name = name
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise BadShardError(name, f"{type(e).__name__}: {e.strerror}") from None
        try:
            members = scan_tar(self.fd, name)
        except BaseException:
            self.close()
            raise
        self.samples: list[tuple[str, list[tuple[str, int, int]]]] = []
        for member, offset, size in members:
            match = _KEY_EXT.match(member)
            if not match:
                continue
            key, ext = match.group(1), match.group(2)
            if not self.samples or self.samples[-1][0] != key:
                self.samples.append((key, []))
            self.samples[-1][1].append((ext, offset, size))
        if expect is not None and len(self.samples) != expect:
            self.close()
            raise BadShardError(name, f"holds {len(self.samples)} samples, the index says "
                                      f"{expect}")

    def sample(self, k: int) -> dict[str, Any]:
        key, parts = self.samples[k]
        out: dict[str, Any] = {"__key__": key, "__shard__": self.name}
        for ext, offset, size in parts:
            out[ext] = os.pread(self.fd, size, offset)
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self.fd)


# -- the local cache (training process) ------------------------------------------------------
class ShardCache:
    """Fetches shards from a store into a local folder ahead of use, and drops them after.

    `touch(shard, seq)` records that batch `seq` reads the shard; `release(seq)` says every
    batch up to `seq` is loaded, so a shard whose last reader is that old may go once more
    than `keep` shards are local. A failed fetch leaves `<file>.bad` with the reason, which
    the workers report."""

    def __init__(self, store: Any, index: ShardIndex, root: str, *, keep: int,
                 threads: int = 2, on_bad: Callable[[str, str], None] | None = None) -> None:
        self.store = store
        self.index = index
        self.root = root
        self.keep = max(1, keep)
        self.on_bad = on_bad
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hvd-resilient-shards")
        self._lock = threading.Lock()
        self._futures: dict[int, Future[None]] = {}
        self._last_use: OrderedDict[int, int] = OrderedDict()
        self._released = -1
        self.fetched_bytes = 0

    def path(self, shard: int) -> str:
        return os.path.join(self.root, self.index.shards[shard].key)

    def request(self, shards: Iterable[int]) -> None:
        with self._lock:
            for s in shards:
                if s not in self._futures:
                    self._futures[s] = self._pool.submit(self._fetch, s)

    def wait(self, shards: Iterable[int]) -> None:
        shards = list(shards)
        self.request(shards)
        for s in shards:
            with self._lock:
                fut = self._futures[s]
            fut.result()  # _fetch never raises: a failure leaves a .bad file

    def touch(self, shard: int, seq: int) -> None:
        with self._lock:
            self._last_use[shard] = seq
            self._last_use.move_to_end(shard)

    def release(self, seq: int) -> None:
        with self._lock:
            self._released = max(self._released, seq)
            local = [s for s, f in self._futures.items() if f.done()]
            extra = len(local) - self.keep
            for s in list(self._last_use):
                if extra <= 0:
                    break
                if self._last_use[s] <= self._released and s in self._futures \
                        and self._futures[s].done():
                    del self._futures[s], self._last_use[s]
                    for p in (self.path(s), self.path(s) + ".bad"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(p)
                    extra -= 1

    def _fetch(self, shard: int) -> None:
        info = self.index.shards[shard]
        path = self.path(shard)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.exists(path):
                return
            buf, digest = self.store.get_hashed(info.key, info.bytes)
            if info.sha256 and digest != info.sha256:
                raise BadShardError(info.key, "checksum mismatch (torn or replaced)")
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as fh:
                fh.write(buf)
            os.replace(tmp, path)
            self.fetched_bytes += info.bytes
        except Exception as e:  # every failure becomes a bad shard, reported by its samples
            reason = e.reason if isinstance(e, BadShardError) else f"{type(e).__name__}: {e}"
            reason = " ".join(reason.split())[:300]
            with open(path + ".bad", "w") as fh:
                fh.write(reason)
            logger.warning("shard %s unreadable: %s", info.key, reason)
            if self.on_bad is not None:
                self.on_bad(info.key, reason)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# -- the data set ---------------------------------------------------------------------------------
class ShardedDataset:
    """A map-style view of streamed shards: `ds[i]` is sample i (ids in index order).

    Args:
        source: an s3:// or file:// URL holding shards and `index.json`, a `ShardIndex`, or a
            list of local tar files (counted at start).
        decode: turns a raw sample (`{"__key__", "__shard__", ext: bytes, ...}`) into what the
            collate function takes; runs in the loader workers (the CPU-heavy part goes here).
        cache_dir: where S3 shards are fetched to (default: `data.cache_dir`, else a temporary
            folder removed at `close`).
        store_options: passed to the store (S3 endpoint, ...).

    Give it to the trainer (or `ElasticLoader`) like any data set: `make_sampler` gives the
    elastic shard sampler that splits whole shards across the ranks of each step.
    """

    def __init__(self, source: str | ShardIndex | Sequence[str], *,
                 decode: Callable[[dict[str, Any]], Any] | None = None, cache_dir: str = "",
                 store_options: Mapping[str, Any] | None = None, threads: int = 2) -> None:
        if isinstance(source, ShardIndex):
            self.index = source
        elif isinstance(source, str):
            self.index = read_index(source, store_options)
        else:
            self.index = index_files(list(source))
        self.decode = decode
        self.cache_dir = cache_dir
        self.store_options = dict(store_options or {})
        self.threads = threads
        self.sizes = [s.samples for s in self.index.shards]
        self.starts = [0] * len(self.sizes)
        for i in range(1, len(self.sizes)):
            self.starts[i] = self.starts[i - 1] + self.sizes[i - 1]
        self._len = sum(self.sizes)
        self._local: list[str] | None = None
        """Paths of the shards when the location is on this machine (read in place)."""
        if not self.index.url:
            self._local = [s.key for s in self.index.shards]
        elif self.index.url.startswith("file://") or "://" not in self.index.url:
            base = self.index.url.removeprefix("file://")
            self._local = [os.path.join(base, s.key) for s in self.index.shards]
        self._root = ""  # the cache folder, when the shards are fetched
        self._own_root = False
        self._cache: ShardCache | None = None
        self._keep = 4
        self._open: OrderedDict[int, _TarShard] = OrderedDict()  # per process (worker)
        self._emit: Callable[..., Any] | None = None
        self._reported: set[str] = set()

    def __len__(self) -> int:
        return self._len

    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    def make_sampler(self, *, shuffle: bool = True, seed: int = 0) -> Any:
        from hvd_resilient.state.sampler import ElasticShardSampler

        return ElasticShardSampler(self.sizes, shuffle=shuffle, seed=seed)

    def shard_of(self, index: int) -> int:
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} outside 0..{self._len - 1}")
        return bisect.bisect_right(self.starts, index) - 1

    def shard_name(self, index: int) -> str:
        key = self.index.shards[self.shard_of(index)].key
        return f"{self.index.url}/{key}" if self.index.url else key

    # -- training process ---------------------------------------------------------------------
    def configure(self, options: Any, emit: Callable[..., Any] | None = None) -> None:
        """Called by the loader before its workers start: where to cache, how far ahead."""
        self._emit = emit
        self._keep = 2 * (getattr(options, "readahead_shards", 2) + 2)
        if self._local is not None or self._root:
            return
        chosen = self.cache_dir or getattr(options, "cache_dir", "")
        if chosen:
            # one folder per process: two ranks on a host must not evict each other's shards
            self._root = os.path.join(chosen, f"pid{os.getpid()}")
            os.makedirs(self._root, exist_ok=True)
        else:
            self._root = tempfile.mkdtemp(prefix="hvd-resilient-shards-")
        self._own_root = True

    def _the_cache(self) -> ShardCache | None:
        if self._local is not None:
            return None
        if self._cache is None:
            if not self._root:
                self.configure(None)
            self._cache = ShardCache(_store(self.index.url, self.store_options), self.index,
                                     self._root, keep=self._keep, threads=self.threads,
                                     on_bad=self._report_bad_shard)
        return self._cache

    def _report_bad_shard(self, key: str, reason: str) -> None:
        if self._emit is not None and key not in self._reported:
            self._reported.add(key)
            self._emit(ev.BAD_SHARD, shard=f"{self.index.url}/{key}", error=reason)

    def request(self, shards: Iterable[int]) -> None:
        """Start fetching these shards (the coming ones); returns at once."""
        cache = self._the_cache()
        if cache is not None:
            cache.request(shards)
            return
        for s in shards:  # local: let the kernel read ahead
            with contextlib.suppress(OSError, AttributeError):
                fd = os.open(self._local[s], os.O_RDONLY)  # type: ignore[index]
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def prepare(self, ids: Sequence[int], seq: int) -> None:
        """Returns once the shards holding `ids` are local (or known to be bad)."""
        cache = self._the_cache()
        if cache is None:
            return
        shards = sorted({self.shard_of(i) for i in ids})
        for s in shards:
            cache.touch(s, seq)
        cache.wait(shards)

    def release(self, seq: int) -> None:
        """Every batch up to `seq` is loaded: shards only those read may be dropped."""
        if self._cache is not None:
            self._cache.release(seq)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache.store.close()
            self._cache = None
        for t in self._open.values():
            t.close()
        self._open.clear()
        if self._own_root and self._root:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = ""

    def __getstate__(self) -> dict[str, Any]:
        """A spawned worker gets the paths, not the cache's threads and connections."""
        state = dict(self.__dict__)
        state.update(_cache=None, _open=OrderedDict(), _emit=None, _own_root=False)
        return state

    # -- loader workers ------------------------------------------------------------------------
    def _shard(self, s: int) -> _TarShard:
        t = self._open.get(s)
        if t is not None:
            self._open.move_to_end(s)
            return t
        info = self.index.shards[s]
        name = f"{self.index.url}/{info.key}" if self.index.url else info.key
        path = self._local[s] if self._local is not None else os.path.join(self._root, info.key)
        if self._local is None and not os.path.exists(path):
            try:
                with open(path + ".bad") as fh:
                    raise BadShardError(name, fh.read().strip())
            except FileNotFoundError:
                raise BadShardError(name, "not fetched (evicted or never requested)") from None
        t = _TarShard(path, name, expect=info.samples)
        self._open[s] = t
        while len(self._open) > 4:
            self._open.popitem(last=False)[1].close()
        return t

    def raw(self, index: int) -> dict[str, Any]:
        """Sample `index` as stored (a webdataset dict of bytes)."""
        s = self.shard_of(index)
        return self._shard(s).sample(index - self.starts[s])

    def __getitem__(self, index: int) -> Any:
        sample = self.raw(index)
        return self.decode(sample) if self.decode is not None else sample
