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


def wrapped(seed: int = 0) -> ElasticState:
    """As the Trainer builds it: the scheduler on the user's optimizer, Horovod's wrapper
    around it (a second object sharing the parameter-group dicts)."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / 10)
    dist_opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return ElasticState(model, dist_opt, sampler=ElasticDataSampler(100, seed=seed),
                        scheduler=sched)


def test_two_restores_without_a_commit_between_give_the_commit_both_times():
    """Horovod's handler restored the committed optimizer tensors themselves: the steps after
    the first restore mutated the commit, and a second restore gave that back."""
    s = wrapped()
    s.sync()
    train_steps(s, 2)
    s.commit()
    committed = snapshot(s)
    for _ in range(2):
        train_steps(s, 3)
        s.restore()
        assert snapshot(s) == committed


def test_the_schedule_still_steers_the_wrapped_optimizer_after_a_restore():
    s = wrapped()
    s.sync()
    train_steps(s, 2)
    s.commit()
    train_steps(s, 1)
    s.restore()
    lr = s.optimizer.param_groups[0]["lr"]
    s.scheduler.step()
    assert s.optimizer.param_groups[0]["lr"] != lr, "the scheduler steers stale group dicts"
    assert s.optimizer.param_groups[0]["lr"] == s.scheduler.get_last_lr()[0]


def test_horovods_signature_with_its_own_epoch_and_batch():
    """`TorchState(model, optimizer, batch=0, epoch=0)`: no sampler, epoch and batch the
    script's own committed attributes."""
    model = nn.Linear(4, 2)
    s = ElasticState(model, torch.optim.SGD(model.parameters(), lr=0.1), batch=0, epoch=0)
    s.sync()
    assert not s.exact_once
    s.epoch += 1
    s.batch = 7
    s.commit()
    s.epoch, s.batch = 5, 9
    s.restore()
    assert (s.epoch, s.batch) == (1, 7)
    assert s.checkpoint_state([{}])["extras"] == {"batch": 7, "epoch": 1}


def test_epoch_follows_the_sampler_unless_the_script_owns_it():
    s = make()
    assert s.exact_once and s.epoch == 0
    with pytest.raises(AttributeError, match="pass epoch=0"):
        s.epoch = 3


def test_a_grad_scaler_and_an_ema_are_committed_restored_and_checkpointed():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    s = ElasticState(model, opt, scaler=scaler, ema=ema)
    s.sync()
    scaler.scale(torch.ones(()))
    scaler.update(2048.0)
    ema.update_parameters(model)
    s.commit()
    saved = s.checkpoint_state([{}])["components"]
    assert saved["scaler"]["scale"] == 2048.0 and "n_averaged" in saved["ema"]
    scaler.update(4.0)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update_parameters(model)
    s.restore()
    assert scaler.get_scale() == 2048.0
    assert torch.equal(ema.n_averaged, torch.tensor(1))
    other = ElasticState(nn.Linear(4, 2), torch.optim.Adam(model.parameters()),
                         scaler=torch.amp.GradScaler("cpu"),
                         ema=torch.optim.swa_utils.AveragedModel(nn.Linear(4, 2)))
    other.load_checkpoint_state(from_bytes(to_bytes(s.checkpoint_state([{}]))))
    assert other.state_digests()["ema"] == s.state_digests()["ema"]
    assert other.state_digests()["scaler"] == s.state_digests()["scaler"]
