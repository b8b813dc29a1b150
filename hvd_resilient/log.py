"""Rank-aware logging: rank 0 speaks, other ranks only on trouble.

Nothing here runs on import; the entry point (trainer, CLI) calls `setup` once.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s [%(who)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank_fn, who: str | None = None) -> None:
        super().__init__()
        self._rank_fn = rank_fn
        self._who = who

    def filter(self, record: logging.LogRecord) -> bool:
        # A record from another thread (the checkpoint writer) can come between a reset's
        # shutdown and init, when the backend has no rank: the line must still be written and
        # the thread must live (an exception here killed the writer, and every later save).
        try:
            rank = self._rank_fn()
        except Exception:
            rank = "?"
        record.rank = rank
        record.who = self._who or f"rank {rank}"
        return True


_handler: logging.Handler | None = None


def setup(rank_fn=lambda: os.environ.get("HOROVOD_RANK", "?"), level: str = "INFO",
          who: str | None = None) -> None:
    """Installs one handler on the `hvd_resilient` logger; rank != 0 logs WARNING and above.
    ``level`` is rank 0's (the trainer passes `observability.log_level`, read by the config:
    nothing here reads it from the environment). ``who``: what a line says in place of
    ``rank N`` (a process that is no rank: an in-place host agent, ``agent h1``)."""
    global _handler
    logger = logging.getLogger("hvd_resilient")
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    _handler.addFilter(_RankFilter(rank_fn, who))
    logger.addHandler(_handler)
    logger.propagate = False
    try:
        rank = int(rank_fn())
    except (TypeError, ValueError):
        rank = 0
    logger.setLevel(level if rank == 0 else max(logging.WARNING, logging.getLevelName(level)))

