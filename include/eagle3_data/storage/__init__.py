"""S3 artifact store: Parquet parts, manifests written last, checkpointed resumable writers.

See docs/storage.md for the layout and the commit protocol.
"""

from eagle3_data.storage.client import s3_client
from eagle3_data.storage.refs import (
    CorruptArtifact,
    IncompleteStage,
    MissingBucket,
    StageRef,
    StorageError,
    StorageUnavailable,
    check_name,
)
from eagle3_data.storage.lease import LeaseLost, StageBusy
from eagle3_data.storage.store import ArtifactStore, canonical_json, code_version, manifest_hash
from eagle3_data.storage.writer import StageWriter

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
