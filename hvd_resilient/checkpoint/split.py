"""One training state as raw tensor bytes in parts, so that a save needs no serialization and a
restore no deserialization, and parts verify while later ones still download.

Layout (format ``hvd_resilient.split/2``):

- ``state-00000.bin``, ``state-00001.bin``, ...: the bytes of consecutive tensors, each at a
  64-byte aligned offset, up to about :data:`PART_BYTES` per part. A part never mixes sections
  (top-level containers: ``model``, ``optimizer``, ...): restored tensors are views of their
  part's buffer, and a part that held both model and optimizer tensors would keep the model's
  bytes alive after ``load_state_dict`` copied them into the parameters.
- ``state-index.pt``: a small ``torch.save`` (loaded with ``weights_only=True``) of the state with
  every tensor replaced by ``None``, and for each tensor its part, offset, size, dtype and shape.
  Tensors sharing memory (tied weights) share one slot. Tensors that are not plain dense CPU-able
  arrays (sparse, quantized) stay inside the index as they are.

Why raw bytes: ``torch.save`` of 1 GB costs ~1.1 s on the writer thread and ``torch.load`` copies
every byte into fresh memory again; here :func:`split_state` copies each tensor once, inside the
step, into buffers the upload reads from directly, and :func:`join_state` makes tensors over the
downloaded buffers without copying. No pickle is involved for the bulk of the bytes, and every
byte is checked against its manifest digest before any of it is used.

Older layouts still load: ``hvd_resilient.split/1`` (``state-00000.pt`` parts, each a
``torch.save``) and the single-file ``state.pt``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hvd_resilient.checkpoint.host_buffers import HostBuffer, pool
from hvd_resilient.checkpoint.serialize import alias_key, from_bytes
from hvd_resilient.checkpoint.tree import map_leaves

#: The single-file layout of older checkpoints (still what :func:`join_state` accepts).
LEGACY_FILE = "state.pt"
INDEX_FILE = "state-index.pt"
INDEX_FORMAT = "hvd_resilient.split/2"
_V1_FORMAT = "hvd_resilient.split/1"
PART_SUFFIX = ".bin"
#: Target size of one part: big enough that per-file requests are noise, small enough that
#: hashing overlaps most of the download and a restore has several files in flight.
PART_BYTES = 64 << 20
ALIGN = 64


def part_name(i: int) -> str:
    """The file name of part ``i``: zero-padded so names sort like numbers."""
    return f"state-{i:05d}{PART_SUFFIX}"


def _v1_part_name(i: int) -> str:
    return f"state-{i:05d}.pt"


def _is_raw(t: Any) -> bool:
    import torch

    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and not t.is_quantized and t.device.type != "meta")


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{INDEX_FILE} names an unknown dtype {name!r}")
    return dtype


class SnapshotBuffers(Protocol):
    """Where :func:`split_state` copies a snapshot's parts, and all it needs of it: the
    process-wide `HostBufferPool`, or the memory tier's slices of one mapped segment file
    (`checkpoint.memory.segments`)."""

    def take(self, sizes: list[int]) -> Sequence[HostBuffer | memoryview]:
        """One writable buffer of each size in ``sizes``, in order."""


@dataclass
class _Layout:
    """Where every tensor of a state goes, before anything is copied."""

    tree: Any
    refs: list[tuple[tuple[Any, ...], int]] = field(default_factory=list)  # key path -> slot
    slots: list[tuple[int, int, int, str, tuple[int, ...]]] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)  # the tensor of each slot
    sizes: list[int] = field(default_factory=list)  # bytes per part


def _layout(state: Mapping[str, Any], part_bytes: int) -> _Layout:
    import torch

    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    out = _Layout(tree=None)
    by_alias: dict[Any, int] = {}
    part_top: list[Any] = []

    def place(nbytes: int, top: Any) -> tuple[int, int]:
        sizes = out.sizes
        offset = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0
        if not sizes or part_top[-1] != top or (sizes[-1] and offset + nbytes > part_bytes):
            sizes.append(0)
            part_top.append(top)
            offset = 0
        sizes[-1] = offset + nbytes
        return len(sizes) - 1, offset

    def strip(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            if not _is_raw(obj):
                return obj.detach().to("cpu", copy=True)
            key = alias_key(obj)
            slot = by_alias.get(key)
            if slot is None:
                nbytes = obj.numel() * obj.element_size()
                # sections (model, optimizer, ...) are containers; a flat dict has none
                part, offset = place(nbytes, path[0] if len(path) > 1 else None)
                slot = by_alias[key] = len(out.slots)
                out.slots.append((part, offset, nbytes, str(obj.dtype).removeprefix("torch."),
                                  tuple(obj.shape)))
                out.sources.append(obj)
            out.refs.append((path, slot))
            return None
        if obj is None or isinstance(obj, int | float | str | bool | bytes):
            return obj
        return copy.deepcopy(obj)

    out.tree = map_leaves(state, strip)
    return out


def split_state(state: Mapping[str, Any], part_bytes: int = PART_BYTES,
                buffers: SnapshotBuffers | None = None) -> dict[str, Any]:
    """A snapshot of ``state`` as ``{file name: object}`` for
    :meth:`AsyncCheckpointWriter.submit`: parts are byte buffers (stored as they are), the
    index a small object (``torch.save``-d by the writer).

    This is the copy that runs inside the training step: every tensor is copied once into part
    buffers taken from ``buffers`` (the process-wide pool by default, so the second and later
    checkpoints copy into memory already touched); other leaves are deep-copied. Training may
    change ``state`` as soon as this returns.

    Raises:
        ValueError: ``part_bytes`` < 1.
    """
    import torch

    lay = _layout(state, part_bytes)
    bufs = (buffers or pool()).take(lay.sizes)
    views = [memoryview(b) for b in bufs]
    end = [0] * len(bufs)
    for (part, offset, nbytes, _, _), src in zip(lay.slots, lay.sources, strict=True):
        view = views[part]
        view[end[part]:offset] = bytes(offset - end[part])  # padding: no stale bytes in files
        end[part] = offset + nbytes
        if nbytes:
            dst = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
            dst.view(src.dtype).view(src.shape).copy_(src.detach())
    files: dict[str, Any] = {part_name(i): v for i, v in enumerate(views)}
    files[INDEX_FILE] = {"format": INDEX_FORMAT, "tree": lay.tree, "refs": lay.refs,
                         "slots": lay.slots, "parts": len(lay.sizes)}
    return files


def warm_buffers(state: Mapping[str, Any], part_bytes: int = PART_BYTES,
                 buffers: SnapshotBuffers | None = None) -> int:
    """Fault in, off the training step, the buffers a snapshot of ``state`` will take, and
    leave them in the pool; returns their bytes.

    Only the first checkpoint of a process copies into fresh memory (~0.5 s per GB here, ~10x
    the copy into touched memory); warming on a background thread once the optimizer has its
    state moves that cost out of the step. Reads only shapes and dtypes of ``state``.
    """
    import torch

    sizes = _layout(state, part_bytes).sizes
    for b in (buffers or pool()).take(sizes):
        if len(b):
            torch.frombuffer(b, dtype=torch.uint8)[::4096].fill_(0)  # one write per page
    return sum(sizes)


def decode_file(name: str, data: Any) -> Any:
    """The ``decode`` for :meth:`CheckpointReader.load`, run on each file once its digest
    matched: a raw part stays the downloaded buffer itself (which tells the loader never to
    recycle it: its tensors will be views of it), any other file is
    ``torch.load(weights_only=True)``-ed while later files download."""
    return data if name.endswith(PART_SUFFIX) else from_bytes(data)


def join_state(files: Mapping[str, Any]) -> Any:
    """The state from loaded files: index + parts rebuilt, or a legacy ``state.pt`` as is.

    Tensors of raw parts are views of the parts' buffers (no copy); tensors of one slot (tied
    weights) are one tensor again.

    Raises:
        ValueError: the layout is incomplete or inconsistent (one line naming what).
    """
    if INDEX_FILE not in files:
        if LEGACY_FILE in files:
            return files[LEGACY_FILE]
        raise ValueError(f"checkpoint holds neither {LEGACY_FILE} nor {INDEX_FILE}")
    index = files[INDEX_FILE]
    fmt = index.get("format") if isinstance(index, dict) else None
    if fmt == _V1_FORMAT:
        return _join_v1(files, index)
    if fmt != INDEX_FORMAT:
        raise ValueError(f"{INDEX_FILE} is in format {fmt!r}, expected {INDEX_FORMAT!r}")
    parts = []
    for i in range(index["parts"]):
        if part_name(i) not in files:
            raise ValueError(f"checkpoint lacks {part_name(i)} of {index['parts']} parts")
        view = memoryview(files[part_name(i)]).cast("B")
        parts.append(memoryview(bytearray(view)) if view.readonly else view)
    tensors = [_slot_tensor(parts, slot) for slot in index["slots"]]
    by_path = {tuple(path): tensors[slot] for path, slot in index["refs"]}
    return map_leaves(index["tree"], lambda obj, path: by_path.get(path, obj))


def _slot_tensor(parts: list[memoryview], slot: tuple[Any, ...]) -> Any:
    import torch

    part, offset, nbytes, dtype_name, shape = slot
    dtype = _dtype(dtype_name)
    if not 0 <= part < len(parts):
        raise ValueError(f"{INDEX_FILE} points at part {part} of {len(parts)}")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != expected or offset < 0 or offset + nbytes > len(parts[part]):
        raise ValueError(f"{INDEX_FILE} slot {slot} does not fit {part_name(part)} "
                         f"({len(parts[part])} bytes)")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(parts[part], dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def _join_v1(files: Mapping[str, Any], index: dict[str, Any]) -> Any:
    """``hvd_resilient.split/1``: parts were ``torch.save``-d ``{tensor number: tensor}``."""
    tensors: dict[int, Any] = {}
    for i in range(index["parts"]):
        if _v1_part_name(i) not in files:
            raise ValueError(f"checkpoint lacks {_v1_part_name(i)} of {index['parts']} parts")
        tensors.update(files[_v1_part_name(i)])
    if len(tensors) != len(index["paths"]):
        raise ValueError(f"parts hold {len(tensors)} tensors, index lists {len(index['paths'])}")
    by_path = {tuple(p): tensors[j] for j, p in enumerate(index["paths"])}
    return map_leaves(index["tree"], lambda obj, path: by_path.get(path, obj))
