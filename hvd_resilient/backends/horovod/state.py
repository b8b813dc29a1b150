"""Everything that must survive a failure, on top of `hvd.elastic.TorchState`.

TorchState already commits the model and optimizer. It does not know LR schedulers, an
exact-once sampler, counters, a GradScaler or every rank's random streams, and its sync moved
a newcomer's parameters after broadcasting them (`broadcast_optimizer_state` runs a zero-grad
`step()`: AdamW's weight decay). Here every component has a handler with save/restore, the
sync is `state.agreement.agree` (rank 0's values, sent as they are, then proven equal by
digest), and what a durable checkpoint holds is one plain dict (`checkpoint_state`), loadable
with `torch.load(weights_only=True)`.

The signature is TorchState's: ``ElasticState(model, optimizer, batch=0, epoch=0)`` works as
in Horovod's documentation, the sampler (ours, or Horovod's `ElasticSampler`) is optional.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.elastic.state import StateHandler, TorchState

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod.added_hosts import AddedHostsHold
from hvd_resilient.backends.horovod.collectives import HorovodCollectives
from hvd_resilient.detect import progress
from hvd_resilient.events import EventLog
from hvd_resilient.launcher_env import RUN_DIR_ENV
from hvd_resilient.state.commits import Commit, RngCommit, commit_for
from hvd_resilient.state.core import InMemoryState, is_stateful


class _Slot(StateHandler):  # type: ignore[misc]  # Horovod ships no types
    """One of TorchState's handler slots, holding a backend-neutral commit (state/commits.py:
    GIL-free copies, restores from a copy); the sync is the state's (`agree`), never the
    handler's."""

    def __init__(self, commit: Commit) -> None:
        super().__init__(commit.value)
        self.commit = commit

    def save(self) -> None:
        self.commit.save()

    def restore(self) -> None:
        self.commit.restore()

    def set_value(self, value: Any) -> None:  # `state.model = other` (TorchState.__setattr__)
        self.value = self.commit.value = value
        self.save()

    def sync(self) -> None:
        raise AssertionError("ElasticState.sync sends every component itself")


class ElasticState(InMemoryState, TorchState):  # type: ignore[misc]  # as above
    """State of one elastic training run: model, optimizer, scheduler, sampler, counters, RNG.

    `step` and `samples` count optimizer steps and samples over the whole run; the epoch and the
    position inside it live in the sampler, unless the script passes ``epoch=`` and keeps its
    own (Horovod's idiom). Extra keyword arguments are committed, restored, synced and
    checkpointed: objects with a state dict (a GradScaler, an EMA model) as components, the
    rest as plain attributes (ints, floats, strings, tensors: what a checkpoint can carry).
    The sampler is optional; without this library's `ElasticDataSampler` exact-once data is
    not in force (:attr:`exact_once`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sampler: Any | None = None,
        scheduler: Any | None = None,
        seed: int = 0,
        lr_scaling: str = "none",
        events: EventLog | None = None,
        host_check_every: int = 1,
        hold_additions: bool = False,
        **extras: Any,
    ) -> None:
        if events is None:
            events = default_event_log()
        self._init_core(seed=seed, lr_scaling=lr_scaling, events=events, extras=extras)
        self.step_unit: str | None = None
        """What `step` counts: "step" once the script advanced `state.step` itself (the
        Trainer does), "commit" when it commits without ever touching it (a Horovod script
        ported as is: each commit then advances `step` by one, so that events, restores and
        the report count something), None before the first commit tells which."""
        self._auto_step = 0  # the step this state last set itself (commit counting)
        if host_check_every < 0:
            raise ValueError(f"host_check_every must be >= 0 (0 turns the check off), "
                             f"got {host_check_every}")
        self._host_check_every = host_check_every if is_elastic() else 0
        self._host_ask: int | None = None  # the broadcast handle of the last host check
        plain = {k: v for k, v in extras.items() if k not in self._stateful}
        super().__init__(
            model=model, optimizer=optimizer, step=0, samples=0, lr_scale=1.0,
            resume_rng=None, ckpt_requested=-1, ckpt_published=-1, fatal="", **plain,
        )
        for name in ("model", "optimizer"):  # Horovod's handlers deep-copy under the GIL
            self._handlers[name] = _Slot(commit_for(name, self._handlers[name].value))
        stateful = {"sampler": sampler, "scheduler": scheduler, **self._stateful}
        for name, obj in stateful.items():
            if obj is not None and not is_stateful(obj):
                raise TypeError(f"ElasticState: {name} must have state_dict() and "
                                f"load_state_dict(), got {type(obj).__name__}")
            if obj is not None:
                self._handlers[name] = _Slot(commit_for(name, obj))
            object.__setattr__(self, name, obj)
        self._handlers["rng"] = _Slot(RngCommit())
        self._collectives = HorovodCollectives()
        self.register_reset_callbacks([self._forget_host_ask])
        reset = getattr(sampler, "reset", None)
        if callable(reset):
            self.on_sync(reset)  # re-partition for the world the sync just formed
        self._added_hold = AddedHostsHold() if hold_additions else None
        """``hold_additions``: rank 0 holds an added host's reset until the driver's standby
        workers are warm (`added_hosts.py`), so the others train through the newcomers' cold
        start. Off by default: a script written for Horovod may count on the reset at the
        next commit after the notice (Horovod's own elastic scenarios do); the Trainer turns
        it on."""

    def _rank(self) -> int:
        return int(hvd.rank())

    def _size(self) -> int:
        return int(hvd.size())

    # -- the elastic protocol -------------------------------------------------------------
    def commit(self) -> None:
        self._count_commit()
        self._take_commit()
        with progress.waiting("the host check in state.commit() (a broadcast from rank 0)"):
            self.check_host_updates()
        progress.made()

    def _count_commit(self) -> None:
        """Decides (once) what `step` counts (:attr:`step_unit`), and counts this commit when
        the script does not count steps itself. Every rank commits at the same point, so every
        rank counts the same."""
        if self.step_unit is None:
            self.step_unit = "commit" if self.step == self._auto_step else "step"
        if self.step_unit == "commit":
            self.step += 1
            self._auto_step = self.step

    def _commit_fields(self) -> dict[str, Any]:
        """The step unit on the `commit` event when steps are commits (the report then says
        what its step counts mean)."""
        return {"step_unit": "commit"} if self.step_unit == "commit" else {}

    def check_host_updates(self) -> None:
        """Horovod's, except that rank 0 keeps an addition whose standbys are still warming
        to itself until they are warm (`added_hosts.py`): it broadcasts "no change" meanwhile,
        so every rank trains on and all reset together at a later commit."""
        held = self._hold_additions()
        try:
            super().check_host_updates()
        finally:
            for message in held:
                self._host_messages.put(message)

    def _hold_additions(self) -> list[Any]:
        """Rank 0: the pending host messages, taken out of the queue while they are to be
        held ([] otherwise, the queue untouched)."""
        if hvd.rank() != 0 or self._host_messages.empty() or not self._holding():
            return []
        held = []
        while not self._host_messages.empty():
            held.append(self._host_messages.get_nowait())
        return held

    def _holding(self) -> bool:
        """Rank 0: whether the pending host messages are held (a look: the queue untouched)."""
        hold = self._added_hold
        if hold is None:
            return False
        with self._host_messages.mutex:
            updates = [update for _, update in self._host_messages.queue]
        holding = hold.holding(updates)
        if hold.held_s is not None:
            self.events.emit(ev.STANDBY_WAIT, seconds=round(hold.held_s, 3))
            hold.held_s = None
        return holding

    def host_change_pending(self) -> bool:
        """True on every rank when discovery changed the hosts: commit now, and the reset
        follows. Call it on every rank at each step that is not a commit anyway::

            if state.step % commit_every == 0 or state.host_change_pending():
                state.commit()

        Discovery tells only rank 0, and Horovod acts at the next commit, up to a whole commit
        interval later, while a leaving host keeps training and a new one waits. Asking costs
        one one-element broadcast per step (every `host_check_every` steps), answered one ask
        later: rank 0's answer travels while the next step trains, so no step waits for it
        (waited for, it cost the tiny GPT of bench/goodput.py 6-8% of its step rate on two
        shared cores: the ranks spin in the wait). A scale change then costs two steps and
        loses nothing.
        """
        every = self._host_check_every
        if not every or self.step % every:
            return False
        asked, self._host_ask = self._host_ask, None
        if asked is not None and hvd.synchronize(asked).item():
            return True  # no new ask: the commit resets, and a reset forgets what was asked
        flag = torch.zeros(1, dtype=torch.int32)
        if hvd.rank() == 0 and not self._host_messages.empty():
            flag.fill_(0 if self._holding() else 1)
        self._host_ask = hvd.broadcast_async_(flag, root_rank=0,
                                              name="hvd_resilient.hosts_pending")
        return False

    def _forget_host_ask(self) -> None:
        """A reset: Horovod was shut down and started again, and the ask in flight with it."""
        self._host_ask = None

    def restore(self) -> None:
        before = self.step
        super().restore()
        self._auto_step = self.step
        self._restored(before)

    def sync(self) -> None:
        """Rank 0's committed plain attributes (Horovod's semantics), then every component
        agreed and proven equal (`state.agreement`); an event says what was sent."""
        self.sync_with(None)

    def sync_with(self, rider: Any, on_riders: Callable[[list[Any]], None] | None = None,
                  ) -> None:
        """`sync()`, whose first collective also carries ``rider`` (the run loop's detector
        offers: a (re)start then costs one allgather fewer); ``on_riders`` gets every rank's,
        by rank, before any component is sent. Rank 0's committed attributes travel in the
        same allgather, where Horovod's `ObjectState.sync` broadcast them on their own."""
        committed = self._saved_state if hvd.rank() == 0 else None  # type: ignore[has-type]

        def gathered(riders: list[Any]) -> None:
            saved = riders[0][0]
            if saved:  # ObjectState.sync: every rank takes rank 0's committed attributes
                self._saved_state = saved
                self._set_attrs()
            if on_riders is not None:
                on_riders([r for _, r in riders])

        self._agree(self._collectives, rider=(committed, rider), on_riders=gathered)
        self._auto_step = self.step  # rank 0's count (a newcomer's, a resumed checkpoint's)
        self._after_agreement()

    def after_reset(self, fn: Callable[[], None]) -> None:
        """Horovod's reset callbacks (`on_reset()` is Horovod's own: it runs them)."""
        self.register_reset_callbacks([fn])


def default_event_log(env: Mapping[str, str] | None = None) -> EventLog:
    """The run folder's `events.jsonl` when the launcher named one, else a log that writes
    nothing. A ported Horovod script passes no ``events=``; without this it wrote no events,
    so the supervisor never relaunched it and `hvd-resilient report` had nothing to read."""
    run_dir = (os.environ if env is None else env).get(RUN_DIR_ENV, "")
    if not run_dir:
        return EventLog(None)
    return EventLog(os.path.join(run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)


def is_elastic() -> bool:
    """True inside a worker started by `horovodrun` in elastic mode."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"
