"""Moved to :mod:`hvd_resilient.state.sampler`; this path stays for existing scripts."""

from hvd_resilient.state.sampler import *  # noqa: F403
