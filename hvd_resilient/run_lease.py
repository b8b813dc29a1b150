"""One job per run: the lease a supervised launch holds on its run folder, with a fencing epoch.

Two jobs on one run race on its checkpoints and memory-tier commits, and only write-once
publishing keeps them from overwriting each other. A launch therefore takes the run's lease
(`lease.json` in the run folder, a shared filesystem across hosts) before it starts anything:

- a lease whose holder renewed it within `TTL_S` belongs to a live job. A relaunch waits for it
  (bounded) or, told to, takes the run over;
- a lease not renewed for `TTL_S`, one released, or one whose holder process is seen gone (same
  kernel and namespaces; its pid and start time no longer match), is free: a dead job costs
  seconds, not minutes;
- every take raises the epoch by one. The new epoch is written to the checkpoint store as its
  fence (`checkpoint/fence.py`) and given to the workers; a checkpoint published under an older
  epoch is refused, so a job that was taken over can no longer change what the run keeps.

Each read-modify-write of the lease is serialised by an flock on `lease.lock` beside it; the
record itself is replaced atomically (`os.replace`), so a reader never sees half of it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from hvd_resilient.detect.heartbeat import ENDED, process_stat, this_view

logger = logging.getLogger(__name__)

LEASE_FILE = "lease.json"
TTL_S = 5.0
"""A lease not renewed for this long is free: the holder's supervisor renews every `RENEW_S`."""
RENEW_S = 1.0


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' when it is gone or ended): with
    the pid it names one process, whatever pid reuse does."""
    fields = process_stat(pid)  # the state letter first: proc(5) field 3; starttime is 22
    return fields[19] if len(fields) > 19 and fields[0] not in ENDED else ""


def this_process() -> str:
    """`view|pid|start`, the holder name of the calling process: the view (kernel, pid, network
    and host-name namespaces: `detect.heartbeat.this_view`) says whether another process can
    look it up in its own /proc, which a host name cannot (containers and namespace hosts share
    one kernel, and a name can repeat)."""
    pid = os.getpid()
    return f"{this_view()}|{pid}|{_start_time(pid)}"


@dataclass
class LeaseRecord:
    epoch: int
    holder: str
    """`view|pid|start` of the process that holds it (`this_process`)."""
    token: str
    """The job token of the holder (`launch/job_guard.JOB_ENV`): what marks its processes."""
    renewed: float
    released: bool = False
    host: str = ""
    """The holder's host name, for messages only."""

    def live(self, now: float) -> bool:
        """Whether a live job holds it: renewed within `TTL_S`, not released, and its holder
        not seen gone (`holder_gone`; a holder this process cannot look up counts as live)."""
        return not self.released and now - self.renewed <= TTL_S and not self.holder_gone()

    def holder_gone(self) -> bool:
        """Whether the holder shares this process's view and its pid and start time no longer
        name a running process (gone, a zombie, or the pid reused)."""
        view, _, rest = self.holder.partition("|")
        pid, _, start = rest.partition("|")
        return (bool(view) and view == this_view() and pid.isdigit()
                and _start_time(int(pid)) != start)

    def describe(self, now: float) -> str:
        pid = self.holder.split("|")[1] if self.holder.count("|") == 2 else "?"
        return (f"epoch {self.epoch}, pid {pid} on {self.host or 'an unknown host'}, "
                f"renewed {max(0.0, now - self.renewed):.1f} s ago")


def read_record(path: str | os.PathLike[str]) -> LeaseRecord | None:
    """The record at `path` as it is now (None: never taken, or unreadable)."""
    try:
        return LeaseRecord(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class LeaseHeldError(Exception):
    """A live job holds the run."""


class LeaseLostError(Exception):
    """The run was taken over by a newer epoch."""


class RunLease:
    """The lease of one run folder, as one supervisor sees it."""

    def __init__(self, run_dir: str | os.PathLike[str], token: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.folder = Path(run_dir)
        self.path = self.folder / LEASE_FILE
        self.token = token
        self.holder = this_process()
        self.epoch = 0
        self._clock = clock

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / "lease.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read(self) -> LeaseRecord | None:
        """The record as it is now (None: never taken, or unreadable: treated as free)."""
        return read_record(self.path)

    def _record(self, now: float) -> LeaseRecord:
        """This process holding the lease at this epoch, renewed `now`."""
        return LeaseRecord(self.epoch, self.holder, self.token, now, host=socket.gethostname())

    def _write(self, record: LeaseRecord) -> None:
        tmp = self.path.with_name(f".{LEASE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self.path)

    def acquire(self, *, wait_s: float, take_over: bool,
                on_wait: Callable[[LeaseRecord], None] | None = None) -> LeaseRecord | None:
        """Takes the run with the next epoch, and returns the record it replaced (None: there
        was none). A live holder is waited for up to `wait_s` (`on_wait` is told once), or
        displaced at once with `take_over`.

        Raises:
            LeaseHeldError: a live job still holds it after `wait_s`.
        """
        return self._take(wait_s, on_wait, take_over=take_over, join=False)

    def join_or_take(self, *, wait_s: float, take_over: bool = False,
                     on_wait: Callable[[LeaseRecord], None] | None = None) -> LeaseRecord | None:
        """For a job that several processes start, each with the token naming the job: the
        ranks of a plain horovodrun, mpirun or torchrun launch (`launcher_env.launcher_job_id`),
        the supervisors of a multi-node torchrun job (one per node). The first to come takes
        the run with the next epoch; the others, and those that come later while it is live,
        find their job's token there and share its epoch, and all renew it. A record of their
        token that is no longer live (the job died) is taken with the next epoch, like any
        other. A plain launch never releases it: once every rank is gone it lapses (at once on
        this machine, where the last renewer's pid is seen gone; in `TTL_S` elsewhere).
        Returns the record taken over (None: none, or joined).

        Raises:
            LeaseHeldError: another live job holds the run after `wait_s`.
        """
        return self._take(wait_s, on_wait, take_over=take_over, join=True)

    def _take(self, wait_s: float, on_wait: Callable[[LeaseRecord], None] | None, *,
              take_over: bool, join: bool) -> LeaseRecord | None:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            with self._locked():
                old = self.read()
                now = self._clock()
                if join and old is not None and old.token == self.token and old.live(now):
                    self.epoch = old.epoch
                    self._write(self._record(now))
                    return None
                if old is None or take_over or not old.live(now):
                    self.epoch = (old.epoch if old else 0) + 1
                    self._write(self._record(now))
                    return old
            if time.monotonic() >= deadline:
                raise LeaseHeldError(f"run {self.folder} is held by a live job "
                                     f"({old.describe(now)})")
            if on_wait is not None and not told:
                on_wait(old)
                told = True
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def renew(self) -> None:
        """Marks the lease live again.

        Raises:
            LeaseLostError: a newer epoch holds the run (this job was taken over).
        """
        with self._locked():
            now = self._clock()
            rec = self.read()
            if rec is not None and rec.epoch > self.epoch:
                raise LeaseLostError(f"run {self.folder} was taken over: {rec.describe(now)}")
            self._write(self._record(now))

    def release(self) -> None:
        """Frees the lease at once for the next launch (only while this epoch holds it)."""
        with self._locked():
            rec = self.read()
            if rec is not None and rec.epoch == self.epoch:
                rec.released = True
                self._write(rec)


class Renewal:
    """Renews a lease every `RENEW_S` from a daemon thread, from the moment it was taken, until
    `stop()` or until a newer epoch holds it; then calls `on_lost` with why (set it when the
    holder knows what to do: the supervisor ends its job, a rank stops itself)."""

    def __init__(self, lease: RunLease) -> None:
        self.lease = lease
        self.on_lost: Callable[[str], None] | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="hvdr-lease", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        while not self._done.wait(RENEW_S):
            try:
                self.lease.renew()
            except LeaseLostError as e:
                if self.on_lost is not None:
                    self.on_lost(str(e))
                return
            except OSError as e:  # the run folder's filesystem hiccuped: the next try may do
                logger.warning("renewing the run's lease failed: %s", e)

    def stop(self) -> None:
        """No renewal after this returns (a release that follows stays released)."""
        self._done.set()
        self._thread.join()


def watch_lease(run_dir: str | os.PathLike[str], epoch: int,
                on_lost: Callable[[LeaseRecord], None], every_s: float = RENEW_S) -> None:
    """A worker's side of the fence: a daemon thread that reads the run's lease every
    `every_s` and calls `on_lost` (once) when a newer epoch holds it. The store's fence refuses
    a displaced job's checkpoints; this stops the job itself within a second of the takeover,
    whatever it was doing (training, memory-tier commits, waiting in a collective), even when
    its own supervisor is frozen or gone. A missing or unreadable record is not a loss."""
    path = Path(run_dir) / LEASE_FILE

    def watch() -> None:
        while True:
            time.sleep(every_s)
            rec = read_record(path)
            if rec is not None and rec.epoch > epoch:
                on_lost(rec)
                return

    threading.Thread(target=watch, name="hvdr-lease-watch", daemon=True).start()
