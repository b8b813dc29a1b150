"""Host memory for checkpoint snapshots and restores, reused instead of faulted in again.

The snapshot is the only part of a checkpoint that runs inside the training step, and most of
its cost is not the copy but the first touch of fresh memory: faulting in 1 GB of new pages
costs ~0.4 s on a small machine, copying into pages already touched ~0.13 s. A training state
has the same layout at every checkpoint, so the buffers of a checkpoint whose upload finished
are exactly the ones the next snapshot needs.

A buffer is free once nothing but this pool refers to it: the writer's views, a tensor made
with ``torch.frombuffer`` and ``memoryview`` all hold a reference to it, so a buffer still
being hashed or uploaded is never handed out again. The cost is memory: between checkpoints
the pool keeps one set of buffers (the size of one snapshot) that a fresh allocation would
have returned; ``HVD_RESILIENT_CHECKPOINT_SNAPSHOT_REUSE=0`` turns reuse off where that memory
is tighter than the stall (the `checkpoint.snapshot_reuse` setting).
"""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

#: From this size on, buffers are anonymous mappings rather than bytearrays.
MAP_FROM = 1 << 20

HostBuffer = bytearray | mmap.mmap

# References to a pooled buffer that is otherwise unused: the pool's list, the loop variable
# and getrefcount's own argument.
_FREE_REFS = 3


def allocate(nbytes: int, populate: bool = False) -> HostBuffer:
    """Writable host memory of ``nbytes`` that nothing has written yet.

    ``bytearray(n)`` writes n zeros before the caller writes its own bytes: filling a fresh
    1 GB bytearray costs ~0.75 s here, a fresh private anonymous mapping (whose zero pages
    the kernel supplies on first touch) ~0.45 s. ``populate``: the kernel supplies them all
    at once instead (:func:`populate_pages`), for a buffer about to be filled whole (a
    restore's read): one call instead of a fault per page.
    """
    if nbytes < MAP_FROM:
        return bytearray(nbytes)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if populate:
        populate_pages(buf)
    return buf


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (include/uapi/asm-generic/mman-common.h)
_madvise: Any = None


def populate_pages(buf: mmap.mmap) -> None:
    """Has the kernel supply every page of ``buf`` now, in one call, with the GIL released.

    ``mmap.mmap(..., MAP_POPULATE)`` does the same inside the constructor while HOLDING the
    GIL: measured 1.0 s for a fresh 1 GB file here (3 s and more under load), during which no
    other thread of the process runs: the heartbeat thread starved and its process, a healthy
    one, judged itself frozen and exited. ``madvise(MADV_POPULATE_WRITE)`` through ctypes
    (which releases the GIL around foreign calls) costs the same time with every thread
    running. Where the kernel lacks it, nothing is populated: the pages fault in on the copy,
    which runs in torch without the GIL too."""
    global _madvise
    if not sys.platform.startswith("linux") or len(buf) == 0:
        return
    import ctypes

    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    anchor = ctypes.c_char.from_buffer(buf)  # an export of buf: only to learn its address
    address = ctypes.addressof(anchor)
    del anchor  # released at once, or buf could not be closed
    _madvise(address, len(buf), _MADV_POPULATE_WRITE)  # EINVAL on old kernels: no matter


class HostBufferPool:
    """The one pool of host buffers: a snapshot's (:meth:`take`, reused when its layout
    recurs) and a restore's downloads (:meth:`borrow`, reused for the next file once the
    caller let go of the last). A buffer is handed out again only when nothing but the pool
    refers to it, so nothing is ever given back by hand and nothing in use is reused."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._all: list[HostBuffer] = []
        self._lock = threading.Lock()
        self.reused_bytes = 0
        """Bytes handed out again instead of allocated (for tests and benchmarks)."""

    def take(self, sizes: list[int]) -> list[HostBuffer]:
        """One buffer of each size in ``sizes``; free pooled buffers of an equal size are
        handed out again, the rest allocated. Free buffers this snapshot did not use are
        dropped, so the pool never holds more than the snapshots still in flight plus one."""
        if not self.enabled:
            return [allocate(n) for n in sizes]
        with self._lock:
            free: dict[int, list[HostBuffer]] = {}
            for b in self._all:
                if sys.getrefcount(b) <= _FREE_REFS:
                    free.setdefault(len(b), []).append(b)
            out: list[HostBuffer] = []
            for n in sizes:
                if free.get(n):
                    out.append(free[n].pop())
                    self.reused_bytes += n
                else:
                    out.append(allocate(n))
            unused = {id(b) for bs in free.values() for b in bs}
            kept = [b for b in self._all if id(b) not in unused]
            known = {id(b) for b in kept}
            self._all = kept + [b for b in out if id(b) not in known]
            del free, kept
            return out

    def borrow(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes, on the smallest free pooled buffer that
        fits (a fresh 100 MB buffer costs ~60 ms of page faults here, as much as downloading
        it); free again once the caller drops every view of it."""
        if not self.enabled:
            return memoryview(allocate(size))[:size]
        with self._lock:
            best: HostBuffer | None = None
            for b in self._all:
                if len(b) >= size and sys.getrefcount(b) <= _FREE_REFS and (
                        best is None or len(b) < len(best)):
                    best = b
            if best is None:
                best = allocate(size)
                self._all.append(best)
            else:
                self.reused_bytes += size
            return memoryview(best)[:size]


# Refcounts tell when a buffer is free only on CPython. The trainer turns reuse off when the
# config says so (`checkpoint.snapshot_reuse`).
_POOL = HostBufferPool(enabled=sys.implementation.name == "cpython")


def pool() -> HostBufferPool:
    """The process-wide pool snapshots use by default."""
    return _POOL
