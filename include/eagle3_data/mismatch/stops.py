"""How a dataset's engine shows the stop token, decided over all its rows before any is classed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from eagle3_data.chat_format import OutputFormat
from eagle3_data.mismatch.rows import BadRow, InputRow


@dataclass
class StopConvention:
    """How this dataset's engine output shows the stop: decided over all its rows, before any
    row is classed, because a row without a trailing stop id is only wrong when others have one.

    `included`: stop rows end with an audited stop id (SGLang's `output_ids` run through the
    matched stop token), or the engine names it (`matched`); a stop row ending otherwise is
    `wrong_stop`. `stripped`: no stop row carries one; each is normalised by appending
    the format's stop token, and the report says so, since the ids then cannot show a wrong stop id.
    `dominant_token`: the ordinary id that most stop rows end with and that never occurs earlier
    in them; a server stops at the first occurrence of its stop id, so this is what a server told
    to stop on the wrong id (163533 "chas") produces, and the gate fails naming it. A structural
    token of the format is never taken for one: a tool-call turn ends with the section's end
    (Kimi's tool-section end token) before its stop id, so a stripped dataset of mostly tool-call
    turns ends with it in most rows, as it should.
    """

    kind: str  # "included" | "stripped" | "none" (no stop rows)
    stop_rows: int = 0
    with_stop_id: int = 0
    without_stop_id: int = 0
    matched_rows: int = 0
    stop_string_rows: int = 0
    dominant_token: dict[str, Any] | None = None

    def failure(self) -> str | None:
        d = self.dominant_token
        if d is None:
            return None
        return (
            f"{d['rows']} of {self.stop_rows} stop rows end with id {d['id']} ({d['text']!r}), an ordinary token "
            f"that never occurs earlier in them: the server stops on {d['id']}, not on an audited stop id"
        )

    def warning(self) -> str | None:
        if self.kind == "stripped":
            return (
                "stop ids stripped: no stop row ends with an audited stop id and none names the matched one, "
                "so each was taken to end with the format's stop token and a wrong stop id cannot show "
                f"({self.stop_rows} rows)"
            )
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "convention": self.kind,
            "stop_rows": self.stop_rows,
            "with_stop_id": self.with_stop_id,
            "without_stop_id": self.without_stop_id,
            "matched_rows": self.matched_rows,
            "stop_string_rows": self.stop_string_rows,
            "dominant_token": self.dominant_token,
            "warning": self.warning(),
            "failure": self.failure(),
        }


def detect_stop_convention(fmt: OutputFormat, rows: Iterable[InputRow | BadRow]) -> StopConvention:
    """One cheap pass over a dataset's rows (last ids and finish reasons only)."""
    stop_ids = set(fmt.stop_token_ids)
    structural = set(fmt.special_ids.values())
    conv = StopConvention("none")
    last_counts: Counter[int] = Counter()
    seen_earlier: set[int] = set()
    for row in rows:
        if not isinstance(row, InputRow):
            continue
        ids, matched = row.output_ids, row.matched
        if isinstance(matched, str):
            conv.stop_string_rows += 1
            continue
        last = ids[-1] if ids else None
        stopped = row.finish_reason == "stop" or matched is not None or (row.finish_reason is None and last in stop_ids)
        if not stopped:
            continue
        conv.stop_rows += 1
        if matched is not None:
            conv.matched_rows += 1
        elif last in stop_ids:
            conv.with_stop_id += 1
        else:
            conv.without_stop_id += 1
            if last is not None and last not in structural:
                last_counts[last] += 1
                if ids.index(last) < len(ids) - 1:
                    seen_earlier.add(last)
    if conv.matched_rows or conv.with_stop_id:
        conv.kind = "included"
    elif conv.without_stop_id:
        conv.kind = "stripped"
    if last_counts:
        token, n = last_counts.most_common(1)[0]
        if 2 * n > conv.stop_rows and token not in seen_earlier:
            conv.dominant_token = {"id": token, "text": fmt.codec.decode([token]), "rows": n}
    return conv
