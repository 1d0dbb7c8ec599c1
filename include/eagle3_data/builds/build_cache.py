"""Build-once directories under a cache root, shared by tests, the dev stack and benchmarks.

A directory is named `{name}-{key}` where the key hashes whatever determines its bytes (the
builder's source and arguments), so editing a builder rebuilds and a stale build is never used.
Builds go to a private temporary directory renamed into place: a killed build leaves no
half-written entry, and two processes building at once both end up with one complete copy.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cached_build(
    cache_root: str | Path, name: str, key_material: bytes, marker: str, build: Callable[[Path], object]
) -> Path:
    """`cache_root/{name}-{sha256(key_material)[:16]}`, calling `build(tmp_dir)` if it is absent.

    `marker` is a file the finished build always holds (present = complete).
    """
    root = Path(cache_root)
    out = root / f"{name}-{hashlib.sha256(key_material).hexdigest()[:16]}"
    if (out / marker).exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp", dir=root))
    try:
        build(tmp)
        if out.exists() and not (out / marker).exists():
            # a partial entry from a builder that was not atomic: move it aside, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f"{out.name}.stale", dir=root))
            out.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / marker).exists():  # not just another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
