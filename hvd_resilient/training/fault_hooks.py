"""Where a fault plan (``faults``) reaches into the library at moments other than a training
step: the hooks handed to the machinery a fault fires in, so that that machinery takes a plain
callback and knows nothing of faults, plans or markers (tests and chaos runs only: without a
plan, or with none for that moment, there is no hook at all)."""

from __future__ import annotations

from collections.abc import Callable

from hvd_resilient.training.faults import FaultPlan


def before_publish(plan: FaultPlan | None, rank: int) -> Callable[[int], None] | None:
    """The checkpoint manager's ``before_publish`` for the ``at=upload`` faults of ``plan``,
    as seen by ``rank`` (the process's rank when its manager is made): they fire once a
    step's files are stored and before its manifest is published, the worst moment for the
    writer to die. None when the plan has no such fault."""
    if plan is None or not plan.fires_at("upload"):
        return None

    def fire(step: int) -> None:
        plan.maybe_fire(rank, step, at="upload")

    return fire
