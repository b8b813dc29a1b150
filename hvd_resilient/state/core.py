"""What every training state holds and how it becomes a checkpoint, whatever the backend.

Horovod's elastic state (`backends.horovod.state.ElasticState`), the in-place state
(`backends.inplace.state.InPlaceState`) and the torchrun state
(`backends.torchrun.state.TorchrunState`) differ in how they survive: the first two in process
memory (commit/restore, a verified sync after every reset: `InMemoryState` below), the torchrun
one through the tiers (every worker restarts and resumes from the memory tier or the durable
checkpoint). The parts below are shared: the checkpoint dict, the first-sync random streams,
learning-rate scaling and the parameter digest.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hvd_resilient import event_names as ev
from hvd_resilient.events import EventLog
from hvd_resilient.state import rng
from hvd_resilient.state.agreement import (
    Agreement,
    Collectives,
    Component,
    agree,
    digest_tree,
)
from hvd_resilient.state.optim import load_optimizer_state

logger = logging.getLogger(__name__)


RANK_LOCAL = frozenset({"last_loss"})
"""Plain extras that are each rank's own observation, never state the ranks share: the
trainer's ``last_loss`` is the loss of this rank's own batch at its last step (nothing averages
it over the ranks). Such a value is committed and restored with the other attributes (a restore
gives each rank back its own loss at the commit) and checkpointed (rank 0's), but the verified
sync neither compares nor sends it: compared, it differed on every rank but 0 after every
in-place restore, so each recovery sent ``attributes`` and reported every survivor as
differing, a report that would also have hidden a real divergence of the counters."""


def lr_scale_for(rule: str, world_size: int) -> float:
    return float(world_size) if rule == "linear" else 1.0


class StateCore:
    """Mixin; the concrete state sets model, optimizer, sampler, scheduler, step, samples,
    lr_scale, resume_rng, _seed, _lr_scaling, _extra_names and provides _rank()/_size()."""

    model: Any
    optimizer: Any
    sampler: Any
    scheduler: Any
    step: int
    samples: int
    lr_scale: float
    resume_rng: dict[str, Any] | None
    ckpt_requested: int
    """Newest step whose durable checkpoint the job asked for (the same on every rank)."""
    ckpt_published: int
    """Newest step whose checkpoint every rank knows is published (manifest written)."""
    fatal: str
    """Set when the job must stop (a resume that failed on rank 0): the first sync spreads it,
    so every rank stops instead of training from scratch beside the failed one."""
    _seed: int
    _lr_scaling: str
    _extra_names: tuple[str, ...]

    def _init_core(self, *, seed: int, lr_scaling: str, events: EventLog | None,
                   extras: dict[str, Any]) -> None:
        """The plain attributes every state needs, set before any backend-specific init."""
        self.events = events or EventLog(None)
        if self.events.step_source is None:
            self.events.step_source = lambda: self.step
        self._seed, self._lr_scaling = seed, lr_scaling
        self._stateful = {k: v for k, v in extras.items() if is_stateful(v)}
        """Extras with state_dict()/load_state_dict() (a GradScaler, an EMA model, a second
        model): committed, synced, verified and checkpointed like the model, never by
        reference as plain attributes."""
        self._extra_names = tuple(k for k in extras if k not in self._stateful)
        self._local_names = tuple(k for k in self._extra_names if k in RANK_LOCAL)
        self.last_commit_step = 0
        self._after_sync: list[Callable[[], None]] = []
        self._before_commit: list[Callable[[], None]] = []
        self._after_reset: list[Callable[[], None]] = []

    # -- hooks ------------------------------------------------------------------------------
    def on_sync(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on every rank after each sync (the start and every reset): collectives
        are allowed, every rank runs it at the same point with the same state."""
        self._after_sync.append(fn)

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` on every rank at each commit, before the commit point is taken, so what
        it changes in the state is committed with it. Collectives are allowed."""
        self._before_commit.append(fn)

    def after_reset(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` after every in-process reset (a backend whose recovery restarts the
        processes never calls it)."""
        self._after_reset.append(fn)

    def mark_commit_point(self) -> None:
        """Nothing survives in this process's memory: the tiers are the commit point."""

    def _run_hooks(self, hooks: list[Callable[[], None]]) -> None:
        for fn in hooks:
            fn()

    def mark_fatal(self, error: str) -> None:
        """Records an error that must stop the whole job; see :attr:`fatal`."""
        self.fatal = error

    def _rank(self) -> int:
        raise NotImplementedError

    def _size(self) -> int:
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """The sampler's epoch; a script that passed ``epoch=`` (Horovod's idiom) owns it."""
        if "epoch" in self._extra_names:
            own: int = self.__dict__.get("_own_epoch", 0)  # what the setter stored
            return own
        return self.sampler.epoch if self.sampler is not None else 0

    @epoch.setter
    def epoch(self, value: int) -> None:
        if "epoch" not in getattr(self, "_extra_names", ("epoch",)):
            raise AttributeError("state.epoch follows the sampler here; pass epoch=0 to the "
                                 "state to keep and commit an epoch of your own")
        self.__dict__["_own_epoch"] = value

    @property
    def exact_once(self) -> bool:
        """Whether exact-once sample accounting is in force: only with this library's
        sampler, which commits the position inside the epoch with the state."""
        return hasattr(self.sampler, "next_slice")

    # -- agreement between ranks ----------------------------------------------------------
    def attribute_names(self) -> tuple[str, ...]:
        """The plain attributes every rank must agree on after a sync (not the rank-local
        ones, :data:`RANK_LOCAL`)."""
        return ("step", "samples", "lr_scale", "ckpt_requested", "ckpt_published",
                *(k for k in self._extra_names if k not in self._local_names))

    def _get_attributes(self) -> dict[str, Any]:
        """Every plain attribute a commit keeps: the agreed ones and this rank's own."""
        return {k: getattr(self, k) for k in (*self.attribute_names(), *self._local_names)}

    def _agreed_attributes(self) -> dict[str, Any]:
        """What the sync's ``attributes`` component compares and sends: a rank-local value
        left out, since the ranks' differ by design (:data:`RANK_LOCAL`)."""
        return {k: getattr(self, k) for k in self.attribute_names()}

    def _put_attributes(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            setattr(self, k, v)

    def sync_components(self) -> list[Component]:
        """Everything a sync makes equal on every rank, rank 0's values winning. A sharded
        model and its optimizer are left out: their shards differ by design."""
        model = _unwrapped(self.model)
        out = []
        if not self.sharded():
            out += [Component("model", model.state_dict, model.load_state_dict),
                    Component("optimizer", self.optimizer.state_dict,
                              lambda sd: load_optimizer_state(self.optimizer, sd))]
        for name, obj in (("sampler", self.sampler), ("scheduler", self.scheduler),
                          *self._stateful.items()):
            if obj is not None:
                out.append(Component(name, obj.state_dict, obj.load_state_dict))
        out.append(Component("attributes", self._agreed_attributes, self._put_attributes))
        return out

    def sharded(self) -> bool:
        return any(hasattr(t, "full_tensor") for t in _unwrapped(self.model).state_dict()
                   .values())

    def _agree(self, collectives: Collectives, *, rider: Any = None,
               on_riders: Callable[[list[Any]], None] | None = None) -> Agreement:
        """The verified sync (`state.agreement`), recorded: rank 0 writes a ``sync_check``
        event; every rank whose components needed a second send says so."""
        found = self.last_agreement = agree(self.sync_components(), collectives, rider=rider,
                                            on_riders=on_riders)
        if self._rank() == 0:
            self.events.emit(ev.SYNC_CHECK, sent=found.sent, differing_ranks=found.ranks,
                             repaired=found.repaired, seconds=found.seconds,
                             digest_seconds=found.digest_seconds)
        if found.repaired:
            self.events.emit(ev.SYNC_MISMATCH, components=found.repaired)
            logger.warning("sync: %s differed after the first send and were sent again",
                        ", ".join(found.repaired))
        return found

    def state_digests(self) -> dict[str, str]:
        """This rank's digest of each component (no collective): what the ``done`` event and
        the tests compare across ranks."""
        return {c.name: digest_tree(c.get()) for c in self.sync_components()
                if c.name != "attributes"}

    def params_sha256(self) -> str:
        """One digest of every parameter and buffer: equal across ranks iff they agree.

        A sharded (FSDP) tensor is gathered one at a time, so the digest is of the whole model
        (comparable across world sizes) and never holds more than one full tensor: a
        collective on every rank, in the same sorted order."""
        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            full = getattr(t, "full_tensor", None)  # a DTensor shard
            h.update(name.encode())
            h.update((full() if full else t).detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    # -- after a (re)start ------------------------------------------------------------------
    def _apply_start_rng(self) -> None:
        """Each rank gets its own saved streams back when the world size matches the
        checkpoint's (a bit-identical resume); otherwise streams derived from the seed."""
        resume = self.resume_rng
        r, n = self._rank(), self._size()
        if resume is not None and resume.get("world_size") == n:
            rng.restore(resume["streams"][r])
        else:
            rng.seed_all(rng.derived_seed(self._seed, "rank", r, "step", self.step))
        self.resume_rng = None

    def _apply_lr_scaling(self) -> None:
        target = lr_scale_for(self._lr_scaling, self._size())
        if target == self.lr_scale:
            return
        factor = target / self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
        logger.info("learning rate scaled x%g for world size %d (%s)", factor, self._size(),
                 self._lr_scaling)
        self.lr_scale = target

    # -- durable checkpoints ------------------------------------------------------------------
    def checkpoint_state(self, rng_streams: list[dict[str, Any]]) -> dict[str, Any]:
        """A plain dict of the current state; tensors are shared, the caller snapshots them."""
        out: dict[str, Any] = {
            "model": _unwrapped(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        out.update(self.run_state(rng_streams))
        return out

    def run_state(self, rng_streams: list[dict[str, Any]]) -> dict[str, Any]:
        """Everything but the model and optimizer: small, the same on every rank, and so
        saved once by rank 0 even when the model itself is sharded."""
        out: dict[str, Any] = {
            "counters": {"step": self.step, "samples": self.samples, "lr_scale": self.lr_scale},
            "rng": {"world_size": len(rng_streams), "streams": rng_streams},
            "extras": {k: getattr(self, k) for k in self._extra_names},
        }
        if self.sampler is not None:
            out["sampler"] = self.sampler.state_dict()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self._stateful:
            out["components"] = {k: v.state_dict() for k, v in self._stateful.items()}
        return out

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        """Applies a durable checkpoint locally (no collective)."""
        _unwrapped(self.model).load_state_dict(sd["model"])
        load_optimizer_state(self.optimizer, sd["optimizer"])
        self.load_run_state(sd)

    def load_run_state(self, sd: dict[str, Any]) -> None:
        """Applies what :meth:`run_state` saved (no collective)."""
        if self.sampler is not None and "sampler" in sd:
            self.sampler.load_state_dict(sd["sampler"])
        for k, v in sd.get("components", {}).items():
            if k in self._stateful:
                self._stateful[k].load_state_dict(v)
        if self.scheduler is not None and "scheduler" in sd:
            self.scheduler.load_state_dict(sd["scheduler"])
        c = sd["counters"]
        self.step, self.samples, self.lr_scale = int(c["step"]), int(c["samples"]), c["lr_scale"]
        for k, v in sd.get("extras", {}).items():
            if k in self._extra_names:
                setattr(self, k, v)
        self.resume_rng = sd.get("rng")

    def model_state(self) -> dict[str, Any]:
        """The plain model's state dict (what a checkpoint's ``model`` entry must fit)."""
        sd: dict[str, Any] = _unwrapped(self.model).state_dict()
        return sd


def is_stateful(value: Any) -> bool:
    """Has its own state dict (a module, an optimizer, a GradScaler, a sampler)."""
    return (not isinstance(value, torch.Tensor) and callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None)))


def _unwrapped(model: Any) -> Any:
    """DDP prefixes every key with `module.`; checkpoints hold the plain model's keys, so a
    checkpoint written under one launcher loads under another."""
    return getattr(model, "module", model)


class InMemoryState(StateCore):
    """A state whose commit point lives in this process, so that a failure is answered by a
    restore, not a restart (Horovod elastic, the inplace backend). The concrete state provides
    ``save()``, which takes the commit point (not defined here: Horovod's comes from its
    ``TorchState``, which follows this class in the MRO)."""

    _synced_once = False
    save: Callable[[], None]  # an annotation only: Horovod's save() is TorchState's

    def _take_commit(self) -> None:
        """The commit every such state makes: its hooks, the commit point, the event."""
        self._run_hooks(self._before_commit)
        t0 = time.perf_counter()
        self.save()
        self.last_commit_step = self.step
        if self._rank() == 0:
            self.events.emit(ev.COMMIT, seconds=round(time.perf_counter() - t0, 6),
                             **self._commit_fields())

    def _commit_fields(self) -> dict[str, Any]:
        """What a state adds to its `commit` event (a ported Horovod loop: its step unit)."""
        return {}

    def _restored(self, before: int) -> None:
        self.events.emit(ev.RESTORE, from_step=before, to_step=self.step,
                         lost_steps=before - self.step)
        logger.warning("restored the last commit: step %d -> %d", before, self.step)

    def _after_agreement(self) -> None:
        """The end of every sync: the per-rank parts, then everyone's agreed state as the
        commit point, so that a failure before the next commit restores this, not whatever a
        freshly started worker had."""
        if not self._synced_once:
            self._apply_start_rng()
            self._synced_once = True
        self._apply_lr_scaling()
        self.save()
        self._run_hooks(self._after_sync)

    def mark_commit_point(self) -> None:
        """What the first sync spreads and a restore returns to."""
        self.save()

    def mark_fatal(self, error: str) -> None:
        """Rank 0 at start: committed, so the first sync spreads it to every rank, joiners
        included."""
        super().mark_fatal(error)
        self.save()

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        """Applies a durable checkpoint on rank 0 and makes it the commit point; the first
        sync spreads it (no collective here: a worker joining later runs this code too)."""
        super().load_checkpoint_state(sd)
        self.save()
        self.last_commit_step = self.step
