"""The failure detectors: how a worker learns of a failure before its collective's timeout.

Two kinds live here, and every backend wires them the same way:

- **Peer detectors** watch the other ranks. Each offers something to the others at every
  (re)start of the world (one allgather carries every detector's offer), is armed with what
  every rank offered, and is disarmed before any deliberate teardown, so that a rank leaving on
  purpose is never taken for a dead one:
  - `gloo_watch.GlooWatch`: the hang-up watch on the Gloo connections of any Gloo group
    (Horovod's or torch.distributed's), found by their endpoints (`tcp_sockets`); on the first
    hang-up it shuts them all down (`hangup`), so the news crosses the job in one hop;
  - `silent_peers.SilentPeers` over `heartbeat`: UDP heartbeats for peers that freeze or are
    cut off without hanging up.
- **The progress watchdog** (`progress`) watches this rank: alive, but no step ended within
  its budget. Started once per process by the trainer; code below it declares long phases with
  `progress.section`.

What a backend does with a detection is its own (Horovod elastic resets in place, torchrun's
agent restarts every worker); what detects it is shared. Adding a detector: implement
`Detector`, add it to the backend's `Detectors`, and its offer travels in the same allgather
(docs/extending.md has the edit list and the test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Detector(Protocol):
    """A peer detector, armed after every (re)start of the world."""

    name: str
    """Its key in `Detectors.arm`'s counts (and in the `watch` event)."""

    def offer(self, rank: int) -> Any:
        """What this rank tells every other one at arming; picklable."""

    def arm(self, me: int, everyone: list[Any]) -> int:
        """Starts watching, given every rank's offer (index = rank); returns how much it
        watches (0: it cannot help in this world)."""

    def disarm(self) -> None:
        """Stops watching; idempotent."""


class Detectors:
    """The peer detectors of one worker process, armed together from one allgather."""

    def __init__(self, *detectors: Detector) -> None:
        self.detectors = detectors

    def offers(self, rank: int) -> dict[str, Any]:
        return {d.name: d.offer(rank) for d in self.detectors}

    def arm(self, me: int, everyone: list[dict[str, Any]]) -> dict[str, int]:
        """`everyone`: every rank's `offers()`, by rank. Returns each detector's count."""
        return {d.name: d.arm(me, [o[d.name] for o in everyone]) for d in self.detectors}

    def arm_with(self, me: int, allgather: Callable[[Any], list[Any]]) -> dict[str, int]:
        """Offers and arms through the backend's object allgather (a collective)."""
        return self.arm(me, allgather(self.offers(me)))

    def disarm(self) -> None:
        for d in self.detectors:
            d.disarm()
