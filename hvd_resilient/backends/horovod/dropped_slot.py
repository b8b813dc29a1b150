"""A worker whose slot the next world drops (its host dropped by discovery) exits cleanly.

Horovod lets such a worker find out inside `hvd.init()`: it joins the rendezvous (the
driver's barrier counts it), gets rank -1, and its background thread throws "has been
removed from elastic job" where nothing catches it, so the process dies by SIGABRT (exit 134,
"terminate called ... Aborted" in the job's output) at every planned scale-down, skipping
every `finally` of the script (loader workers, an upload in flight).

The driver now writes the next world's slots before it announces a host change
(`launch/horovod/patches/next_slots.py`). A worker resetting for a host change reads them; when
its slot is missing it leaves the old world, asks the rendezvous for its place exactly as
`hvd.init()` would (so the barrier completes as before), and on rank -1 exits with code 0,
which Horovod ignores for a slot without a rank, as it ignored the abort. Exiting without
that request would leave the barrier one short: the driver would then count the exit, and an
exit 0 of a slot it still lists ends the whole job as finished (measured: the others were
killed).
"""

from __future__ import annotations

import logging

from horovod.runner.elastic.rendezvous import GET_RANK_AND_SIZE

from hvd_resilient.backends.horovod import driver_kv, lost_slots

logger = logging.getLogger(__name__)

RENDEZVOUS_WAIT_S = 600.0
"""How long the request may wait in the driver's barrier (the others' reset, a held standby)."""


def slot_left() -> str | None:
    """This worker's slot when the driver's next world leaves it out; None when it stays,
    or when the driver did not say (then `hvd.init()` decides, as in plain Horovod)."""
    nxt = driver_kv.next_slots()
    mine = lost_slots.slot_key()
    return mine if nxt is not None and mine not in nxt else None


def rank_in_next_world(slot: str, timeout: float = RENDEZVOUS_WAIT_S) -> int | None:
    """The rank the rendezvous gives `slot` (-1: none), waiting in the driver's barrier as
    `hvd.init()` does; None when the driver does not answer."""
    answer = driver_kv.get(driver_kv.url(GET_RANK_AND_SIZE, slot), timeout)  # init's request
    if not isinstance(answer, bytes):
        return None
    head = answer.split(b",", 1)[0].strip()
    try:
        return int(head)
    except ValueError:
        return None


def exit_code_of_leaving(slot: str) -> int:
    """Takes part in the rendezvous that forms the next world and says how this worker ends:
    0 when it has no rank there (or the driver is gone), 1 when its slot came back in the
    meantime (its init can no longer join: the driver then handles a failed slot)."""
    rank = rank_in_next_world(slot)
    if rank is not None and rank >= 0:
        logger.warning("slot %s was listed again while it left the job (rank %d); exiting "
                       "(code 1) as a failed worker", slot, rank)
        return 1
    return 0
