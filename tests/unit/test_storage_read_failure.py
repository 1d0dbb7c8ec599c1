"""An S3 read that fails part-way closes the spooled temp file it was streaming into (one that
had spilled to disk would otherwise stay open, its file on disk, until garbage collection)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from eagle3_data.storage.store import ArtifactStore


class _BrokenBody:
    """Answers one chunk, then the connection drops."""

    def __init__(self) -> None:
        self.chunks = [b"x" * 16]

    def read(self, n: int = -1) -> bytes:
        if self.chunks:
            return self.chunks.pop()
        raise ConnectionResetError("connection dropped mid-object")


class _Client:
    def get_object(self, **kwargs: Any) -> dict[str, Any]:
        return {"Body": _BrokenBody()}


def test_a_read_that_fails_part_way_closes_its_spooled_file(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tempfile.SpooledTemporaryFile[bytes]] = []
    real = tempfile.SpooledTemporaryFile

    def recording(*args: Any, **kwargs: Any) -> tempfile.SpooledTemporaryFile[bytes]:
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(tempfile, "SpooledTemporaryFile", recording)  # the module store.py reads it from
    store = ArtifactStore(_Client(), "bucket")
    with pytest.raises(ConnectionResetError):
        store._download("key", None, None, "a part")
    assert len(opened) == 1 and opened[0].closed
