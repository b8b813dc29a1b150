"""Small tools the checkpoint tests share."""

from __future__ import annotations

from pathlib import Path

from hvd_resilient.checkpoint import CheckpointManager


class Events(list):
    """An ``on_event`` sink that records ``(name, fields)``."""

    def __call__(self, name: str, fields: dict) -> None:
        self.append((name, fields))

    def named(self, name: str) -> list[dict]:
        return [f for n, f in self if n == name]


def flip_byte(mgr: CheckpointManager, key: str, offset: int = 3) -> None:
    """Bit rot in a stored object: same size, one byte different."""
    store = mgr.store
    if mgr.url.startswith("file://"):
        path = Path(store.root, *key.split("/"))  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(data)
    else:
        data = bytearray(store.get(key))
        data[offset] ^= 0xFF
        store.put(key, data)
