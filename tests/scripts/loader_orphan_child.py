"""A training process with loader workers, for tests/integration/test_loader_orphans.py.

`python loader_orphan_child.py FOLDER [--stuck-before-init]`: builds an `ElasticLoader` with two
workers over a data set whose workers each start a long-lived helper process on their first
sample (as a decoder that runs ffmpeg would), and print one line each on their stdout. Once a
few batches were delivered it writes FOLDER/ready (its pid, its workers' and their helpers'
pids, JSON) and waits to be killed. The helpers inherit whatever stdout and stderr their worker
has.

`--stuck-before-init`: each worker blocks for good inside torch's worker code, before it calls
`worker_init_fn` (as a worker forked while another thread held a lock it then takes does); the
ready file is written once both workers exist, with an empty helper list.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from hvd_resilient.config import DataOptions
from hvd_resilient.data.loader import ElasticLoader
from hvd_resilient.state.sampler import ElasticDataSampler

N = 256


class WithHelper:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started = False

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if not self.started:  # once per worker process (each has its own copy)
            self.started = True
            helper = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
            (self.folder / f"worker-{os.getpid()}").write_text(str(helper.pid))
            print(f"hello from loader worker {os.getpid()}", flush=True)
            print(f"loader worker {os.getpid()} on stderr", file=sys.stderr, flush=True)
        return torch.tensor([i])


def _block_in_forked_children() -> None:
    """torch's worker loop seeds `random` before it calls `worker_init_fn`: block there in any
    process but this one."""
    main_pid, seed = os.getpid(), random.seed

    def blocking_seed(*args: object, **kwargs: object) -> None:
        if os.getpid() != main_pid:
            threading.Event().wait()
        seed(*args, **kwargs)  # type: ignore[arg-type]

    random.seed = blocking_seed  # type: ignore[assignment]


def _children_when_two() -> list[int] | None:
    kids = [c.pid for c in psutil.Process().children()
            if "resource_tracker" not in " ".join(c.cmdline())]
    return kids if len(kids) == 2 else None


def main() -> int:
    folder = Path(sys.argv[1])
    stuck = "--stuck-before-init" in sys.argv[2:]
    if stuck:
        _block_in_forked_children()
    sampler = ElasticDataSampler(N, seed=0)
    loader = ElasticLoader(WithHelper(folder), sampler, batch_size=4,
                           options=DataOptions(num_workers=2))
    if stuck:
        deadline = time.monotonic() + 60
        while (kids := _children_when_two()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = {pid: None for pid in kids or []}
    else:
        for _ in range(8):
            batch = loader.next_batch(0, 1)
            sampler.advance(batch.global_count)
        workers = {int(p.name.split("-")[1]): int(p.read_text())
                   for p in folder.glob("worker-*")}
    tmp = folder / "ready.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "workers": workers}))
    os.replace(tmp, folder / "ready")
    threading.Event().wait()  # until the test kills this process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
