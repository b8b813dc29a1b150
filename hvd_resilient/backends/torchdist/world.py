"""The half of a `recovery.World` that every world over torch.distributed answers the same
way (torchrun's, formed once, and the in-place backend's generations)."""

from __future__ import annotations

import socket
from typing import Any

from hvd_resilient.backends.base import Backend


class TorchDistWorld:
    """Rank, size and the allgather are the backend's (over its current default group), the
    machine is this host's name. A subclass sets ``backend`` and adds the rest of
    `recovery.World`."""

    backend: Backend

    def rank(self) -> int:
        return self.backend.rank()

    def size(self) -> int:
        return self.backend.size()

    def machine(self) -> str:
        return socket.gethostname()

    def allgather(self, obj: object) -> list[Any]:
        return self.backend.allgather_object(obj)
