"""What the trainer needs from a collective backend, and nothing more."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the launcher side imports this package without torch
    import torch
    from torch import nn

    from hvd_resilient.state.protocol import TrainingState

StateT = TypeVar("StateT", bound="TrainingState")
"""The state a backend runs: any `TrainingState`, and the training function gets that same
type back (the trainer's state carries its loss too)."""


class Backend(abc.ABC):
    name: str
    resume_on_every_rank: bool
    """True when every rank reads the durable checkpoint itself (torchrun: all workers start
    together and nothing is in memory); False when rank 0 reads it and a sync spreads it."""
    reduces_in_backward: bool = False
    """True when backward() itself waits for the gradient allreduce (DDP, FSDP); False when
    it only starts it and optimizer.step() waits (Horovod). Tells the progress watchdog where
    a rank waits for its peers."""
    supports_fsdp: bool = False
    """True when the backend can shard the model with FSDP2 (`fsdp=True`): it needs
    torch.distributed's collectives and DTensors (`backends.torchdist`); Horovod only averages
    replicated gradients. `backends.get` refuses ``fsdp`` on a backend without it, before
    anything starts."""
    deterministic: bool = False
    """Reduce gradients in a fixed order and use deterministic local math (docs/
    determinism.md): given to the constructor (`backends.get(..., deterministic=)`, from
    `TrainConfig.deterministic`), never read from the environment."""

    @property
    def joining(self) -> bool:
        """This process is set up but not a member yet (the in-place backend's replacements
        and standbys): it must not take roles from the members, such as the memory tier's
        writer."""
        return False

    numbers_generations = False
    """Whether `generation()` numbers the worlds (in place): the durable checkpoints are then
    fenced by generation too (`checkpoint.fence`)."""

    def generation(self) -> int:
        """This process's world number, where the backend numbers them; else 0."""
        return 0

    coordinator: tuple[str, int] | None = None
    """The address every rank reaches the job's rendezvous at (torchrun: MASTER_ADDR and
    MASTER_PORT, read by `init`); the interface this host reaches it from is the one its
    peers can reach it on. None: the backend does not know one."""

    @abc.abstractmethod
    def init(self, comm: Any | None = None) -> None:
        """Joins the world; ``comm``: an mpi4py communicator to train on (Horovod under
        mpirun), ignored by the other backends."""

    @abc.abstractmethod
    def rank(self) -> int: ...

    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def local_size(self) -> int: ...

    @abc.abstractmethod
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             accumulation: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model and optimizer that average gradients across ranks, once every
        `accumulation` backward passes (`training.recipe` tells DDP/FSDP which ones)."""

    @abc.abstractmethod
    def make_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   **kwargs: Any) -> Any:
        """The backend's training state over the wrapped model and optimizer; ``kwargs``: the
        sampler, the scheduler, the seed and the extras. A `TrainingState` (and a
        `state.core.StateCore`, which the tiers take); typed by each backend, Any here since
        the trainer also reads the extras it passed (``last_loss``) as attributes."""

    @abc.abstractmethod
    def run(self, fn: Callable[[StateT], None], state: StateT) -> None:
        """Runs the training function, recovering in memory where the backend can."""

    @abc.abstractmethod
    def allgather_object(self, obj: object) -> list[Any]:
        """Every rank's ``obj`` (picklable), by rank (a collective)."""

    @abc.abstractmethod
    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (a collective)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases the process group; a no-op where the launcher owns it."""
