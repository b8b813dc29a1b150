"""A Horovod script ported to `hvd_resilient.run`, in process: the drop-in DistributedSampler,
the watchdog's line naming a stale torch DistributedSampler, and the report's step unit."""

from __future__ import annotations

import logging
import threading

import pytest
from torch.utils.data import DistributedSampler as TorchSampler

from hvd_resilient.backends.horovod import hang_hint
from hvd_resilient.backends.horovod.sampler import DistributedSampler
from hvd_resilient.detect.progress import ProgressWatchdog
from hvd_resilient.report.analysis import analyze
from hvd_resilient.report.text import render

N = 103  # not a multiple of any world size: padding is exercised


class World:
    """The live world the sampler reads (in place of hvd.size()/hvd.rank())."""

    def __init__(self, size: int) -> None:
        self.size = size


def samplers(monkeypatch, world: World, n: int, data=range(N)) -> list[DistributedSampler]:
    """One sampler per rank of a world whose size the test changes; each reads its own rank."""
    out = [DistributedSampler(data, num_replicas=n, rank=r, shuffle=True, seed=7)
           for r in range(n)]
    for s in out:  # the given rank stands in for hvd.rank(); the size follows the world
        monkeypatch.setattr(s, "world", lambda s=s: (world.size, s._given[1]))
    return out


def take(it, k: int) -> list[int]:
    return [next(it) for _ in range(k)]


def test_in_a_fixed_world_it_yields_what_torchs_sampler_yields(monkeypatch):
    world = World(3)
    ours = samplers(monkeypatch, world, 3)
    for epoch in (0, 1):
        for r, s in enumerate(ours):
            s.set_epoch(epoch)
            theirs = TorchSampler(range(N), num_replicas=3, rank=r, shuffle=True, seed=7)
            theirs.set_epoch(epoch)
            assert list(s) == list(theirs) and len(s) == len(theirs)


def test_a_join_mid_epoch_keeps_every_rank_equal_and_each_sample_once(monkeypatch):
    world = World(3)
    old = samplers(monkeypatch, world, 3)
    its = [iter(s) for s in old]
    seen = [i for it in its for i in take(it, 10)]  # 10 samples a rank, then a commit
    committed = old[0].state_dict()
    assert committed["consumed"] == 30 and all(s.state_dict() == committed for s in old)
    world.size = 4  # a host joins: the newcomer gets rank 0's state at the sync
    new = DistributedSampler(range(N), num_replicas=4, rank=3, shuffle=True, seed=7)
    monkeypatch.setattr(new, "world", lambda: (world.size, 3))
    new.load_state_dict(committed)
    ranks = [*old, new]
    for s in old:
        s.reset()  # the state's after-sync hook
    lengths = {len(s) for s in ranks}
    assert len(lengths) == 1, lengths  # every rank's loop computes the same length
    rest = [list(s) for s in ranks]
    assert len({len(r) for r in rest}) == 1  # and the same number of batches
    every = seen + [i for r in rest for i in r]
    assert set(every) == set(range(N))  # nothing skipped; repeats only the tail's padding
    assert len(every) - N < 4


def test_a_restore_goes_back_to_the_committed_position(monkeypatch):
    world = World(2)
    (a, b) = samplers(monkeypatch, world, 2)
    ia, ib = iter(a), iter(b)
    first = take(ia, 5) + take(ib, 5)
    committed = a.state_dict()
    take(ia, 7), take(ib, 7)  # trained past the commit, then a rank died
    world.size = 1
    a.load_state_dict(committed)
    rest = list(a)
    assert sorted(first + rest) == list(range(N))


def test_a_reset_at_the_epochs_last_batch_leaves_an_empty_pass_not_a_repeat(monkeypatch):
    """A host change at the commit of the epoch's last batch: the loop reenters the epoch
    (Horovod's example, `state.batch` at its last batch) and must train nothing more of it;
    it used to restart the epoch and train its first batch twice (seen in the conformance
    tier: 96 commits instead of 95)."""
    world = World(2)
    (a, b) = samplers(monkeypatch, world, 2)
    share = len(a)
    ia, ib = iter(a), iter(b)
    first = take(ia, share) + take(ib, share)  # every sample handed out, no StopIteration yet
    for s in (a, b):
        s.set_epoch(0)  # the loop reenters the same epoch after the reset
        s.reset()  # the state's after-sync hook
    assert list(a) == [] and list(b) == []
    assert sorted(set(first)) == list(range(N))
    # ... while a pass iterated to its end and iterated again repeats the epoch, as torch's
    # sampler does for a script that never calls set_epoch
    (c,) = samplers(monkeypatch, World(1), 1)
    assert list(c) == list(c) and len(list(c)) == N


def test_record_batch_counts_only_what_was_recorded(monkeypatch):
    """A loader with workers prefetches: only recorded batches are consumed."""
    world = World(1)
    (s,) = samplers(monkeypatch, world, 1)
    it = iter(s)
    take(it, 20)  # 20 handed out (prefetched), 8 trained
    s.record_batch(0, 8)
    assert s.state_dict()["consumed"] == 8


def test_bad_constructor_arguments_say_which_in_one_line():
    with pytest.raises(ValueError, match="rank must be in \\[0, 1\\], got 2"):
        DistributedSampler(range(4), num_replicas=2, rank=2)


def test_the_hint_names_a_stale_torch_sampler_and_the_fix():
    stale = TorchSampler(range(10), num_replicas=3, rank=1)
    fine = TorchSampler(range(10), num_replicas=4, rank=1)
    text = hang_hint.diagnose(4, 1, [stale, fine, object()])
    assert "DistributedSampler built for num_replicas=3 rank=1" in text, text
    assert "rank 1 of 4" in text and "hvd_resilient.DistributedSampler" in text, text
    assert hang_hint.diagnose(4, 1, [fine]) == ""
    # the default scan finds the sampler among every live object
    assert "num_replicas=3 rank=1" in hang_hint.diagnose(4, 1)


def test_the_watchdog_line_names_the_wait_and_the_stale_sampler(tmp_path, caplog):
    stale = TorchSampler(range(10), num_replicas=3, rank=0)
    fired: list[dict] = []
    done = threading.Event()
    dog = ProgressWatchdog(run_dir=str(tmp_path), rank=lambda: 0, poll_s=0.01,
                           emit=lambda name, **f: fired.append({"event": name, **f}),
                           on_hang=done.set, timeout_s=0.1, first_step_s=0.1,
                           diagnose=lambda: hang_hint.diagnose(4, 0, [stale]))
    dog.step()
    dog.begin_wait("the gradient allreduce in optimizer.step()")
    with caplog.at_level(logging.ERROR):
        dog.start()
        assert done.wait(5)
    dog.stop()
    (ev,) = fired
    assert ev["waiting_on"] == "the gradient allreduce in optimizer.step()", ev
    assert "num_replicas=3 rank=0" in ev["cause"], ev
    (line,) = [r.getMessage() for r in caplog.records if "made no progress" in r.getMessage()]
    assert "waiting on the gradient allreduce" in line and "likely cause: a torch" in line
    assert "\n" not in line


def _ev(ts, event, rank=0, size=3, step=0, **kw):
    return {"ts": ts, "event": event, "rank": rank, "size": size, "step": step, **kw}


def test_the_report_counts_a_ported_runs_commits_and_ignores_the_launchers_step():
    evs = [_ev(0.0, "start", rank=r) for r in range(3)]
    evs += [_ev(1.0 + i, "commit", step=i + 1, seconds=0.001, step_unit="commit")
            for i in range(40)]
    evs += [_ev(42.0, "done", rank=r, step=40, step_unit="commit") for r in range(3)]
    evs.append(_ev(43.0, "launcher_exit", rank=-1, size=-1, step=0, exit_code=0))
    r = analyze(evs)
    assert (r.status, r.final_step, r.step_unit, r.world_sizes) == ("finished", 40, "commit",
                                                                     [3])
    text = render(r)
    assert "finished at commit 40; 1 launch; world size 3" in text, text
    assert "commits redone 0" in text, text


def test_a_ported_commit_counts_steps_only_when_the_script_does_not():
    """`ElasticState._count_commit` on a bare object: the script's own step wins."""
    pytest.importorskip("horovod.torch")
    from hvd_resilient.backends.horovod.state import ElasticState

    class Bare:
        step, step_unit, _auto_step = 0, None, 0
        _count_commit = ElasticState._count_commit

    ported = Bare()
    for _ in range(3):
        ported._count_commit()
    assert (ported.step, ported.step_unit) == (3, "commit")
    own = Bare()
    own.step = 5  # the script advanced it before its first commit
    own._count_commit()
    assert (own.step, own.step_unit) == (5, "step")


def test_the_conformance_patch_is_the_migration_pages_diff():
    """port.patch changes exactly the lines the page's first diff changes (the page is the
    source of truth: a user follows it, the tier tests what the user then has)."""
    from tests.support.paths import ROOT

    page = (ROOT / "docs" / "migrating-from-horovod.md").read_text()
    block = page.split("## The lines that change", 1)[1].split("```diff", 1)[1].split("```")[0]
    patch = (ROOT / "tests" / "thirdparty" / "horovod_elastic" / "port.patch").read_text()

    def changed(text: str) -> list[str]:
        return [ln.rstrip() for ln in text.splitlines()
                if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]

    assert changed(patch) == changed(block)
