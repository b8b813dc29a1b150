"""How checkpoint code reports what happened without knowing the event log: an ``on_event``
callback that the trainer maps onto its ``events.jsonl`` (tools and tests pass their own)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: ``on_event(name, fields)``: fields never hold credentials.
EventFn = Callable[[str, dict[str, Any]], None]


def emit(on_event: EventFn | None, name: str, fields: dict[str, Any]) -> None:
    """Call ``on_event`` and swallow its failures: a broken event sink must not stop training."""
    if on_event is None:
        return
    try:
        on_event(name, fields)
    except Exception:
        logger.exception("on_event(%r) raised; event dropped", name)
