"""ElasticState in one process: commit/restore covers every component, checkpoints round-trip."""

from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch
from torch import nn

from hvd_resilient.backends.horovod.state import ElasticState
from hvd_resilient.checkpoint.serialize import from_bytes, to_bytes
from hvd_resilient.state import rng
from hvd_resilient.state.sampler import ElasticDataSampler


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield
    hvd.shutdown()


def make(seed: int = 0, lr_scaling: str = "none") -> ElasticState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return ElasticState(model, opt, sampler=ElasticDataSampler(100, seed=seed), scheduler=sched,
                        seed=seed, lr_scaling=lr_scaling, note="x")


def train_steps(s: ElasticState, n: int) -> None:
    for _ in range(n):
        s.optimizer.zero_grad()
        s.model.train()
        s.model(torch.randn(5, 4)).sum().backward()
        s.optimizer.step()
        s.scheduler.step()
        s.sampler.advance(s.sampler.next_slice(0, 1, 5).global_count)
        s.step += 1


def snapshot(s: ElasticState) -> bytes:
    return to_bytes(s.checkpoint_state([{}]))


def test_restore_undoes_everything_since_commit():
    s = make()
    s.sync()
    train_steps(s, 3)
    s.commit()
    before = (snapshot(s), torch.rand(2))
    s.note = "changed"
    train_steps(s, 4)
    s.restore()
    assert s.note == "x"
    assert snapshot(s) == before[0]
    assert torch.equal(torch.rand(2), before[1]), "random streams not restored"


def test_checkpoint_round_trip_through_weights_only_load():
    a = make(seed=1)
    a.sync()
    train_steps(a, 5)
    streams = [rng.capture()]
    expected_draw = torch.rand(3)
    sd = from_bytes(to_bytes(a.checkpoint_state(streams)))
    b = make(seed=2)
    b.load_checkpoint_state(sd)
    assert b.step == 5 and b.sampler.consumed == a.sampler.consumed
    assert b.params_sha256() == a.params_sha256()
    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    assert b.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        a.optimizer.state_dict()["state"][0]["exp_avg"])
    b.sync()  # the first sync hands each rank its own saved random streams
    assert torch.equal(torch.rand(3), expected_draw)
    assert b.resume_rng is None


def test_params_digest_sees_every_change():
    s = make()
    d = s.params_sha256()
    with torch.no_grad():
        next(s.model.parameters())[0, 0] += 1e-7
    assert s.params_sha256() != d


def test_linear_lr_scaling_follows_world_size_once():
    s = make(lr_scaling="linear")
    s.sync()  # world size 1: factor 1
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    s.lr_scale = 0.5  # as if committed at half the size: the next sync rescales x2
    s.save()
    s.sync()
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.02)
    assert s.lr_scale == 1.0
