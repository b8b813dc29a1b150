"""The driver ends the workers its workers found silent, as fast as they found them.

Horovod re-forms the world only once every worker has failed or reached the rendezvous; a
frozen worker (SIGSTOP, a paused VM) or one on a cut-off host does neither, so without this the
survivors would wait at the rendezvous for a process that never comes, and the driver would
learn of a lost host only when its ssh session times out. Workers PUT the slot of a peer they
found silent into the rendezvous store (`silent_peers.LOST_SCOPE`); a thread of the driver
reads it every `POLL_S` and ends that slot's launch process (the local shell, or the ssh client
of a remote slot). Horovod then sees the slot exit non-zero and handles it as any failure: the
slot goes through its cooldown and the reset proceeds with the others. A remote worker is also
killed over ssh (best effort: a cut-off host cannot be reached, and stops itself).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod import compat, slots
from hvd_resilient.backends.horovod.lost_slots import LOST_SCOPE
from hvd_resilient.launch.horovod.patches.context import PatchContext, PerObject

logger = logging.getLogger(__name__)

POLL_S = 0.1
REMOTE_KILL_TIMEOUT_S = 10.0


def slot_processes(hostname: str, local_rank: str) -> list[psutil.Process]:
    """This driver's descendants that launched the slot: Horovod starts each worker as
    `env HOROVOD_HOSTNAME=<host> ... HOROVOD_LOCAL_RANK=<n> ... python ...` (through a local
    shell, or inside an ssh client's command line)."""
    want = (f"HOROVOD_HOSTNAME={hostname} ", f"HOROVOD_LOCAL_RANK={local_rank} ")
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline()) + " "
        except psutil.Error:
            continue
        if all(w in line for w in want):
            out.append(p)
    return out


def end_slot(hostname: str, local_rank: str, pid: int,
             remote_kill: Callable[[str, int], None]) -> str:
    """Ends a slot's launch process tree (SIGKILL: a stopped process ignores everything else);
    returns how ("local", "ssh" or "" when none was found)."""
    procs = slot_processes(hostname, local_rank)
    if not procs:
        return ""
    remote = any(_name(p) == "ssh" for p in procs)
    for p in procs:
        # The launch process first, its descendants (listed before it dies) after: a shell
        # whose worker died first can exit on its own before its kill lands, with a status
        # of its choosing (0 after `worker; true`), which Horovod takes for the slot's.
        for q in [p, *_descendants(p)]:
            try:
                q.kill()
            except psutil.Error:
                pass
    if remote:
        threading.Thread(target=remote_kill, args=(slots.real_host(hostname), pid),
                         daemon=True, name="hvd-resilient-remote-kill").start()
    return "ssh" if remote else "local"


def ssh_killer(port: str | None, identity: str | None) -> Callable[[str, int], None]:
    """`kill -9 PID` on a host, over ssh with the job's own settings."""
    from horovod.runner.util.remote import get_remote_command

    def kill(host: str, pid: int) -> None:
        cmd = get_remote_command(f"kill -9 {int(pid)}", host=host, port=port,
                                 identity_file=identity, timeout_s=int(REMOTE_KILL_TIMEOUT_S))
        try:
            subprocess.run(cmd, shell=True, timeout=REMOTE_KILL_TIMEOUT_S,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            logger.warning("could not reach %s to kill its frozen worker %d", host, pid)

    return kill


def watch(driver: Any, remote_kill: Callable[[str, int], None], emit: Callable[..., Any],
          poll_s: float = POLL_S) -> None:
    """Reports are "<pid> <machine> <reporter slot> <reporter pid>", taken in the order they
    came. One from a worker this driver has already ended is ignored: the side of a partition
    that was cut off (its link back, or only its peers unreachable) finds the healthy ones
    silent too, a moment after they found it."""
    handled: set[tuple[str, bytes]] = set()
    ended: dict[str, str] = {}
    while not driver.finished():
        for key, value in compat.kv_get(driver, LOST_SCOPE).items():
            if (key, value) in handled:
                continue
            handled.add((key, value))
            hostname, _, local_rank = key.rpartition(":")
            fields = value.decode(errors="replace").split()
            if not hostname or not fields or not fields[0].isdigit():
                continue
            if len(fields) >= 4 and ended.get(fields[2]) == fields[3]:
                logger.warning("slot %s reported silent by %s, which was itself evicted: "
                               "ignored", key, fields[2])
                continue
            ended[key] = fields[0]
            how = end_slot(hostname, local_rank, int(fields[0]), remote_kill)
            logger.warning("slot %s[%s] reported silent by its peers: %s", hostname, local_rank,
                           f"ended ({how})" if how else "no process found (already gone)")
            emit(ev.SLOT_EVICTED, slot=key, pid=int(fields[0]), how=how or None)
        time.sleep(poll_s)


class _KeepsVerdicts(dict[str, dict[str, bytes]]):
    """The rendezvous store's cache, which Horovod clears at every new rendezvous, keeping
    the silent slots named so far: an evicted worker that reconnects (a healed partition)
    asks there whether it was evicted, after the survivors' reset has begun."""

    def clear(self) -> None:
        kept = self.get(LOST_SCOPE)
        super().clear()
        if kept is not None:
            self[LOST_SCOPE] = kept


def keep_verdicts(driver: Any) -> None:
    httpd = driver._rendezvous._httpd
    with httpd.cache_lock:
        if not isinstance(httpd.cache, _KeepsVerdicts):
            httpd.cache = _KeepsVerdicts(httpd.cache)


def start_and_watch(start: Callable[..., None], remote_kill: Callable[[str, int], None],
                    emit: Callable[..., Any]) -> Callable[..., None]:
    """`ElasticDriver._start_worker_processes` that starts the driver's watch first, once."""
    watching: PerObject[threading.Event] = PerObject(threading.Event)  # set: watch started

    def start_worker_processes(self: Any, pending_slots: list[Any]) -> None:
        started = watching.of(self)
        if not started.is_set():
            started.set()
            keep_verdicts(self)
            threading.Thread(target=watch, args=(self, remote_kill, emit), daemon=True,
                             name="hvd-resilient-evict").start()
        start(self, pending_slots)

    return start_worker_processes


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic.driver import ElasticDriver

    killer = ssh_killer(ctx.options.ssh_port, ctx.options.ssh_identity)
    compat.replace(ElasticDriver, "_start_worker_processes",
                   start_and_watch(ElasticDriver._start_worker_processes, killer, ctx.emit))


def _name(p: psutil.Process) -> str:
    try:
        return str(p.name())
    except psutil.Error:
        return ""


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return list(p.children(recursive=True))
    except psutil.Error:
        return []

