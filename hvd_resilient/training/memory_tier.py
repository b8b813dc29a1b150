"""Every commit also in host memory outside the process, so that a restart of every worker
(torchrun, mpirun, a relaunched horovodrun driver) loses at most one commit interval instead
of everything since the last durable checkpoint.

Which copies exist: the state of a data-parallel job is the same on every rank, so one rank
per host (local rank 0) writes it to that host's memory tier at each commit; every host of a
job of two or more hosts holds a full copy, and losing a whole host loses nothing another
host does not hold. There is no replication traffic: a host's peer copy is the one its peers
made themselves. A host that has none (a replacement, a host whose memory was cleared)
fetches one from a peer at the restart (``checkpoint.memory.peers``).

The random streams of every rank are gathered at each commit (a few KB a rank), because a
bit-identical resume needs them all; it is the only collective this adds.

Where a restart looks: every rank under torchrun (the ranks agree on the newest step any host
holds, load it, and fall back together if any copy fails to verify); rank 0 alone under
Horovod (its own host, no collective: a worker that joins later runs the same start), whose
sync then spreads the state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.backends.base import Backend
from hvd_resilient.checkpoint.memory import SegmentDir, SegmentError, SegmentInfo, TierFull
from hvd_resilient.checkpoint.memory.listing import url_digest
from hvd_resilient.config import TrainConfig
from hvd_resilient.events import EventLog
from hvd_resilient.state import rng
from hvd_resilient.state.protocol import TrainingState

logger = logging.getLogger(__name__)

OWNER = "replicated"


@dataclass
class Found:
    """A commit loaded from the memory tier, not yet applied to the state."""

    info: SegmentInfo
    files: dict[str, Any]
    source: str
    """memory (every rank read its own host's copy) or peer (some rank fetched another
    host's)."""
    fetched: list[int] = field(default_factory=list)
    """Ranks that fetched a peer's copy."""


class MemoryCommits:
    """The memory tier of one training process; every rank builds one (a no-op where the
    tier is off), and the trainer hands it to :class:`DurableCheckpoints`.

    The public methods and the commit hook own the guards, the collectives' order, the bound
    on every wait for the background thread, the events and the log lines; the sharded form
    (`memory_tier_sharded.ShardedMemoryCommits`) fills in ``_commit_target``, ``_holdings``,
    ``_candidates``, ``_after_finish`` and ``_before_discard``.
    """

    sharded = False
    """Replicated state here; `memory_tier_sharded.ShardedMemoryCommits` keeps FSDP shards."""
    finish_wait_seconds = 30.0
    """The longest anything waits for the background thread to finish a segment (checksums,
    manifest; sharded, the copy to a peer): a commit inside the step, then kept in the process
    only, with a ``memory_commit_failed`` event, rather than stall training; the end of the
    run's discard and close, then going ahead with a warning."""

    def __init__(self, config: TrainConfig, state: TrainingState, events: EventLog,
                 backend: Backend) -> None:
        self.config, self.state, self.events, self.backend = config, state, events, backend
        opts = config.memory_tier
        self.enabled = opts.enabled
        """The same on every rank (config): decides the collectives at commits and resumes."""
        self.usable = False
        """This host can hold the tier (its folder is writable): decides only the writing. A
        host that cannot still joins every collective, or the others would wait for it."""
        self.writer = False
        """This process writes its host's copy: it holds the host's writer lock (one writer
        per host whatever the launcher calls local ranks; the next process takes over when
        it dies)."""
        self._lock_fd = -1
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._full = False
        self.server: Any = None
        self.dir = SegmentDir(opts.dir, self.run_key, OWNER, max_bytes=opts.max_bytes)
        if not self.enabled:
            return
        if config.fsdp and not self.sharded:
            self._off("sharded (fsdp) state needs ShardedMemoryCommits")
            return
        reason = _unusable(opts.dir)
        if reason:  # this host only: it keeps no copy, but takes part in every collective
            self.events.emit(ev.MEMORY_TIER, enabled=False, reason=reason)
            logger.warning("memory tier off on this host: %s (its restarts read a peer's copy "
                           "or the durable checkpoint)", reason)
        else:
            self.usable = True
            if not backend.joining and self._lead() and backend.resume_on_every_rank:
                self._serve()
        state.on_commit(self._on_commit)

    @property
    def run_key(self) -> str:
        """The run's folder: its id, a digest of its checkpoint location (two runs of one id
        over different stores are different histories) and the scope."""
        cfg = self.config
        where = url_digest(cfg.checkpoint.url)
        scope = cfg.memory_tier.scope
        return f"{cfg.run_id}.{where}" + (f".{scope}" if scope else "")

    def _lead(self) -> bool:
        """Takes the host's writer lock if nobody holds it; True when this process does."""
        if self.writer:
            return True
        if not self.usable:
            return False
        import fcntl

        if self._lock_fd < 0:
            run_path = os.path.dirname(self.dir.path)
            os.makedirs(run_path, exist_ok=True)
            self._lock_fd = os.open(os.path.join(run_path, ".writer.lock"),
                                    os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        self.writer = True
        self.dir.sweep()
        self._sweep_others()
        if not self.config.checkpoint.resume:  # --no-checkpoint-resume: a new history
            self.dir.clear()  # must not resume an old one
        return True

    def _off(self, reason: str) -> None:
        self.enabled = self.writer = False
        if self.backend.rank() == 0:
            self.events.emit(ev.MEMORY_TIER, enabled=False, reason=reason)
            logger.warning("memory tier off: %s (a restart of every worker resumes from the "
                           "durable checkpoint)", reason)

    # -- writing -------------------------------------------------------------------------------
    def _on_commit(self) -> None:
        """Every rank at each commit (a collective: the streams of every rank)."""
        streams = self.backend.allgather_object(rng.capture())
        target = self._commit_target(streams)
        if target is None:
            return
        folder, state = target
        step = self.state.step
        if step in folder.steps()[:1]:
            return  # the newest segment already (a commit again after a restore)
        self._write(folder, step, state)

    def _commit_target(
        self, streams: list[dict[str, Any]],
    ) -> tuple[SegmentDir, Mapping[str, Any]] | None:
        """Hook, every rank at each commit: the folder this process writes the commit to and
        the state it writes there (None: none). Here the host's writer writes the whole
        state, and the other processes nothing."""
        if not self._lead():
            return None
        return self.dir, self.state.checkpoint_state(streams)

    def _write(self, folder: SegmentDir, step: int, state: Mapping[str, Any]) -> None:
        """Inside the step: the copy; then checksums and manifest on the background thread."""
        if not self._idle.wait(self.finish_wait_seconds):  # the previous segment (rarely)
            reason = (f"the previous segment was still being finished after "
                      f"{self.finish_wait_seconds:g}s; this commit is kept in the process only")
            self.events.emit(ev.MEMORY_COMMIT_FAILED, ckpt_step=step, error=reason)
            logger.warning("memory tier: %s", reason)
            return
        meta = {"epoch": self.state.epoch, "world_size": self.backend.size()}
        if self.config.checkpoint.lease_epoch:  # which job of the run wrote it
            meta["lease_epoch"] = self.config.checkpoint.lease_epoch
        if self.backend.numbers_generations:  # and which of its worlds (in place); no
            meta["generation"] = self.backend.generation()  # refusal needed: a commit is
            # a collective of every rank, so a world cut off from the others commits nothing
        try:
            pending = folder.begin(step, state, meta)
        except TierFull as e:
            if not self._full:
                self._full = True
                self.events.emit(ev.MEMORY_TIER_FULL, reason=str(e))
                logger.warning("memory tier full: %s; this commit is kept in the process only",
                               e)
            return
        except OSError as e:
            self.events.emit(ev.MEMORY_COMMIT_FAILED, ckpt_step=step,
                             error=f"{type(e).__name__}: {e}")
            return
        self._full = False
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._finish_loop, name="memory-tier",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((folder, pending))

    def _finish_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            folder, pending = job
            t0 = time.perf_counter()
            try:
                info = folder.finish(pending)
                self.events.emit(ev.MEMORY_COMMIT, ckpt_step=info.step, bytes=info.total_bytes,
                                 stall_seconds=round(pending.stall_seconds, 4),
                                 seconds=round(time.perf_counter() - t0, 4))
                self._after_finish(info)
            except Exception as e:
                self.events.emit(ev.MEMORY_COMMIT_FAILED, ckpt_step=pending.step,
                                 error=f"{type(e).__name__}: {e}")
            finally:
                self._idle.set()

    def _after_finish(self, info: SegmentInfo) -> None:
        """Off the step, once a segment is complete (the sharded tier copies it to a peer)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds (None: :attr:`finish_wait_seconds`) for the segment
        in progress (tests, and before the run's segments go); False if it is still running."""
        return self._idle.wait(self.finish_wait_seconds if timeout is None else timeout)

    # -- reading -------------------------------------------------------------------------------
    def newest(self, durable_step: int) -> Found | None:
        """The newest commit at or past ``durable_step`` that verifies, or None (then the
        durable checkpoint it is). A collective where every rank resumes (torchrun): the hosts
        say what they hold, every rank loads the newest candidate from its own host or a peer,
        and all fall back together to the next one (two at most) if any rank could not."""
        if not self.enabled:
            return None
        if not self.backend.resume_on_every_rank:  # Horovod: rank 0 alone, its own host
            return self._newest_here(durable_step) if self.usable else None
        mine = self._holdings(durable_step)
        everyone = self.backend.allgather_object(mine)
        floor = max(p["durable"] for p in everyone)
        for load in self._candidates(mine, everyone, floor)[:2]:
            found = load()
            if self._all_loaded(found):
                return found
        return None

    def _newest_here(self, durable_step: int) -> Found | None:
        """The newest verified commit of this host's own copies, no collective."""
        for step in self.dir.steps():
            if step < durable_step:
                break
            found = self._read_local(step)
            if found is not None:
                return found
        return None

    def _read_local(self, step: int) -> Found | None:
        try:
            info, files = self.dir.read(step)
            return Found(info, files, "memory")
        except SegmentError as e:
            self._skipped(step, str(e))
            return None

    def _skipped(self, step: int, reason: str) -> None:
        self.events.emit(ev.CHECKPOINT_SKIPPED, tier="memory", ckpt_step=step, reason=reason)
        logger.warning("memory copy of step %d skipped: %s", step, reason)

    def _holdings(self, durable_step: int) -> dict[str, Any]:
        """Hook: what this process tells the others at a restart (``durable``: the newest
        durable step it saw; the rest is the hook's own, read back by :meth:`_candidates`)."""
        return {"host": socket.gethostname(), "steps": self.dir.steps(),
                "server": self.server.address if self.server else None,
                "durable": durable_step}

    def _candidates(self, mine: dict[str, Any], everyone: list[dict[str, Any]],
                    floor: int) -> list[Callable[[], Found | None]]:
        """Hook: from every process's :meth:`_holdings`, the commits to try, newest first,
        each as a call that loads it on this rank (None: this rank could not). Here: every
        step some host holds, no older than ``floor``."""
        steps = sorted({s for p in everyone for s in p["steps"] if s >= floor}, reverse=True)
        return [functools.partial(self._load_step, step, mine, everyone) for step in steps]

    def _load_step(self, step: int, mine: dict[str, Any],
                   everyone: list[dict[str, Any]]) -> Found | None:
        """``step`` from this host's copy, else from the first peer whose copy verifies."""
        from hvd_resilient.checkpoint.memory.peers import fetch

        if step in mine["steps"]:
            found = self._read_local(step)
            if found is not None:
                return found
        for peer in everyone:
            if peer["server"] is None or step not in peer["steps"]:
                continue
            try:
                info, files = fetch(tuple(peer["server"]), self.run_key, OWNER, step)
                return Found(info, files, "peer")
            except SegmentError as e:
                self._skipped(step, f"from {peer['host']}: {e}")
        return None

    def _all_loaded(self, found: Found | None) -> bool:
        """Collective: True on every rank when every rank loaded the candidate (then
        ``found`` says whether any rank had to fetch a peer's copy); False on every rank
        otherwise, and all go on to the next candidate together."""
        sources = self.backend.allgather_object(found.source if found else None)
        if found is None or None in sources:
            return False
        found.fetched = [r for r, src in enumerate(sources) if src == "peer"]
        found.source = "peer" if found.fetched else "memory"
        return True

    # -- lifetime ------------------------------------------------------------------------------
    def _serve(self) -> None:
        from hvd_resilient.checkpoint.memory.peers import SegmentServer
        from hvd_resilient.detect.silent_peers import outward_ip

        try:  # peers reach this host from where it reaches the rendezvous
            self.server = SegmentServer(self.config.memory_tier.dir,
                                        outward_ip(self.backend.coordinator))
        except OSError as e:
            logger.warning("memory tier not served to peers: %s", e)

    def _sweep_others(self) -> None:
        """Segments of other histories of this run (another scope), and of any run untouched
        for longer than memory_max_age_hours: nobody will resume from them."""
        root, keep = self.config.memory_tier.dir, self.run_key
        scoped = bool(self.config.memory_tier.scope)  # a fresh start: older histories go
        base = keep.rsplit(".", 1)[0] if scoped else ""
        max_age = self.config.memory_tier.max_age_hours * 3600
        try:
            names = os.listdir(root)
        except OSError:
            return
        for name in names:
            if name == keep:
                continue
            path = os.path.join(root, name)
            older_history = name == base or scoped and name.startswith(base + ".")
            if older_history or _idle_seconds(path) > max_age:
                shutil.rmtree(path, ignore_errors=True)

    def discard(self) -> None:
        """The run ended (finished, or stopped with its final durable checkpoint): its
        segments on this host go. Every rank calls it (a collective where the hook is)."""
        if not self.enabled:
            return
        if not self.flush():
            logger.warning("memory tier: a segment was still being finished after %gs; the "
                           "run's segments go anyway (one finished later is swept after "
                           "memory_tier_max_age_hours)", self.finish_wait_seconds)
        self._before_discard()
        if self.writer:
            shutil.rmtree(os.path.join(self.config.memory_tier.dir, self.run_key),
                          ignore_errors=True)

    def _before_discard(self) -> None:
        """Hook, every rank, once its own segments are finished: nothing here (one writer a
        host)."""

    def close(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # full: the thread takes its job first
                self._jobs.put(None, timeout=self.finish_wait_seconds)
            self._thread.join(self.finish_wait_seconds)
            if self._thread.is_alive():
                logger.warning("memory tier: a segment was still being finished after %gs at "
                               "close; left to its thread", self.finish_wait_seconds)
            self._thread = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = -1
            self.writer = False


def _unusable(root: str) -> str:
    """Why the tier cannot live at ``root`` ('' when it can)."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError as e:
        return f"{root} cannot be created ({e.strerror})"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable"
    return ""


def _idle_seconds(path: str) -> float:
    newest = 0.0
    for dirpath, _, names in os.walk(path):
        for n in [*names, "."]:
            try:
                newest = max(newest, os.path.getmtime(os.path.join(dirpath, n)))
            except OSError:
                pass
    return time.time() - newest
