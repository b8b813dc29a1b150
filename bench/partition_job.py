"""The vanilla job of `bench/partition.py`: `bench/recovery_job.py --stack vanilla` (Horovod's
own `hvd.elastic.run` with `hvd.elastic.TorchState`, as a plain Horovod Elastic user writes it),
plus the two events ours writes when a collective fails.

Why a wrapper: plain Horovod says nothing when its loop catches the `HorovodInternalError`,
so without these events vanilla's detection time and lost steps could not be read from the
event log at all, or only indirectly. `hvd.elastic.run` calls `state.restore()` exactly there
(and nowhere else), so wrapping `TorchState.restore` records `failure_detected` and `restore`
(`lost_steps`) at the moment ours records them in `hvd_resilient.run`'s except branch. It only
observes: the training code and Horovod's recovery are untouched.
"""

from __future__ import annotations

import argparse
import os

import horovod.torch as hvd
import recovery_job  # bench/ is this script's folder, so it is on sys.path

from hvd_resilient.events import EventLog


def instrument(run_dir: str) -> None:
    """Makes every `TorchState.restore` (= Horovod caught a failed collective) write the
    events ours writes, to the run's shared event log."""
    events = EventLog(os.path.join(run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    restore = hvd.elastic.TorchState.restore

    def restore_and_record(self: hvd.elastic.TorchState) -> None:
        before = self.step
        events.step_source = lambda: self.step  # `step`: the state's, before and after
        events.emit("failure_detected", error="HorovodInternalError (hvd.elastic.run)")
        restore(self)
        events.emit("restore", from_step=before, to_step=self.step,
                    lost_steps=before - self.step)

    hvd.elastic.TorchState.restore = restore_and_record


def main() -> int:
    p = argparse.ArgumentParser(add_help=False)  # recovery_job parses (and checks) the rest
    p.add_argument("--run-dir", required=True)
    instrument(p.parse_known_args()[0].run_dir)
    return recovery_job.main()


if __name__ == "__main__":
    raise SystemExit(main())
