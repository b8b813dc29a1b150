"""Durable checkpoints: ``file://`` and ``s3://`` stores, manifests, an async writer.

Pure storage and serialization: nothing here imports Horovod or torch.distributed, and torch
and boto3 are imported only when first needed. The exceptions are ``sharded`` and ``dcp_safe``
(FSDP checkpoints through ``torch.distributed.checkpoint``), which this package does not import.
"""

from hvd_resilient.checkpoint.manager import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    ScanResult,
)
from hvd_resilient.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo, FileEntry, step_dir
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
