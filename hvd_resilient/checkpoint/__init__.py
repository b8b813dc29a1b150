"""Durable checkpoints: ``file://`` and ``s3://`` stores, manifests, the manager (save, prune)
over a reader (list, verify, load), supersede, an async writer.

Pure storage and serialization: nothing here imports Horovod or torch.distributed, and torch
and boto3 are imported only when first needed. The exception is ``sharded`` (with its
``dcp_safe``: FSDP checkpoints through ``torch.distributed.checkpoint``), which this package
does not import.
"""

from hvd_resilient.checkpoint.errors import CheckpointCorruptError, CheckpointError
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo, FileEntry, step_dir
from hvd_resilient.checkpoint.reader import CheckpointReader, ScanResult
from hvd_resilient.checkpoint.serialize import (
    CheckpointMismatchError,
    check_state_dict_keys,
    from_bytes,
    snapshot_state_dict,
    to_buffer,
    to_bytes,
)
from hvd_resilient.checkpoint.stores import (
    CheckpointStore,
    SizeMismatchError,
    StoreConfigError,
    StoreError,
    StoreNotFoundError,
    StorePermissionError,
    TransientStoreError,
    open_store,
)
from hvd_resilient.checkpoint.writer import AsyncCheckpointWriter

__all__ = [
    "MANIFEST_NAME",
    "AsyncCheckpointWriter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointReader",
    "CheckpointStore",
    "FileEntry",
    "ScanResult",
    "SizeMismatchError",
    "StoreConfigError",
    "StoreError",
    "StoreNotFoundError",
    "StorePermissionError",
    "TransientStoreError",
    "check_state_dict_keys",
    "from_bytes",
    "open_store",
    "snapshot_state_dict",
    "step_dir",
    "to_buffer",
    "to_bytes",
]
