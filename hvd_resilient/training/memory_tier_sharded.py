"""The memory tier for sharded (FSDP) state: every rank keeps its own shards of each commit in
its host's memory and copies them to the next host's memory, so a restart of every worker
resumes from the last commit, at any world size, while the copies cover the whole state.

Why each rank writes its own segment (owner ``shard-<rank>-of-<world>``): no rank holds the
whole state, and gathering it is what FSDP is used to avoid. Each segment holds the rank's
local tensors (a DTensor's ``to_local()``), where each sits in the global tensor (DCP's own
chunk description, ``__create_chunk_list__``), and the small replicated run state.

The copy to a peer goes through the peer host's segment server (HTTP PUT, manifest last) on
the background thread, after the local segment is complete: hosts form a ring in the order of
their ids, each sends to the next, so no host holds both copies of a shard and a lost host's
shards are on its successor.

A restart (every rank, a collective): the ranks exchange what their hosts hold, pick the
newest step whose shards of one world size are all somewhere (and no older than the newest
durable checkpoint), and each rank reads every shard of it (its host's, else a peer's),
assembles the full tensors on the CPU and hands them to ``set_state_dict`` with
``full_state_dict``, which shards them onto this world size. Assembling costs the whole state
in host memory on each rank for the moment of the restart; the durable path's DCP reads only
what each rank needs, and remains the fallback.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Mapping
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.checkpoint.memory import SegmentDir, SegmentError, SegmentInfo
from hvd_resilient.checkpoint.memory.listing import subdirs
from hvd_resilient.checkpoint.split import join_state
from hvd_resilient.checkpoint.tree import map_leaves
from hvd_resilient.training.memory_tier import Found, MemoryCommits

logger = logging.getLogger(__name__)

_OWNER = re.compile(r"^shard-(\d{5})-of-(\d{5})$")


def owner(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}"


def local_payload(sharded: dict[str, Any], run_state: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of a sharded state: local tensors plus where each sits globally."""
    from torch.distributed.tensor import DTensor

    layout: list[tuple[list[Any], list[int], list[int], list[int]]] = []

    def leaf(obj: Any, path: tuple[Any, ...]) -> Any:
        if not isinstance(obj, DTensor):
            return obj
        # torch leaves DTensor.__create_chunk_list__ unannotated: list[ChunkStorageMetadata]
        chunks = obj.__create_chunk_list__()  # type: ignore[no-untyped-call]
        if len(chunks) > 1:
            raise ValueError(f"{'/'.join(map(str, path))}: {len(chunks)} local chunks")
        offsets = list(chunks[0].offsets) if chunks else [0] * obj.dim()
        sizes = list(chunks[0].sizes) if chunks else [0] * obj.dim()
        layout.append((list(path), list(obj.shape), offsets, sizes))
        return obj.to_local()

    return {"state": map_leaves(sharded, leaf), "layout": layout, "run": run_state}


def assemble(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """The full state from every rank's :func:`local_payload` (any order)."""
    import torch

    where: dict[tuple[Any, ...], list[tuple[list[int], list[int], Any]]] = {}
    shapes: dict[tuple[Any, ...], list[int]] = {}
    for p in payloads:
        for path, shape, offsets, sizes in p["layout"]:
            local = _at(p["state"], path)
            where.setdefault(tuple(path), []).append((offsets, sizes, local))
            shapes[tuple(path)] = shape

    def leaf(obj: Any, path: tuple[Any, ...]) -> Any:
        parts = where.get(path)
        if parts is None:
            return obj  # replicated (a step counter, param groups): the same on every rank
        full = torch.zeros(shapes[path], dtype=parts[0][2].dtype)
        covered = 0
        for offsets, sizes, local in parts:
            if 0 in sizes:
                continue
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            full[index] = local.reshape(sizes)
            covered += local.numel()
        if covered != full.numel():
            raise SegmentError(f"shards of {'/'.join(map(str, path))} cover {covered} of "
                               f"{full.numel()} elements")
        return full

    state: dict[str, Any] = map_leaves(payloads[0]["state"], leaf)  # a dict, as each was
    return state


def _at(tree: Any, path: list[Any]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


class ShardedMemoryCommits(MemoryCommits):
    """The memory tier of an FSDP training process (torchrun only, like FSDP itself)."""

    sharded = True
    finish_wait_seconds = 60.0  # a segment's finish includes its copy to the next host

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ring: tuple[str, int] | None | bool = False  # False: not asked yet
        self._commits_at_size = 0
        super().__init__(*args, **kwargs)
        if self.enabled:
            self.own = self._own_folder()
            self.own.sweep()
            if not self.config.checkpoint.resume:
                self.own.clear()
            self.state.after_reset(self._regroup)  # in place only: a new generation

    def _regroup(self) -> None:
        """A new generation (the in-place backend): this rank's next commits go to the folder
        of its new rank and world size; the ring is asked again at the next commit. No
        collective: the old size's segments stay until this size has a commit of its own,
        since the reload that follows may need them."""
        self._ring, self._commits_at_size = False, 0
        self.own = self._own_folder()

    def _own_folder(self) -> SegmentDir:
        """This rank's segments at its current rank and world size."""
        return SegmentDir(self.config.memory_tier.dir, self.run_key,
                          owner(self.backend.rank(), self.backend.size()),
                          max_bytes=self.config.memory_tier.max_bytes)

    @property
    def run_path(self) -> str:
        return os.path.join(self.config.memory_tier.dir, self.run_key)

    def host_id(self) -> str:
        """Who shares this memory: the machine, and the tier's folder on it (two agents on one
        machine with folders of their own are two hosts to the tier, as in the tests)."""
        try:
            ino = os.stat(self.config.memory_tier.dir).st_ino
        except OSError:
            ino = 0
        return f"{socket.gethostname()}:{ino}"

    # -- writing -------------------------------------------------------------------------------
    def _commit_target(
        self, streams: list[dict[str, Any]],
    ) -> tuple[SegmentDir, Mapping[str, Any]] | None:
        """Every rank its own shards, into its own folder (collectives: the ring at the first
        commit, and FSDP's state dict, on every rank whether it writes or not)."""
        from hvd_resilient.backends.torchdist import fsdp

        if self._ring is False:
            self._ring = self._next_host()
        self._lead()
        self._commits_at_size += 1
        if self.writer and self._commits_at_size == 2:
            self._forget_other_sizes()
        payload = local_payload(fsdp.sharded_state(self.state.model, self.state.optimizer),
                                self.state.run_state(streams))  # on every rank, like FSDP
        return (self.own, payload) if self.usable else None

    def _after_finish(self, info: SegmentInfo) -> None:
        if not isinstance(self._ring, tuple):
            return
        from hvd_resilient.checkpoint.memory.peers import push

        try:
            push(self._ring, self.run_key, self.own.owner, info.step, self.own.path)
        except SegmentError as e:
            self.events.emit(ev.MEMORY_PUSH_FAILED, ckpt_step=info.step, error=str(e))

    def _next_host(self) -> tuple[str, int] | None:
        """The next host's segment server in the ring of hosts (None: one host only). A
        collective, at the first commit."""
        mine = (self.host_id(), self.server.address if self.server else None)
        everyone = self.backend.allgather_object(mine)
        servers = {h: s for h, s in everyone if s is not None}
        hosts = sorted({h for h, _ in everyone})
        if len(hosts) < 2:
            return None
        nxt = hosts[(hosts.index(mine[0]) + 1) % len(hosts)]
        return tuple(servers[nxt]) if nxt in servers else None

    def _forget_other_sizes(self) -> None:
        """Shards of another world size are dead weight once this size has a commit done."""
        size = self.backend.size()
        for name in subdirs(self.run_path):
            m = _OWNER.match(name)
            if m and int(m.group(2)) != size:
                shutil.rmtree(os.path.join(self.run_path, name), ignore_errors=True)

    def _before_discard(self) -> None:
        """Every rank's copies (and pushes) are done before the run's folder goes, or a late
        one would bring it back: a collective, once each rank finished its own."""
        self.backend.allgather_object(None)

    # -- reading -------------------------------------------------------------------------------
    def _holdings(self, durable_step: int) -> dict[str, Any]:
        held: dict[str, list[int]] = {}
        for name in subdirs(self.run_path):
            if _OWNER.match(name):
                held[name] = SegmentDir(self.config.memory_tier.dir, self.run_key,
                                        name).steps()
        return {"host": self.host_id(), "server": self.server.address if self.server else None,
                "held": held, "durable": durable_step}

    def _candidates(self, mine: dict[str, Any], everyone: list[dict[str, Any]],
                    floor: int) -> list[Callable[[], Found | None]]:
        """The steps whose shards of one world size are all held somewhere, newest first."""
        servers = {p["host"]: p["server"] for p in everyone if p["server"] is not None}
        hosts_of: dict[tuple[int, int, int], set[str]] = {}
        for p in everyone:
            for name, steps in p["held"].items():
                m = _OWNER.match(name)
                if m is None:
                    continue
                for s in steps:
                    hosts_of.setdefault((s, int(m.group(2)), int(m.group(1))), set()).add(
                        p["host"])
        complete = sorted({(s, w) for s, w, _ in hosts_of
                           if s >= floor and all((s, w, r) in hosts_of for r in range(w))},
                          reverse=True)
        return [functools.partial(self._load, step, world, hosts_of, servers, mine["host"])
                for step, world in complete]

    def _load(self, step: int, world: int, hosts_of: dict[tuple[int, int, int], set[str]],
              servers: dict[str, Any], here: str) -> Found | None:
        from hvd_resilient.checkpoint.memory.peers import fetch

        payloads, source, first = [], "memory", None
        for r in range(world):
            name, files = owner(r, world), None
            if here in hosts_of[(step, world, r)]:
                try:
                    info, files = SegmentDir(self.config.memory_tier.dir, self.run_key,
                                             name).read(step)
                except SegmentError as e:
                    self._skipped(step, f"{name}: {e}")
            for host in sorted(hosts_of[(step, world, r)] - {here}):
                if files is not None or host not in servers:
                    continue
                try:
                    info, files = fetch(tuple(servers[host]), self.run_key, name, step)
                    source = "peer"
                except SegmentError as e:
                    self._skipped(step, f"{name} from {host}: {e}")
            if files is None:
                return None
            first = first or info
            payloads.append(join_state(files))
        try:
            full = assemble(payloads)
        except (SegmentError, KeyError, IndexError, RuntimeError) as e:
            self._skipped(step, f"shards do not fit together: {e}")
            return None
        full["run"] = payloads[0]["run"]
        assert first is not None
        return Found(first, full, source)
