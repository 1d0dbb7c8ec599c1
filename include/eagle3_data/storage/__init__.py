"""S3 artifact store: Parquet parts, manifests written last, checkpointed resumable writers.

See docs/storage.md for the layout and the commit protocol.
"""

from typing import Any

from eagle3_data.storage.refs import (
    CorruptArtifact,
    IncompleteStage,
    MissingBucket,
    StageRef,
    StorageError,
    StorageUnavailable,
    check_name,
)

# Loaded on first use (PEP 562): they import boto3 and pyarrow (~1-2 s of start-up CPU), which
# the refs and errors above do not need; `eagle3-data validate` renders reports with those alone.
_LAZY = {
    "s3_client": "client",
    "LeaseLost": "lease",
    "StageBusy": "lease",
    "ArtifactStore": "store",
    "canonical_json": "store",
    "code_version": "store",
    "manifest_hash": "store",
    "StageWriter": "writer",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ArtifactStore",
    "CorruptArtifact",
    "IncompleteStage",
    "LeaseLost",
    "MissingBucket",
    "StageBusy",
    "StageRef",
    "StageWriter",
    "StorageError",
    "StorageUnavailable",
    "canonical_json",
    "check_name",
    "code_version",
    "manifest_hash",
    "s3_client",
]
