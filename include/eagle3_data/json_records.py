"""JSON from users' files, parsed so that a bad record is refused, never a crash later.

`json.loads` accepts two things the rest of a stage cannot take: nesting deep enough to raise
RecursionError (in the parser itself past ~1000 levels, or in any recursive walk after it), and
`\\ud800`-style escapes of lone surrogates, which make a `str` that no UTF-8 encoder (pyarrow,
the tokenizer, the S3 body) accepts. Both used to end a whole file with a traceback, even when
they sat in a field the pipeline ignores. `loads` refuses them with the path of the value, so
the reader rejects that one row, naming its line and field, and keeps the others.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

MAX_DEPTH = 100  # arrays/objects inside each other; real tool schemas nest a few dozen at most
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_DECODER = msgspec.json.Decoder()  # untyped: dicts, lists, str, int, float, bool, None, as json.loads


class JsonRefused(ValueError):
    """Valid JSON that must not go further; `field` is the path of the offending value."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field, self.reason = field, reason


def loads(text: str | bytes) -> Any:
    """`json.loads`, refusing nesting over MAX_DEPTH levels and strings holding lone surrogates
    (JsonRefused, a ValueError naming the field). Invalid JSON raises ValueError as before."""
    try:
        value = fast_loads(text)
    except RecursionError:
        raise JsonRefused("", f"nested deeper than {MAX_DEPTH} levels") from None
    raw = text if isinstance(text, str) else text.decode("utf-8", errors="replace")
    # the walk below costs a visit per value: only when the text could hold what it looks for
    if raw.count("[") + raw.count("{") > MAX_DEPTH or _SURROGATE_ESCAPE.search(raw):
        check_value(value)
    return value


def fast_loads(text: str | bytes) -> Any:
    """`json.loads(text)`'s value, parsed by msgspec where it can: the engines' answers and the
    overflow stream's events are the generation clients' main per-answer CPU (an answer with its
    per-token log-probabilities is ~1,700 triples), and msgspec parses them 2.5-4x faster
    (benchmarks/json_decode.py). What msgspec refuses and the standard library accepts (NaN,
    Infinity, a lone surrogate escape, a number out of float range) goes to `json.loads`, so the
    value, and what the caller checks after, are the same either way (tests/unit/test_fast_json.py;
    integers past 64 bits stay ints in both)."""
    try:
        return _DECODER.decode(text)
    except msgspec.MsgspecError:
        return json.loads(text)


def check_value(value: Any, field: str = "") -> None:
    """JsonRefused for nesting over MAX_DEPTH or a lone surrogate anywhere in `value` (already
    parsed: a Parquet row's struct, a decoded JSON column)."""
    stack: list[tuple[Any, str, int]] = [(value, field, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise JsonRefused(
                        path,
                        f"holds a lone surrogate (U+{ord(item[exc.start]):04X} at character "
                        f"{exc.start}), which is not text: rejected, never repaired",
                    ) from None
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise JsonRefused(_named(path), f"nested deeper than {MAX_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str) and not key.isascii():
                    stack.append((key, path, depth + 1))  # a key is text too
                child_path = (f"{path}.{key}" if path else key) if isinstance(key, str) else f"{path}[{key}]"
                stack.append((child, child_path, depth + 1))


def _named(path: str, keep: int = 80) -> str:
    """A deep path without its run of list indices (`meta.a[0][0]...` -> `meta.a`): the field a
    person finds in the record, short enough for a one-line message."""
    path = re.sub(r"(\[\d+\])+$", "", path)
    return path if len(path) <= keep else path[:keep] + "..."


def join_field(outer: str, inner: str) -> str:
    """`messages` + `[0].content` -> `messages[0].content`; `tools` + `` -> `tools`."""
    if not inner:
        return outer
    return f"{outer}{inner}" if inner.startswith("[") or not outer else f"{outer}.{inner}"
