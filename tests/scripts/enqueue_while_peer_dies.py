"""Rank 1 is SIGKILLed while rank 0 enqueues allreduces of temporaries as fast as it can, so
Horovod's loop finalizes a full queue while the main thread is inside an enqueue: the window of
the GIL deadlock `backends/horovod/pinned_handles.py` closes. Prints one line from rank 0 when
its enqueue fails; without the pins rank 0 hangs for ever (4 of 4 runs before the fix)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

from hvd_resilient.backends.horovod.init import init


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plain", action="store_true", help="plain hvd.init(): no pins")
    a = p.parse_args()
    hvd.init() if a.plain else init()
    hvd.allreduce(torch.zeros(1), name="ready")  # both ranks up before the kill
    if hvd.rank() == 1:
        time.sleep(0.5)  # the fault's moment, not a synchronisation: rank 0's queue fills
        os.kill(os.getpid(), signal.SIGKILL)
    t0, n = time.monotonic(), 0
    try:
        while True:
            # a temporary: its Python object is its only owner besides Horovod
            hvd.allreduce_async_(torch.full((8,), float(n)), name=f"t{n}")
            n += 1
    except Exception as e:  # noqa: BLE001 - the one line the test looks for
        print(f"rank 0: enqueue failed after {n} operations, {time.monotonic() - t0:.2f} s: "
              f"{type(e).__name__}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
