"""Everything that must survive a failure, on top of `hvd.elastic.TorchState`.

TorchState already commits the model and optimizer. It does not know LR schedulers, an
exact-once sampler, counters or every rank's random streams, and its sync broadcasts plain
attributes from the last *commit* while the model comes from the *current* values. Here every
component has a handler with save/restore/sync, sync always sends rank 0's values, and what a
durable checkpoint holds is one plain dict (`checkpoint_state`), loadable with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic.state import StateHandler, TorchState

from hvd_resilient import rng
from hvd_resilient.events import EventLog
from hvd_resilient.log import get
from hvd_resilient.sampler import ElasticDataSampler

log = get("state")


class _StateDictHandler(StateHandler):
    """Commit/restore any object with state_dict(); sync = broadcast rank 0's current one."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(hvd.broadcast_object(self.value.state_dict(), root_rank=0))


class _RngHandler(StateHandler):
    """Each rank keeps its own streams: committed and restored locally, never broadcast."""

    def __init__(self) -> None:
        super().__init__(None)
        self._saved = rng.capture()

    def save(self) -> None:
        self._saved = rng.capture()

    def restore(self) -> None:
        rng.restore(self._saved)

    def sync(self) -> None:
        pass


def lr_scale_for(rule: str, world_size: int) -> float:
    return float(world_size) if rule == "linear" else 1.0


class ElasticState(TorchState):
    """State of one elastic training run: model, optimizer, scheduler, sampler, counters, RNG.

    `step` and `samples` count optimizer steps and samples over the whole run; the epoch and the
    position inside it live in the sampler. Extra keyword arguments become committed plain
    attributes (ints, floats, strings, tensors: what a durable checkpoint can carry).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sampler: ElasticDataSampler,
        scheduler: Any | None = None,
        seed: int = 0,
        lr_scaling: str = "none",
        events: EventLog | None = None,
        **extras: Any,
    ) -> None:
        self.events = events or EventLog(None)
        if self.events.step_source is None:
            self.events.step_source = lambda: self.step
        self._seed = seed
        self._lr_scaling = lr_scaling
        self._synced_once = False
        self._extra_names = tuple(extras)
        self.last_commit_step = 0
        super().__init__(
            model=model, optimizer=optimizer, step=0, samples=0, lr_scale=1.0,
            resume_rng=None, **extras,
        )
        self._handlers["sampler"] = _StateDictHandler(sampler)
        self.sampler = sampler
        if scheduler is not None:
            self._handlers["scheduler"] = _StateDictHandler(scheduler)
        self.scheduler = scheduler
        self._handlers["rng"] = _RngHandler()

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    # -- the elastic protocol -------------------------------------------------------------
    def commit(self) -> None:
        t0 = time.perf_counter()
        self.save()
        self.last_commit_step = self.step
        if hvd.rank() == 0:
            self.events.emit("commit", seconds=round(time.perf_counter() - t0, 6))
        self.check_host_updates()

    def restore(self) -> None:
        before = self.step
        super().restore()
        self.events.emit(
            "restore", from_step=before, to_step=self.step, lost_steps=before - self.step
        )
        log.warning("restored the last commit: step %d -> %d", before, self.step)

    def sync(self) -> None:
        super().sync()
        if not self._synced_once:
            self._apply_start_rng()
            self._synced_once = True
        self._apply_lr_scaling()
        # Everyone now holds rank 0's state: make it the commit point, so that a failure before
        # the next commit restores this, not whatever a freshly started worker had.
        self.save()

    # -- pieces ----------------------------------------------------------------------------
    def _apply_start_rng(self) -> None:
        resume = self.resume_rng
        r, n = hvd.rank(), hvd.size()
        if resume is not None and resume.get("world_size") == n:
            rng.restore(resume["streams"][r])
        else:
            rng.seed_all(rng.derived_seed(self._seed, "rank", r, "step", self.step))
        self.resume_rng = None

    def _apply_lr_scaling(self) -> None:
        target = lr_scale_for(self._lr_scaling, hvd.size())
        if target == self.lr_scale:
            return
        factor = target / self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        log.info("learning rate scaled x%g for world size %d (%s)", factor, hvd.size(),
                 self._lr_scaling)
        self.lr_scale = target

    def params_sha256(self) -> str:
        """One digest of every parameter and buffer: equal across ranks iff they agree."""
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    # -- durable checkpoints ---------------------------------------------------------------
    def checkpoint_state(self, rng_streams: list[dict[str, Any]]) -> dict[str, Any]:
        """A plain dict of the current state; tensors are shared, the caller snapshots them."""
        out: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "counters": {"step": self.step, "samples": self.samples, "lr_scale": self.lr_scale},
            "rng": {"world_size": len(rng_streams), "streams": rng_streams},
            "extras": {k: getattr(self, k) for k in self._extra_names},
        }
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        """Applies a durable checkpoint locally (no collective: sync spreads it afterwards)."""
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.sampler.load_state_dict(sd["sampler"])
        if self.scheduler is not None and "scheduler" in sd:
            self.scheduler.load_state_dict(sd["scheduler"])
        c = sd["counters"]
        self.step, self.samples, self.lr_scale = int(c["step"]), int(c["samples"]), c["lr_scale"]
        for k, v in sd.get("extras", {}).items():
            if k in self._extra_names:
                setattr(self, k, v)
        self.resume_rng = sd.get("rng")
        self.save()
        self.last_commit_step = self.step


def is_elastic() -> bool:
    """True inside a worker started by `horovodrun` in elastic mode."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"
