"""The one local cache root of the library: `$EAGLE3_DATA_CACHE`, else `~/.cache/eagle3-data`.

Under it: `verified-codecs/` (tokenizers proven equal to their tiktoken fast path),
`tokenizers/` (s3:// tokenizers downloaded once), `journal/` (answers paid for but not yet
committed), `dev/` (the `dev:NAME` builds). Everything the library writes on the local disk
across runs is here, so pointing the variable at an empty folder is a new machine's first start
(the test suite does, every run: `make test`).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EAGLE3_DATA_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "eagle3-data")
