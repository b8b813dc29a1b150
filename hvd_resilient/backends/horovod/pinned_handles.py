"""Horovod's background loop must never need the GIL while it holds its own locks.

Found in the random-kill benchmark (1 run in 20, the job never recovered) and reproduced at
will: when a peer dies, Horovod's background loop leaves with an exception and finalizes
(`ProcessSetTable::Finalize_`, under the process-set table's mutex), destroying the tensors of
every operation still queued. Since torch reworked its PyObject preservation (pytorch#167564,
late 2025; torch 2.13 here), dropping the last C++ reference to a tensor that has a Python
object takes the GIL (`TensorImpl::decref_pyobject`). Meanwhile the main
thread, holding the GIL, enqueues the next gradient from a backward hook
(`EnqueueTensorAllreduces` takes the same table mutex before it checks for shutdown): each
waits for the other, for ever. Every Python thread of the process stops with them (the hang-up
watch, the heartbeats, the stuck-call deadline), so nothing in the process can end it, the
driver waits in its barrier for a worker that never arrives, and the job stalls until someone
kills it. Horovod 0.28.1 predates that torch; the deadlock is upstream's, reachable by any
Horovod job on a current torch.

The cure is to keep one more C++ reference to every tensor Horovod holds, for as long as it may
hold it: Horovod's own handle map (`mpi_ops._handle_map`, handle -> the op's tensors, kept
until `synchronize`) is replaced by one that also keeps a view of each tensor (a view holds
its base by a C++ reference). Horovod's drops then never take a tensor to its last C++
reference, so its loop never waits for the GIL. A view costs about a microsecond per
operation. The references of an operation that failed are kept until the next `hvd.init()`,
after `hvd.shutdown()` has joined the loop that may still be dropping its tensors.

What is left: the pin is made just after Horovod's enqueue returns the handle. A loop that
starts finalizing in those microseconds can reach that one unpinned tensor and wait for the
GIL; it gets it as soon as the main thread releases it (any torch op, the autograd engine
between two hooks), and deadlocks only if the main thread's very next call is another enqueue
with no release in between (a tight Python loop of `*_async` calls).
"""

from __future__ import annotations

from typing import Any

import torch

from hvd_resilient.backends.horovod import compat


class PinningHandles(dict):  # type: ignore[type-arg]
    """Horovod's handle map, plus a C++ reference to every tensor of each pending operation."""

    def __init__(self, existing: dict[Any, Any] | None = None) -> None:
        super().__init__()
        self._pins: dict[Any, list[torch.Tensor]] = {}
        self._retired: list[list[torch.Tensor]] = []
        for handle, value in (existing or {}).items():
            self[handle] = value

    def __setitem__(self, handle: Any, value: Any) -> None:
        # an in-place operation names its tensor twice (input and output): one pin is enough
        distinct = {id(t): t for t in _tensors(value)}.values()
        self._pins[handle] = [p for t in distinct if (p := _pin(t)) is not None]
        super().__setitem__(handle, value)

    def pop(self, handle: Any, *default: Any) -> Any:
        pins = self._pins.pop(handle, None)
        if default and pins:
            # Horovod's failure path (`synchronize`: pop(handle, None)): its loop may still be
            # finalizing this operation, so its tensors stay pinned until the next init.
            self._retired.append(pins)
        return super().pop(handle, *default)

    def __delitem__(self, handle: Any) -> None:
        self._pins.pop(handle, None)
        super().__delitem__(handle)

    def clear(self) -> None:
        self._pins.clear()
        super().clear()


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of one handle-map value: a tensor, or tuples/lists of them (and of None,
    split sizes, nested output tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _pin(tensor: torch.Tensor) -> torch.Tensor | None:
    """A view of `tensor`, which holds it by a C++ reference; None where no view can be made
    (sparse and other layouts without views: left as Horovod holds them)."""
    try:
        return tensor.view_as(tensor)
    except RuntimeError:
        return None


def install() -> None:
    """After every `hvd.init()` (which makes a new plain map): idempotent and cheap."""
    from horovod.torch import mpi_ops

    current = mpi_ops._handle_map
    if not isinstance(current, PinningHandles):
        compat.replace(mpi_ops, "_handle_map", PinningHandles(current))
