"""Moved to :mod:`hvd_resilient.training.trainer`; this path stays for existing scripts."""

from hvd_resilient.training.trainer import *  # noqa: F403
