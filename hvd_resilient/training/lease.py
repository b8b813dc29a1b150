"""The run's lease as a training process holds it (`run_lease.py` has the lease itself).

Under `hvd-resilient run` the supervisor holds the lease and renews it; its workers get the
epoch (`checkpoint.lease_epoch`) and watch the lease, stopping within a second of a takeover.
A plain `horovodrun`, `mpirun` or `torchrun` launch has no supervisor: its ranks take the lease
themselves, all under their launch's name (`launcher_env.launcher_job_id`), and each renews it.
Either way a job that was taken over stops itself, and the store's fence refuses its
checkpoints, so two launches never train on one run.
"""

from __future__ import annotations

import sys
import time

from hvd_resilient import event_names as ev
from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import FATAL_EXIT_CODE, LaunchError, exit_now
from hvd_resilient.events import EventLog
from hvd_resilient.launcher_env import launcher_job_id
from hvd_resilient.run_lease import LeaseHeldError, LeaseRecord, Renewal, RunLease, watch_lease

PLAIN_WAIT_S = 30.0
"""How long the ranks of a plain launch wait for a live job holding the run to end (the
default of `hvd-resilient run --lease-wait`)."""


def take_plain(cfg: TrainConfig, rank: int) -> Renewal | None:
    """Takes or joins the run's lease for this plain launch, sets `cfg.checkpoint.lease_epoch`
    to its epoch and returns its renewal; None, `cfg` as it is, when a supervisor holds the
    lease, or when no known launcher started this process (nothing to share a lease with).

    The store's fence is raised to the epoch at the resume (`DurableCheckpoints.start`), once
    the store answered: a store down at a relaunch is waited for there, within its bound.

    Raises:
        LaunchError: another live job holds the run.
    """
    job = launcher_job_id()
    if cfg.checkpoint.lease_epoch or job is None:
        return None
    lease = RunLease(cfg.run_dir, f"plain:{job}")

    def waiting(old: LeaseRecord) -> None:
        if rank == 0:
            print(f"hvd-resilient: run {cfg.run_id} is held by a live job "
                  f"({old.describe(time.time())}); waiting up to {PLAIN_WAIT_S:g} s for it to "
                  "end", file=sys.stderr, flush=True)

    try:
        lease.join_or_take(wait_s=PLAIN_WAIT_S, on_wait=waiting)
    except LeaseHeldError as e:
        raise LaunchError(f"{e}; stop it first, or launch with `hvd-resilient run --take-over`"
                          ) from None
    # In place, not a copy: scripts hold the trainer's config and change it while it trains
    # (a stop file setting max_steps), which a copy would no longer see.
    cfg.checkpoint.lease_epoch = lease.epoch
    return Renewal(lease)


def stop_when_taken_over(cfg: TrainConfig, events: EventLog, renewal: Renewal | None) -> None:
    """From here on, a takeover of the run (a newer lease epoch) stops this process: one
    line, a `lease_lost` event, exit 78 (a fault no restart fixes: nothing relaunches it).
    Its checkpoints would be refused anyway (the store's fence); stopping also ends its
    memory-tier commits and frees the machine."""
    def lost(what: LeaseRecord | str) -> None:  # the watch's record, or the renewal's why
        why = what if isinstance(what, str) else \
            f"the run was taken over by lease epoch {what.epoch} ({what.describe(time.time())})"
        events.emit(ev.LEASE_LOST, error=why)
        print(f"hvd-resilient: stopping: {why}", file=sys.stderr, flush=True)
        exit_now(FATAL_EXIT_CODE)

    if renewal is not None:
        renewal.on_lost = lost  # this process renews the lease: a failed renewal tells
    elif cfg.checkpoint.lease_epoch:
        watch_lease(cfg.run_dir, cfg.checkpoint.lease_epoch, lost)
