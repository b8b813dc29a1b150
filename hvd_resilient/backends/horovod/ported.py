"""What the Trainer gives a run that a Horovod script ported with three lines must get too.

A script that swapped `hvd.elastic.run` / `hvd.elastic.TorchState` for ours runs its own loop,
so nothing wrote the run's `start` and `done` (the supervisor relaunches only a run that wrote
`start`; the report calls a run without `done` unfinished) and nothing watched its progress (a
hung collective, such as the uneven epochs of a stale `DistributedSampler`, blocked every rank
for ever). `PortedLoop` does for a `@hvd_resilient.run` loop what `Trainer.fit` does around
its own: the `start` event at the first sync, the progress watchdog (progress: each
`optimizer.step()` and each commit), and `done` with the same digests when the loop returns.

The run loop uses it only when no watchdog is installed: the Trainer installs its own, and
writes its own `start`/`done`, before it calls the run loop.

What must happen between `start` and the first sync but lives above this layer (the training
layer's memory tier and durable checkpoints, `training/ported.py`, which resume the state on
rank 0 so that the first sync spreads it) comes in through :func:`extended`: backends never
import the training layer, and `run.py`'s loop stays the one the Trainer uses.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import horovod.torch as hvd

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod import hang_hint
from hvd_resilient.config import SCHEMA, RecoveryOptions
from hvd_resilient.detect import progress
from hvd_resilient.detect.progress import ProgressWatchdog
from hvd_resilient.events import read_recent_events
from hvd_resilient.launcher_env import FORKED_ENV, RUN_ID_ENV

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from hvd_resilient.backends.horovod.state import ElasticState

logger = logging.getLogger(__name__)

FLOOR_ENV = "HVD_RESILIENT_RECOVERY_PROGRESS_FLOOR_SECONDS"
PORTED_FLOOR_S = 120.0
"""The adaptive budget's floor for a loop of the user's own, unless the floor is set: the
Trainer declares its long phases (evaluation, a synchronous checkpoint) as sections with their
own budgets, a ported loop cannot, so a rank that evaluates or saves for a minute between two
forward passes must not be taken for a hung one (the Trainer's 30 s would end it)."""
GRADIENT_WAIT = "the gradient allreduce in optimizer.step()"

_BEGIN_HOOKS: contextvars.ContextVar[tuple[Callable[[PortedLoop], None], ...]] = \
    contextvars.ContextVar("hvd_resilient_ported_begin_hooks", default=())
"""What :meth:`PortedLoop.begin` runs after `start`, set for the duration of one call by
:func:`extended` (a context variable, not a module list: nothing outlives the call that set
it, and a second loop in the process starts clean)."""


@contextlib.contextmanager
def extended(*hooks: Callable[[PortedLoop], None]) -> Iterator[None]:
    """Within the block, a `PortedLoop` that begins calls each hook with itself, after its
    `start` event and before the watchdog and the first sync: where a resume must happen (rank
    0 loads, the sync spreads), and before the watchdog, since a resume from a store may take
    longer than any step."""
    token = _BEGIN_HOOKS.set(_BEGIN_HOOKS.get() + hooks)
    try:
        yield
    finally:
        _BEGIN_HOOKS.reset(token)


def recovery_options(env: Mapping[str, str] | None = None,
                     progress_timeout_s: float | None = None) -> RecoveryOptions:
    """The Trainer's `recovery` settings from the environment (`HVD_RESILIENT_RECOVERY_*`,
    docs/configuration.md), so that one variable tunes a ported loop as it tunes the Trainer;
    ``progress_timeout_s`` (the decorator's argument) wins over the environment. A bad value
    stops with one line naming the variable (`ConfigError`)."""
    values = SCHEMA.read(env=os.environ if env is None else env)
    picked = {k[len("recovery_"):]: v for k, v in values.items() if k.startswith("recovery_")}
    if progress_timeout_s is not None:
        picked["progress_timeout_seconds"] = progress_timeout_s
    return RecoveryOptions(**picked)


def _started_already(path: Path | None) -> bool:
    """Whether this process already wrote a `start` to the run's log (read from its end)."""
    if path is None:
        return False
    pid = os.getpid()
    return any(e["event"] == ev.START and e.get("pid") == pid for e in read_recent_events(path))


def _rank() -> int:
    try:
        return int(hvd.rank())
    except ValueError:  # Horovod is down: a reset in progress
        return -1


class PortedLoop:
    """Events and the progress watchdog around one `@hvd_resilient.run` loop (module doc)."""

    def __init__(self, state: ElasticState, options: RecoveryOptions) -> None:
        self.state = state
        events = state.events
        run_dir = str(events.path.parent) if events.path is not None else os.getcwd()
        self.dog = ProgressWatchdog(
            run_dir=run_dir, rank=_rank, emit=events.emit,
            timeout_s=options.progress_timeout_seconds,
            floor_s=options.progress_floor_seconds if FLOOR_ENV in os.environ
            else max(options.progress_floor_seconds, PORTED_FLOOR_S),
            factor=options.progress_factor, first_step_s=options.first_step_seconds,
            diagnose=hang_hint.diagnose_live)
        self._hooks: list[RemovableHandle] = []
        self.writes_events = True
        """False when the script wrote its own `start` (and so writes its own `done`)."""

    def begin(self) -> PortedLoop:
        """`start` (the Trainer's fields; no config: a ported script has no TrainConfig), the
        watchdog, and the optimizer's step hooks that report progress to it. A script that
        wrote its own `start` (as this project's test and benchmark jobs do, and as the
        migration page's `events=` advice once suggested) is not given a second: two
        `start` lines of one rank seconds apart read as two launches in the report. Such a
        script writes its own `done` too. Then the hooks of :func:`extended` (the training
        layer's resume), before the watchdog and the first sync."""
        events = self.state.events
        self.writes_events = not _started_already(events.path)
        if self.writes_events:
            events.emit(ev.START, pid=os.getpid(), host=socket.gethostname(), backend="horovod",
                        run_id=os.environ.get(RUN_ID_ENV), config=None, loop="custom",
                        warm=os.environ.get(FORKED_ENV) == str(os.getpid()))
        for hook in _BEGIN_HOOKS.get():
            hook(self)
        progress.install(self.dog.start())
        self._hook(self.state.optimizer)
        self._hook_forward(self.state.model)
        self.state.on_sync(self._check_samplers)
        return self

    def _check_samplers(self) -> None:
        """After every sync (a reset formed a new world): a torch `DistributedSampler` still
        built for another world will hang the job at its epoch's end (`hang_hint`); say so
        now, on the rank that holds it, instead of only when the watchdog fires. One scan of
        the heap per reset, never per step."""
        cause = hang_hint.diagnose_live()
        if cause:
            self.state.events.emit(ev.STALE_SAMPLER, cause=cause)
            logger.warning("rank %d: %s", _rank(), cause)

    def _hook(self, optimizer: object) -> None:
        """Progress at each `optimizer.step()`; the step itself waits for the gradient
        allreduce (Horovod's `DistributedOptimizer.step` synchronizes first), so it is a wait
        for peers: a victim of a hung peer gets the longer budget, and the line says so."""
        pre = getattr(optimizer, "register_step_pre_hook", None)
        post = getattr(optimizer, "register_step_post_hook", None)
        if pre is None or post is None:  # not a torch optimizer: commits are the progress
            return
        dog = self.dog

        def before(*_: object) -> None:
            dog.begin_wait(GRADIENT_WAIT)

        def after(*_: object) -> None:
            dog.end_wait()
            dog.step()

        self._hooks = [pre(before), post(after)]

    def _hook_forward(self, model: object) -> None:
        """Progress at each forward pass of the model too: an evaluation inside the loop (no
        optimizer step for minutes) is progress, not a hang. One hook on the root module: a
        call per forward, not per layer."""
        register = getattr(model, "register_forward_hook", None)
        if register is None:
            return
        dog = self.dog
        self._hooks.append(register(lambda *_: dog.step()))

    def done(self) -> None:
        """The loop returned on this rank: `done` with what the Trainer's carries, so that a
        test or an operator compares the ranks' final state the same way."""
        state = self.state
        if not self.writes_events:
            return
        state.events.emit(ev.DONE, epoch=state.epoch, loss=None,
                          params_sha256=state.params_sha256(),
                          digests=None if state.sharded() else state.state_digests(),
                          step_unit=state.step_unit or "commit")

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.dog.stop()
        if progress.installed() is self.dog:
            progress.install(None)
