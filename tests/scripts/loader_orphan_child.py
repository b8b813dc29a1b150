"""A training process with loader workers, for tests/integration/test_loader_orphans.py.

`python loader_orphan_child.py FOLDER`: builds an `ElasticLoader` with two workers over a data
set whose workers each start a long-lived helper process on their first sample (as a decoder
that runs ffmpeg would), and print one line each on their stdout. Once a few batches were
delivered it writes FOLDER/ready (its pid, its workers' and their helpers' pids, JSON) and waits
to be killed. The helpers inherit whatever stdout and stderr their worker has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

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


def main() -> int:
    folder = Path(sys.argv[1])
    sampler = ElasticDataSampler(N, seed=0)
    loader = ElasticLoader(WithHelper(folder), sampler, batch_size=4,
                           options=DataOptions(num_workers=2))
    for _ in range(8):
        batch = loader.next_batch(0, 1)
        sampler.advance(batch.global_count)
    workers = {int(p.name.split("-")[1]): int(p.read_text()) for p in folder.glob("worker-*")}
    tmp = folder / "ready.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "workers": workers}))
    os.replace(tmp, folder / "ready")
    threading.Event().wait()  # until the test kills this process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
