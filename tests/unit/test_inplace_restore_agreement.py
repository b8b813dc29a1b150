"""After an in-place restore the survivors agree without sending anything: each restored the
same commit, so the verified sync finds no component differing, `attributes` included. The
trainer's `last_loss` is each rank's own loss (state.core.RANK_LOCAL): committed and restored
per rank, checkpointed, never compared. Ranks are threads over a barrier-backed exchange (no
process started); the same on a real in-place job:
tests/integration/test_inplace_restore_sync.py."""

from __future__ import annotations

import math
from typing import Any

import torch

from hvd_resilient.backends.inplace.state import InPlaceState
from tests.unit.test_sync_agreement import on_ranks, seeded_linear


def survivor(coll: Any, size: int = 2) -> InPlaceState:
    model = seeded_linear(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    r = coll.rank()
    return InPlaceState(model, opt, collectives=coll, rank=lambda: r, size=lambda: size,
                        last_loss=math.nan)


def train_step(s: InPlaceState, own_loss: float) -> None:
    """What a data-parallel step leaves: the same update on every rank (the averaged
    gradient), each rank's loss of its own batch."""
    for p in s.model.parameters():
        p.grad = torch.ones_like(p)
    s.optimizer.step()
    s.step += 1
    s.samples += 16
    s.last_loss = own_loss


def test_survivors_send_nothing_after_a_restore_and_keep_their_own_loss():
    def run(coll: Any) -> dict[str, Any]:
        s = survivor(coll)
        r = coll.rank()
        s.sync()
        train_step(s, 1.0 + r)
        s.commit()
        train_step(s, 10.0 + r)  # the step lost to the fault
        s.restore()
        s.sync()
        return {"sent": s.last_agreement.sent, "ranks": s.last_agreement.ranks,
                "step": s.step, "loss": s.last_loss,
                "extras": s.checkpoint_state([{}])["extras"]}

    out = on_ranks(2, run)
    assert not [o for o in out if isinstance(o, BaseException)], out
    for r, o in enumerate(out):
        assert (o["sent"], o["ranks"]) == ([], []), f"rank {r}: {o}"
        assert (o["step"], o["loss"]) == (1, 1.0 + r), f"rank {r}: {o}"
    assert out[0]["extras"] == {"last_loss": 1.0}, "a checkpoint carries rank 0's loss"


def test_a_counter_that_differs_is_still_sent_and_the_rank_local_loss_is_not():
    def run(coll: Any) -> dict[str, Any]:
        s = survivor(coll)
        r = coll.rank()
        s.sync()
        s.step, s.last_loss = 5 + r, 2.0 + r
        s.sync()
        return {"sent": s.last_agreement.sent, "ranks": s.last_agreement.ranks,
                "step": s.step, "loss": s.last_loss}

    out = on_ranks(2, run)
    assert not [o for o in out if isinstance(o, BaseException)], out
    assert [(o["sent"], o["ranks"]) for o in out] == [(["attributes"], [1])] * 2, out
    assert [(o["step"], o["loss"]) for o in out] == [(5, 2.0), (5, 3.0)], out
