"""Backend-neutral in-memory commits (state/commits.py): what an in-place backend without
Horovod keeps, and what Horovod's elastic state holds in its handler slots."""

from __future__ import annotations

import torch
from torch import nn

from hvd_resilient.state.commits import LocalCommits, ModuleCommit, OptimizerCommit, copy_tree


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    _steps(model, opt, sched, 2)
    return model, opt, sched


def _steps(model: nn.Module, opt: torch.optim.Optimizer, sched: object, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(16, 4)).sum().backward()
        opt.step()
        sched.step()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    sd = opt.state_dict()["state"]
    return [t.clone() for t in model.state_dict().values()] + [
        t.clone() for s in sd.values() for t in s.values()]


def test_two_failures_in_a_row_restore_the_same_commit() -> None:
    """Steps after a restore must not reach the commit: a second failure before the next commit
    restores exactly what the first one did (AdamW moments, BatchNorm stats, the schedule)."""
    model, opt, sched = _trained()
    commits = LocalCommits({"model": model, "optimizer": opt, "scheduler": sched})
    commits.save()
    committed, lr = _snapshot(model, opt), opt.param_groups[0]["lr"]
    for _ in range(2):
        _steps(model, opt, sched, 3)
        assert opt.param_groups[0]["lr"] != lr
        commits.restore()
        assert all(torch.equal(a, b) for a, b in zip(_snapshot(model, opt), committed, strict=True))
        assert opt.param_groups[0]["lr"] == lr


def test_the_scheduler_still_steers_the_optimizer_after_a_restore() -> None:
    model, opt, sched = _trained()
    commits = LocalCommits({"model": model, "optimizer": opt, "scheduler": sched})
    commits.restore()
    before = opt.param_groups[0]["lr"]
    sched.step()
    assert opt.param_groups[0]["lr"] != before, "the scheduler steers a dict nobody uses"


def test_random_streams_are_committed_and_restored() -> None:
    commits = LocalCommits({})
    commits.save()
    first = torch.rand(3)
    commits.restore()
    assert torch.equal(torch.rand(3), first)


def test_each_component_gets_the_commit_its_kind_needs() -> None:
    model, opt, sched = _trained()
    commits = LocalCommits({"model": model, "optimizer": opt, "scheduler": sched, "ema": None})
    assert isinstance(commits.commits["model"], ModuleCommit)
    assert isinstance(commits.commits["optimizer"], OptimizerCommit)
    assert set(commits.commits) == {"model", "optimizer", "scheduler", "rng"}


def test_a_copy_shares_no_tensor_with_its_source() -> None:
    src = {"a": torch.ones(3), "b": [torch.zeros(2), 5], "c": "x"}
    out = copy_tree(src)
    out["a"].add_(1)
    out["b"][0].add_(1)
    assert torch.equal(src["a"], torch.ones(3)) and torch.equal(src["b"][0], torch.zeros(2))
    assert out["b"][1] == 5 and out["c"] == "x"
