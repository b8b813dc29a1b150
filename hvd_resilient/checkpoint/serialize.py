"""Turning training state into checkpoint bytes and back.

The split matters for stalls: :func:`snapshot_state_dict` is the only part that runs inside
the training step (a memory copy, tens of ms per 100 MB); serialization and upload of the
snapshot happen on the writer's background thread. Loading uses ``weights_only=True`` so a
tampered checkpoint cannot run code.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Iterable, Mapping
from typing import IO, Any, NamedTuple, TypeVar, cast

from hvd_resilient.checkpoint.tree import map_leaves

__all__ = [  # map_leaves: its home is checkpoint.tree; still importable from here
    "BufferReader", "CheckpointMismatchError", "TensorSpec", "alias_key", "check_state_dict",
    "check_state_dict_keys", "from_bytes", "map_leaves", "snapshot_state_dict", "to_buffer",
    "to_bytes",
]

T = TypeVar("T")


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: other names, shapes or dtypes. One line."""


def to_buffer(obj: Any) -> memoryview:
    """``torch.save(obj)`` into memory, returned without the final copy ``getvalue`` makes."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def to_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` into a ``bytes`` object."""
    return bytes(to_buffer(obj))


class BufferReader(io.RawIOBase):
    """A read-only, seekable file over a buffer, for ``torch.load``.

    ``io.BytesIO(bytearray)`` copies its whole argument first (only ``bytes`` is shared), so
    loading a downloaded 1 GB ``bytearray`` through it costs a second 1 GB copy. torch's reader
    calls ``readinto`` with the destination tensor's memory, so this copies each byte once.
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def from_bytes(data: bytes | bytearray | memoryview, *, weights_only: bool = True) -> Any:
    """Load what :func:`to_bytes` stored, onto the CPU, copying each byte once.

    ``weights_only=True`` (the default) only unpickles tensors, containers and plain values;
    state holding other types (e.g. NumPy RNG states) must be stored in another form or
    loaded with ``weights_only=False`` from a trusted location.

    Raises:
        pickle.UnpicklingError / RuntimeError: from ``torch.load`` on bad or disallowed data.
    """
    import torch

    # torch's stub wants IO[bytes]; a RawIOBase with readinto/seek is what its reader uses.
    reader = cast(IO[bytes], BufferReader(data))
    return torch.load(reader, weights_only=weights_only, map_location="cpu")


def snapshot_state_dict(sd: T) -> T:
    """A copy of ``sd`` whose tensors are detached CPU clones, safe to serialize on another
    thread while training keeps mutating the originals.

    Nested dicts/lists/tuples (optimizer state) are rebuilt, a tensor that appears twice (tied
    weights) is copied once and stays shared, ``OrderedDict._metadata`` (module versions that
    ``load_state_dict`` reads) is kept, and other leaves are deep-copied.
    """
    import torch

    memo: dict[Any, Any] = {}

    def snap(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            key = alias_key(obj)
            found = memo.get(key)
            if found is None:
                found = memo[key] = obj.detach().to("cpu", copy=True)
            return found
        if obj is None or isinstance(obj, int | float | str | bool | bytes):
            return obj
        return copy.deepcopy(obj)

    return map_leaves(sd, snap)


def alias_key(t: Any) -> Any:
    """Same key for tensors that are the same view of the same memory.

    ``state_dict()`` returns a fresh ``detach()``-ed tensor object per entry, so tied weights
    arrive as different objects over one storage; keying on the memory keeps them tied.
    """
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                tuple(t.stride()), t.dtype, t.device)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return id(t)


class TensorSpec(NamedTuple):
    """What a checkpoint says about a tensor without holding it: its full shape and dtype
    (from DCP metadata, say). :func:`check_state_dict` takes these and real tensors alike."""

    shape: tuple[int, ...]
    dtype: Any


def _spec(v: Any) -> tuple[list[int], str] | None:
    """(full shape, dtype name) of a tensor-like value (a tensor, a DTensor: its global
    shape, a :class:`TensorSpec`), ``None`` for anything else (extra state, numbers)."""
    shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
    if shape is None or dtype is None:
        return None
    try:
        dims = [int(d) for d in shape]
    except (TypeError, ValueError):
        return None
    return dims, str(dtype).removeprefix("torch.")


def _differs(name: str, saved: Any, mine: Any) -> str:
    """How entry ``name`` differs between the checkpoint and the model ("" if it does not)."""
    a, b = _spec(saved), _spec(mine)
    if a is None or b is None or a == b:
        return ""
    if a[0] == b[0]:
        return f"{name} is {a[1]} in the checkpoint, {b[1]} in the model"
    if a[1] == b[1]:
        return f"{name} is {a[0]} in the checkpoint, {b[0]} in the model"
    return f"{name} is {a[0]} {a[1]} in the checkpoint, {b[0]} {b[1]} in the model"


def check_state_dict(
    expected: Mapping[str, Any],
    loaded: Mapping[str, Any],
    what: str = "model",
    limit: int = 3,
) -> None:
    """Fail with ONE line unless the checkpoint's state dict ``loaded`` fits ``expected``
    (the model's own ``state_dict()``): the same names, and for every tensor the same full
    shape and dtype. Values that are not tensors are compared by name only.

    The first ``limit`` differences are named, in the model's order (then the checkpoint's
    extra entries), and the rest counted.

    Raises:
        CheckpointMismatchError: e.g. ``model does not fit the checkpoint: 0.weight is [32, 64]
            in the checkpoint, [48, 64] in the model; 0.bias is [32] in the checkpoint, [48] in
            the model; ... (2 more)``.
    """
    problems: list[str] = []
    for name, mine in expected.items():
        if name not in loaded:
            problems.append(f"{name} is missing from the checkpoint")
        else:
            problem = _differs(str(name), loaded[name], mine)
            if problem:
                problems.append(problem)
    problems += [f"{name} is in the checkpoint but not in the model"
                 for name in loaded if name not in expected]
    if not problems:
        return
    shown = "; ".join(problems[:limit])
    more = f"; ... ({len(problems) - limit} more)" if len(problems) > limit else ""
    raise CheckpointMismatchError(f"{what} does not fit the checkpoint: {shown}{more}")


def check_state_dict_keys(
    expected_keys: Iterable[str],
    loaded_keys: Iterable[str],
    what: str = "model",
    limit: int = 3,
) -> None:
    """The names-only form of :func:`check_state_dict` (kept for old callers: it cannot see
    shapes or dtypes; pass state dicts to :func:`check_state_dict` instead).

    Raises:
        CheckpointMismatchError: one line, as :func:`check_state_dict`.
    """
    check_state_dict(dict.fromkeys(sorted(map(str, expected_keys))),
                     dict.fromkeys(sorted(map(str, loaded_keys))), what, limit)
