"""One training state as several files, so that a restore can ``torch.load`` the first files
while later ones are still downloading.

A single ``state.pt`` can only be deserialized once its last byte has arrived and been
hashed; on a store that delivers ~600 MB/s that serializes ~1.5 s of download, ~0.9 s of
sha256 and ~0.7 s of ``torch.load`` per GB. Split into parts of about
:data:`PART_BYTES`, each part is verified and loaded while the next ones download.

Layout (every file a plain ``torch.save``, loaded with ``weights_only=True``):

- ``state-00000.pt``, ``state-00001.pt``, ...: ``{tensor number: tensor}``, consecutive
  tensors up to about ``PART_BYTES`` each; tensors sharing memory (tied weights) stay in
  one part, so they are still shared after loading;
- ``state-index.pt``: the state with every tensor replaced by ``None``, the key path of each
  tensor, and the number of parts.

Checkpoints written before the split hold one ``state.pt``; :func:`join_state` loads both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hvd_resilient.checkpoint.serialize import from_bytes, map_leaves

#: The single-file layout of older checkpoints (still what :func:`join_state` accepts).
LEGACY_FILE = "state.pt"
INDEX_FILE = "state-index.pt"
INDEX_FORMAT = "hvd_resilient.split/1"
#: Target size of one part: big enough that per-file requests are noise, small enough that
#: loading overlaps most of the download and at most a few parts are in memory twice.
PART_BYTES = 64 << 20


def part_name(i: int) -> str:
    """The file name of part ``i``: zero-padded so names sort like numbers."""
    return f"state-{i:05d}.pt"


def _storage_key(t: Any) -> Any:
    try:
        return t.untyped_storage().data_ptr() or id(t)  # 0: empty, nothing to share
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return id(t)


def split_state(state: Any, part_bytes: int = PART_BYTES) -> dict[str, Any]:
    """``{file name: object}`` for :meth:`AsyncCheckpointWriter.submit`: the index and parts.

    Raises:
        ValueError: ``part_bytes`` < 1.
    """
    import torch

    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    tensors: list[torch.Tensor] = []
    paths: list[tuple[Any, ...]] = []

    def strip(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            paths.append(path)
            return None
        return obj

    tree = map_leaves(state, strip)
    parts: list[dict[int, torch.Tensor]] = []
    home: dict[Any, int] = {}  # storage -> the part that holds it
    filled = 0
    for j, t in enumerate(tensors):
        key = _storage_key(t)
        if key in home:
            parts[home[key]][j] = t
            continue
        nbytes = t.untyped_storage().nbytes() if t.layout == torch.strided else 0
        if not parts or (parts[-1] and filled + nbytes > part_bytes):
            parts.append({})
            filled = 0
        parts[-1][j] = t
        filled += nbytes
        home[key] = len(parts) - 1
    files: dict[str, Any] = {part_name(i): p for i, p in enumerate(parts)}
    files[INDEX_FILE] = {"format": INDEX_FORMAT, "tree": tree, "paths": paths,
                         "parts": len(parts)}
    return files


def decode_file(name: str, data: bytearray) -> Any:
    """The ``decode`` for :meth:`CheckpointManager.load`: ``torch.load(weights_only=True)`` of
    each verified file as it arrives, so parts deserialize while later ones download."""
    return from_bytes(data)


def join_state(files: Mapping[str, Any]) -> Any:
    """The state from loaded files: a legacy ``state.pt`` as is, or index + parts rebuilt.

    Raises:
        ValueError: neither layout is complete (one line naming what is missing).
    """
    if INDEX_FILE not in files:
        if LEGACY_FILE in files:
            return files[LEGACY_FILE]
        raise ValueError(f"checkpoint holds neither {LEGACY_FILE} nor {INDEX_FILE}")
    index = files[INDEX_FILE]
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise ValueError(f"{INDEX_FILE} is not in format {INDEX_FORMAT!r}")
    tensors: dict[int, Any] = {}
    for i in range(index["parts"]):
        if part_name(i) not in files:
            raise ValueError(f"checkpoint lacks {part_name(i)} of {index['parts']} parts")
        tensors.update(files[part_name(i)])
    if len(tensors) != len(index["paths"]):
        raise ValueError(f"parts hold {len(tensors)} tensors, index lists {len(index['paths'])}")
    by_path = {tuple(p): tensors[j] for j, p in enumerate(index["paths"])}
    return map_leaves(index["tree"], lambda obj, path: by_path.get(path, obj))
