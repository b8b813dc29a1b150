"""A tiny Horovod Elastic job for launcher tests: one allreduce per step, nothing to train.

--fatal-rank R --fatal-step S: rank R meets a ConfigError at step S, after init, while the other
ranks wait in the step's allreduce (a check that only fails once the job runs). --until FILE:
the ranks stop together at the first commit after FILE exists. Each rank records `start` when
it trains and `done` when it finishes, in RUN_DIR/events.jsonl.
"""

from __future__ import annotations

import argparse
import os
import time

import horovod.torch as hvd
import torch

from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.errors import ConfigError
from hvd_resilient.events import EventLog


@exit_on_error
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--fatal-rank", type=int, default=-1)
    p.add_argument("--fatal-step", type=int, default=5)
    p.add_argument("--until", default="", help="stop once this file exists")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--step-time", type=float, default=0.02)
    a = p.parse_args()
    hvd.init()
    state = hvd.elastic.TorchState(step=0)
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size,
                      step=lambda: state.step)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        events.emit("start", pid=os.getpid())
        while state.step < a.max_steps:
            if hvd.rank() == a.fatal_rank and state.step >= a.fatal_step:
                raise ConfigError(f"probe: rank {hvd.rank()} refuses step {state.step} "
                                  "(a late configuration check)")
            hvd.allreduce(torch.ones(1), name="tick")
            state.step += 1
            time.sleep(a.step_time)
            if state.step % 5 == 0:
                here = torch.tensor([1.0 if a.until and os.path.exists(a.until) else 0.0])
                stop = hvd.allreduce(here, op=hvd.Max, name="stop").item() > 0
                state.commit()
                if stop:
                    return

    train(state)
    events.emit("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
