"""Moved to :mod:`hvd_resilient.training.durable`; this path stays for existing scripts."""

from hvd_resilient.training.durable import *  # noqa: F403
