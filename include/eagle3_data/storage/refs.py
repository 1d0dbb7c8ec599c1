"""Names of artifacts and the errors of the store.

Run keys, stage and dataset names become S3 key segments, so they are checked before any request:
no `..`, no `/`, no control characters, a conservative charset. A bad name is a `UserError` that
names the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eagle3_data.errors import ServiceUnavailable, UserError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}")
_PART = re.compile(r"part-(\d{5,})\.parquet")


class StorageError(UserError):
    """S3 refused, could not be reached, or holds something a reader must not trust."""


class IncompleteStage(StorageError):
    """A stage without a manifest: still running, killed, or invalidated by a rerun."""


class CorruptArtifact(StorageError):
    """A part or file is missing or its bytes do not match the sha256 in the manifest."""


class MissingBucket(StorageError):
    """The bucket does not exist: creating it is an explicit setup step (`eagle3-data s3 init`)."""


class StorageUnavailable(StorageError, ServiceUnavailable):
    """S3 unreachable after the client's retries, or it refused the credentials."""


def check_name(value: str, field: str) -> str:
    """`value` if it is a safe single S3 key segment, else a UserError naming `field`."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise UserError(
            f"invalid {field} {value!r}: use 1-128 characters from [A-Za-z0-9._=+-], starting with a "
            f"letter or digit, without '..' or '/'"
        )
    return value


def check_file_name(name: str) -> str:
    """A side-file name: a safe segment that cannot collide with parts, the manifest or `_progress/`."""
    check_name(name, "file name")
    if _PART.fullmatch(name):
        raise UserError(f"invalid file name {name!r}: part-NNNNN.parquet names are reserved for parts")
    return name


def part_name(n: int) -> str:
    return f"part-{n:05d}.parquet"


def part_number(name: str) -> int | None:
    match = _PART.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, order=True)
class StageRef:
    """One stage's output for one dataset in one run: `runs/{run_key}/{stage}/{dataset}/`."""

    run_key: str
    stage: str
    dataset: str

    def __post_init__(self) -> None:
        check_name(self.run_key, "run_key")
        check_name(self.stage, "stage")
        check_name(self.dataset, "dataset")

    @property
    def path(self) -> str:
        return f"runs/{self.run_key}/{self.stage}/{self.dataset}"
