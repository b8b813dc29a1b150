"""A DDP script on `hvd_resilient.inplace` whose every gradient is known: each step rank r
feeds a bias-free linear layer the input (r + 1) * ones, so the gradient DDP must leave on
every rank is the mean over the ranks there are, (size + 1) / 2 per element. A reducer left on
the old group after a shrink 3 -> 2 gives 1.0 (the old divisor) or fails on the destroyed
group; the right answer is 1.5.

Every rank appends one line per step to --out/grads.jsonl (rank, size, member, step, the
gradient it saw, the expected one) and, at the end, its parameter digest to
--out/final-<rank>.json. --die-member M --die-at S: the worker with member id M SIGKILLs itself
at step S, before its backward (its peers are in theirs, waiting on it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_resilient import inplace
from hvd_resilient.launcher_env import INPLACE_MEMBER_ENV


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--die-member", type=int, default=-1)
    p.add_argument("--die-at", type=int, default=4)
    a = p.parse_args()
    out = Path(a.out)
    member = int(os.environ.get(INPLACE_MEMBER_ENV, "-1"))

    inplace.init_process_group(backend="gloo")
    model = DDP(torch.nn.Linear(4, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = inplace.State(model, optimizer)

    @inplace.run
    def train(state: inplace.State) -> None:
        while state.step < a.steps:
            if member == a.die_member and state.step == a.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            rank, size = dist.get_rank(), dist.get_world_size()
            optimizer.zero_grad()
            model(torch.full((1, 4), float(rank + 1))).sum().backward()
            grad = model.module.weight.grad
            assert grad is not None
            line = {"rank": rank, "size": size, "member": member, "step": state.step,
                    "grad": grad.flatten().tolist(), "expected": (size + 1) / 2}
            with open(out / "grads.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            optimizer.step()
            state.commit()

    train(state)
    h = hashlib.sha256()
    for name, t in sorted(model.module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    rank = dist.get_rank()
    (out / f"final-{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "member": member, "digest": h.hexdigest(),
         "step": state.step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
