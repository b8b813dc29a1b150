"""Which jobs trained on the run, by the lease epoch every event of a job carries.

`hvd-resilient run` (and a plain launch of a Trainer script) takes the run's lease with a new
epoch before it starts anything (`run_lease.py`), so the events of two jobs on one run are told
apart by `lease_epoch`. Each job's training span runs from its first to its last event written
by a training rank; a span that begins before an older epoch's span ended is two jobs training
on one run at once, which the lease exists to prevent: a report problem.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def jobs_of(events: Iterable[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """One entry per lease epoch that trained: epoch, first and last (seconds since `t0`) of
    its training ranks' events, and how many of them."""
    spans: dict[int, list[float]] = {}
    for e in events:
        epoch = e.get("lease_epoch")
        if type(epoch) is int and isinstance(e.get("rank"), int) and e["rank"] >= 0:
            spans.setdefault(epoch, []).append(float(e["ts"]))
    return [{"lease_epoch": k, "first": min(ts) - t0, "last": max(ts) - t0, "events": len(ts)}
            for k, ts in sorted(spans.items())]


def problems(jobs: list[dict[str, Any]]) -> list[str]:
    """One sentence per pair of jobs whose training overlapped."""
    out = []
    for i, a in enumerate(jobs):
        for b in jobs[i + 1:]:
            if b["first"] < a["last"]:
                out.append(f"jobs of lease epochs {a['lease_epoch']} and {b['lease_epoch']} "
                           f"trained on this run at the same time for "
                           f"{a['last'] - b['first']:.2f} s")
    return out


def line(jobs: list[dict[str, Any]], together: list[str]) -> str | None:
    """The report's line (None: one job, or none that says its epoch); `together`: the
    `problems` of the same jobs."""
    if len(jobs) < 2:
        return None
    epochs = ", ".join(str(j["lease_epoch"]) for j in jobs)
    return f"{len(jobs)} (lease epochs {epochs}), " + (
        "some trained at the same time" if together else "one at a time")
