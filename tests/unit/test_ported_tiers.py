"""Which ported loops `hvd_resilient.run` gives the memory tier and durable checkpoints, in
process (the resumes themselves: tests/integration/test_thirdparty_horovod.py)."""

from __future__ import annotations

import torch

import hvd_resilient
from hvd_resilient.backends.horovod import ported as backend_ported
from hvd_resilient.backends.horovod.backend import HorovodBackend
from hvd_resilient.backends.horovod.state import ElasticState
from hvd_resilient.config import TrainConfig
from hvd_resilient.training import ported
from hvd_resilient.training.durable import DurableCheckpoints


def test_the_public_run_is_the_training_layers():
    """The migration page's `@hvd_resilient.run` gets the tiers; the Trainer keeps the
    backend's loop (it wires its own)."""
    assert hvd_resilient.run is ported.run


def test_durable_checkpoints_are_written_only_at_a_location_of_the_runs_own(tmp_path):
    run_dir = str(tmp_path / "run")
    assert not ported.explicit_location(TrainConfig(run_id="r", run_dir=run_dir))
    given = TrainConfig(run_id="r", run_dir=run_dir)
    given.checkpoint.url = (tmp_path / "ckpt").as_uri()
    assert ported.explicit_location(given)


def test_a_state_with_checkpoints_of_the_scripts_own_is_left_alone(tmp_path):
    model = torch.nn.Linear(2, 1)
    state = ElasticState(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=1)
    assert not ported.wired_already(state)
    cfg = TrainConfig(run_id="r", run_dir=str(tmp_path))
    DurableCheckpoints(cfg, state, state.events, HorovodBackend())
    assert ported.wired_already(state)


def test_begin_hooks_last_only_for_the_call_that_set_them():
    calls: list[str] = []
    with backend_ported.extended(lambda loop: calls.append("outer")):
        with backend_ported.extended(lambda loop: calls.append("inner")):
            for hook in backend_ported._BEGIN_HOOKS.get():
                hook(None)  # type: ignore[arg-type]
        assert len(backend_ported._BEGIN_HOOKS.get()) == 1
    assert backend_ported._BEGIN_HOOKS.get() == ()
    assert calls == ["outer", "inner"]
