"""Fault injection for tests, chaos runs and the recovery benchmarks.

A plan is one string, read once at the edge and passed down: the training setting `fault`
(`HVD_RESILIENT_FAULT`, `--fault`, handed to `FaultPlan.parse` by the trainer), or `ENV` read
by a script's own entry point. `HVD_RESILIENT_FAULT="kill:rank=1:step=50"` (also `raise:` for
a Python exception and `abort:` for an out-of-memory-style abort, and
`stall:rank=0:step=30:seconds=6` for a rank that is alive but busy in Python, which must NOT
be taken for a failure; `hang:` for a rank that never ends its step, `freeze:` for one that
stops itself with SIGSTOP, `sever:` for a collective failure without a death (a
`RuntimeError` as Gloo raises it on a lost connection: the in-place backend forms a new
generation of the same members); `slow:rank=1:step=20:
seconds=0.05` for a straggler: the process that is rank 1 at step 20 sleeps that long in every
step from then on, whatever its rank after a reset, as a slow machine would). `at=upload` fires in
the checkpoint writer instead, once the files of that step's checkpoint are stored and before
its manifest is published: the worst moment for rank 0 to die. Each fault fires once
per run: a marker file in the run folder remembers it (and when it fired), so the worker that
refills the slot does not fire it again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hvd_resilient.errors import ConfigError

ENV = "HVD_RESILIENT_FAULT"
KINDS = ("kill", "raise", "abort", "stall", "hang", "freeze", "slow", "sever")
MOMENTS = ("step", "upload")


class InjectedFault(RuntimeError):
    """Raised by a `raise:` fault; not caught by the library, so the worker dies of it."""


class SeveredCollective(RuntimeError):
    """Raised by a `sever:` fault: reads as a Gloo connection loss (`Connection reset by
    peer`), which a backend that recovers in place recovers from; the process lives on."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 6.0  # stall and slow only
    at: str = "step"


class FaultPlan:
    def __init__(self, faults: list[Fault], run_dir: str) -> None:
        self.faults = faults
        self.run_dir = Path(run_dir)
        self._slow: dict[int, bool] = {}
        """Slow fault index -> whether this process is the slow one (absent: not decided)."""

    @classmethod
    def parse(cls, spec: str | None, run_dir: str) -> FaultPlan:
        faults = []
        for item in filter(None, (s.strip() for s in (spec or "").split(","))):
            kind, *kv = item.split(":")
            fields = dict(p.split("=", 1) for p in kv if "=" in p)
            try:
                if kind not in KINDS or fields.get("at", "step") not in MOMENTS:
                    raise ValueError(kind)
                faults.append(Fault(kind, int(fields["rank"]), int(fields["step"]),
                                    float(fields.get("seconds", 6.0)), fields.get("at", "step")))
            except (KeyError, ValueError):
                raise ConfigError(
                    f"{ENV}: cannot parse {item!r}; use KIND:rank=R:step=S[:at=step|upload] "
                    f"with KIND one of {', '.join(KINDS)}"
                ) from None
        return cls(faults, run_dir)

    def fires_at(self, at: str) -> bool:
        return any(f.at == at for f in self.faults)

    def maybe_fire(self, rank: int, step: int, at: str = "step") -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "slow":
                self._maybe_slow(i, f, rank, step, at)
                continue
            if f.rank != rank or f.step != step or f.at != at:
                continue
            if not self._claim(i, f):
                continue
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "abort":
                os.abort()
            elif f.kind == "stall":  # a rank busy in Python, holding the GIL between switches
                end = time.monotonic() + f.seconds
                while time.monotonic() < end:
                    sum(range(1000))
                continue
            elif f.kind == "hang":
                while True:  # alive, threads running, no progress: the watchdog's case
                    time.sleep(3600)
            elif f.kind == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # as a paused VM: the peers' case
                continue
            elif f.kind == "sever":
                raise SeveredCollective(f"injected at rank {rank} step {step}: Connection reset "
                                        "by peer")
            raise InjectedFault(f"injected fault at rank {rank} step {step}")

    def _claim(self, i: int, f: Fault) -> bool:
        """Claims fault `i` for this process, once per run: its marker appears whole, holding
        when it fired (for the benchmarks), because a test polls for it and reads it at once.
        The time goes into a private file that is then hard-linked to the marker's name: the
        link is atomic and fails if the marker exists, as O_EXCL would, without the moment
        O_EXCL leaves an empty marker visible."""
        marker = self.run_dir / f".fault-{i}-{f.kind}-r{f.rank}-s{f.step}"
        pending = self.run_dir / f".pending-{marker.name[1:]}-{os.getpid()}"
        pending.write_text(f"{time.time():.6f}\n")
        try:
            os.link(pending, marker)
        except FileExistsError:
            return False
        finally:
            pending.unlink()
        return True

    def _maybe_slow(self, i: int, f: Fault, rank: int, step: int, at: str) -> None:
        """A slow machine: the first process at `f.rank` on or after `f.step` claims the fault
        (its marker, once per run) and is slow from then on; no other process ever is, so a
        worker that refills its slot after an eviction is a healthy one."""
        if f.at != at:
            return
        mine = self._slow.get(i)
        if mine is None:
            if f.rank != rank or step < f.step:
                return
            # another process was (or is) the slow one when the claim fails
            self._slow[i] = mine = self._claim(i, f)
        if mine:
            time.sleep(f.seconds)  # the fault IS the sleep: compute that takes longer
