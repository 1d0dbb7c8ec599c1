"""The one canonical JSON spelling that is hashed and stored: sorted keys, no whitespace.

`ascii_only=False` (UTF-8 kept) is what sample ids, manifests and stored JSON columns use.
`ascii_only=True` exists for one recorded hash: the prompts stage's `rows_sha256` param was
written with ASCII escapes, and changing the spelling would change that param for every existing
run, so a rerun would no longer reuse its prompts stage.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any, *, ascii_only: bool = False) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only)
