"""How many CPU threads each worker's torch may use: its share of the machine."""

from __future__ import annotations

import os

import torch


def share_cores(workers_here: int) -> int:
    """Several workers per machine each running torch's default thread pool oversubscribe the
    cores and slow every step; give each its share unless the user set OMP_NUM_THREADS.
    Returns the thread count in force."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers_here)))
    return torch.get_num_threads()
