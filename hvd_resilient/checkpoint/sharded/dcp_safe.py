"""Reading `torch.distributed.checkpoint` folders without running code from them.

DCP unpickles its ``.metadata`` with plain ``pickle.load`` and its non-tensor items (optimizer
hyperparameters, counters) with ``torch.load(weights_only=False)``: a checkpoint folder someone
could write to could then run code in every rank that resumes from it. The checksums in our
manifest catch accidental damage, not a writer who also rewrites the manifest, so loading here
is restricted the way the rest of the library loads (``weights_only=True``): the reader
unpickles only DCP's own metadata classes, the planner loads items with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import StorageMeta

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeMetadataError(pickle.UnpicklingError):
    """The ``.metadata`` file names a class that DCP metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _ALLOWED_MODULES or (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise UnsafeMetadataError(f".metadata refers to {module}.{name}, which DCP "
                                      "metadata never holds; refusing to load it")
        return super().find_class(module, name)


def read_metadata(folder: str) -> Metadata:
    """DCP's ``.metadata`` of ``folder``, unpickled with the allow-list above.

    Raises:
        UnsafeMetadataError, pickle.UnpicklingError, OSError.
    """
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError(f".metadata holds a {type(metadata).__name__}, not Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """A `FileSystemReader` whose metadata goes through :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(str(self.path))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor items load with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
