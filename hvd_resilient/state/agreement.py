"""Every rank holds rank 0's state after a sync, and the sync proves it.

Horovod's `TorchState.sync()` broadcast the model, then called `broadcast_optimizer_state`,
which gives a newcomer's empty optimizer zero gradients and runs its `step()`: AdamW's
decoupled weight decay then moved the newcomer's parameters after they were made equal, and
nothing broadcast them again (every data-parallel step after that averaged the gradients of
two different models). Nothing checked. Here a sync is:

1. every rank digests each component (xxh3-128 over the bytes of every tensor and the repr of
   every other value, keys sorted) and the digests are allgathered: one small collective,
   which also carries what the caller has to exchange at the same moment (its ``rider``: the
   detectors' offers, rank 0's committed attributes), so a (re)start pays for one round trip,
   not three;
2. the components where some rank differs from rank 0 are sent from rank 0 as they are, all
   in one batch (the structure as one object, then every tensor's bytes in place: a newcomer's
   sync costs the same few collectives whatever the number of components): no optimizer
   step, no re-initialisation, nothing that could move a value after it arrived;
3. the digests are taken again. A component that still differs is sent once more and named in
   a ``sync_mismatch`` event; if it differs after that the job stops with one line, because a
   silent divergence costs more than a stop.

Components that already agree (the survivors of a kill, who all restored the same commit) are
not sent at all, so a verified sync is also cheaper than an unconditional broadcast.
Backend-neutral: the backend passes its :class:`Collectives`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xxhash

from hvd_resilient.checkpoint.serialize import map_leaves
from hvd_resilient.errors import HvdResilientError

PLAIN = (int, float, str, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)


class SyncDivergenceError(HvdResilientError):
    """Ranks still hold different state after it was sent from rank 0 twice. One line; fatal
    (no restart would make a component that cannot take rank 0's values take them)."""


class Collectives(Protocol):
    """What a sync needs from a backend; every call is a collective over all ranks."""

    def rank(self) -> int: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def broadcast_bytes_(self, buffers: Sequence[torch.Tensor], tag: str) -> None:
        """Overwrites each uint8 tensor with rank 0's, in place (``tag`` names the batch)."""


@dataclass(frozen=True)
class Component:
    """A part of the state that every rank must hold identically."""

    name: str
    get: Callable[[], Any]
    """The component's state as a tree (a state dict); its tensors may be the live ones."""
    put: Callable[[Any], None]
    """Applies rank 0's tree on another rank."""


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    cuda: bool


@dataclass
class Agreement:
    """What one sync found and did; the ``sync_check`` event carries it."""

    sent: list[str]
    """Components sent from rank 0 because some rank differed (a newcomer: all of them)."""
    ranks: list[int]
    """Ranks that differed from rank 0 before the sync."""
    repaired: list[str]
    """Components that still differed after being sent, and were sent again."""
    seconds: float
    digest_seconds: float


# -- digests ----------------------------------------------------------------------------------
def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on the CPU (bf16 and bool included)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).cpu() if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        full = getattr(obj, "full_tensor", None)  # a DTensor shard: digest the whole tensor
        t = full() if full is not None else obj
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(_bytes_of(t).numpy().data)
    elif isinstance(obj, dict):
        h.update(b"{")
        for k, v in sorted(obj.items(), key=lambda kv: repr(kv[0])):
            h.update(repr(k).encode())
            _feed(h, v)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"(" if isinstance(obj, tuple) else b"[")
        for v in obj:
            _feed(h, v)
        h.update(b")")
    elif isinstance(obj, PLAIN):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:  # an object's repr may hold its address, which differs on every rank
        text = repr(obj)
        h.update((type(obj).__name__ if " at 0x" in text else text).encode())


def digest_tree(tree: Any) -> str:
    """xxh3-128 of a state tree: equal on two ranks iff they hold the same values."""
    h = xxhash.xxh3_128()
    _feed(h, tree)
    return h.hexdigest()


# -- sending ----------------------------------------------------------------------------------
def broadcast_tree(tree: Any, coll: Collectives, tag: str) -> Any:
    """Rank 0's tree on every rank. Other ranks receive in place into their own tensors where
    those have the same path, shape and dtype (parameters stay the same objects), and into
    new tensors elsewhere (a newcomer's empty optimizer state)."""
    root = coll.rank() == 0

    def spec(v: Any, _path: tuple[Any, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            return _TensorSpec(tuple(v.shape), v.dtype, v.is_cuda)
        return v

    skeleton = coll.broadcast_object(map_leaves(tree, spec) if root else None)
    if root:
        out = tree
        tensors: list[torch.Tensor] = []
        map_leaves(tree, lambda v, _p: tensors.append(v) if isinstance(v, torch.Tensor)
                   else None)
    else:
        local: dict[tuple[Any, ...], torch.Tensor] = {}
        map_leaves(tree, lambda v, p: local.__setitem__(p, v) if isinstance(v, torch.Tensor)
                   else None)
        tensors = []

        def receive(v: Any, path: tuple[Any, ...]) -> Any:
            if not isinstance(v, _TensorSpec):
                return v
            mine = local.get(path)
            if (mine is None or tuple(mine.shape) != v.shape or mine.dtype != v.dtype
                    or not mine.is_contiguous() or mine.is_cuda != v.cuda):
                mine = torch.empty(v.shape, dtype=v.dtype,
                                   device="cuda" if v.cuda else "cpu")
            tensors.append(mine)
            return mine

        out = map_leaves(skeleton, receive)
    views = []
    for t in tensors:
        data = t.detach()
        if not data.is_contiguous():  # only on rank 0: send a contiguous copy
            data = data.contiguous()
        if data.numel():
            views.append(data.reshape(-1).view(torch.uint8))
    coll.broadcast_bytes_(views, tag)
    return out


# -- the protocol -----------------------------------------------------------------------------
def _differing(names: list[str], everyone: list[dict[str, str]]) -> tuple[list[str], list[int]]:
    ref = everyone[0]
    names = [n for n in names if any(d.get(n) != ref.get(n) for d in everyone)]
    ranks = [r for r, d in enumerate(everyone) if any(d.get(n) != ref.get(n) for n in names)]
    return names, ranks


def agree(components: Sequence[Component], coll: Collectives, *, rider: Any = None,
          on_riders: Callable[[list[Any]], None] | None = None) -> Agreement:
    """Makes every rank hold rank 0's components and proves it (module docstring). ``rider``
    travels in the first allgather; ``on_riders`` gets every rank's, by rank, before anything
    is sent (what it changes on a component is then sent and proven like the rest)."""
    t0 = time.perf_counter()
    by_name = {c.name: c for c in components}
    hashing = 0.0

    def mine(names: list[str]) -> dict[str, str]:
        nonlocal hashing
        t = time.perf_counter()
        out = {n: digest_tree(by_name[n].get()) for n in names}
        hashing += time.perf_counter() - t
        return out

    def digests(names: list[str]) -> list[dict[str, str]]:
        return coll.allgather_object(mine(names))

    def send(names: list[str]) -> None:
        tree = broadcast_tree({n: by_name[n].get() for n in names}, coll, tag="components")
        if coll.rank() != 0:
            for n in names:  # in the components' order: a model before its optimizer
                by_name[n].put(tree[n])

    first = coll.allgather_object((mine(list(by_name)), rider))
    if on_riders is not None:
        on_riders([r for _, r in first])
    sent, ranks = _differing(list(by_name), [d for d, _ in first])
    repaired: list[str] = []
    if sent:
        send(sent)
        repaired, bad = _differing(sent, digests(sent))
        if repaired:
            send(repaired)
            still, bad = _differing(repaired, digests(repaired))
            if still:
                raise SyncDivergenceError(
                    f"sync: {', '.join(still)} still differ from rank 0's on rank(s) "
                    f"{', '.join(map(str, bad))} after being sent twice; stopping rather than "
                    f"training diverged replicas (docs/recipes.md, 'What survives what')")
    return Agreement(sent, ranks, repaired, round(time.perf_counter() - t0, 6),
                     round(hashing, 6))
