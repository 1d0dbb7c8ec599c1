"""One row's verdict: the engine's ids against the overflow rebuild of the provider's view of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from eagle3_data.chat_format import AssistantMessage, OutputFormat
from eagle3_data.errors import UserError
from eagle3_data.mismatch.rows import InputRow
from eagle3_data.mismatch.stops import StopConvention
from eagle3_data.reconstruction import unreconstructable_reason

CLASSES = (
    "exact",
    "bpe_only",
    "prefix",
    "unreconstructable",
    "structure",
    "special_token",
    "text_diff",
    "wrong_stop",
    "stop_string",
)
FAILING_CLASSES = ("structure", "special_token", "text_diff", "wrong_stop", "stop_string")
WINDOW = 8  # most ids shown, per side, from the first difference


@dataclass
class RowResult:
    sample_id: str
    cls: str
    first_diff: int | None
    original: list[str]
    reconstructed: list[str]
    output_tokens: int
    reconstructed_tokens: int
    agreed_tokens: int
    detail: str | None = None  # why, for structure / wrong_stop / stop_string
    literal_special: tuple[str, ...] = ()  # special-token names the generation holds as text
    stop: str | None = None  # "id" (trailing audited stop id), "added" (normalised), None (length)

    def mismatch_json(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "class": self.cls,
            "first_diff": self.first_diff,
            "original": self.original,
            "reconstructed": self.reconstructed,
            "detail": self.detail,
        }


class _Stopped(NamedTuple):
    """A row's ids as the validator compares them (`Validator._stop`)."""

    ids: list[int]  # ending with their stop id (one added where the engine left it out)
    finish: str  # "stop" | "length"
    verdict: tuple[str, str] | None  # a class decided from the stop alone, and why
    stop: str | None  # stop provenance: "string", "matched", "id", "added", None (length)


@dataclass
class _Prepared:
    original: list[int]
    parts: list[Any]
    verdict: tuple[str, str] | None  # a class decided before comparing ids, and why
    notes: list[str]
    literal: tuple[str, ...]
    stop: str | None
    hides_last: str | None = None  # the provider's view cannot show the last id (ProviderView.hides_last_token)


class Validator:
    """Engine ids -> the provider's view -> the overflow rebuild, compared and classified."""

    def __init__(self, fmt: OutputFormat, stops: StopConvention):
        self.fmt = fmt
        self.codec = fmt.codec
        self.stops = stops
        self.vocab_size = fmt.vocab_size
        self.special_ids = frozenset(fmt.tokenizer.get_added_vocab().values())
        self.stop_ids = list(fmt.stop_token_ids)
        self.im_end = self.stop_ids[0]
        self.id_of = {name: tid for name, tid in fmt.tokenizer.get_added_vocab().items()}
        self.section_begin = fmt.tool_section_id

    def _stop(self, row: InputRow) -> _Stopped:
        """The row's ids normalised to end with their stop id, and how it finished."""
        ids, matched, last = row.output_ids, row.matched, (row.output_ids[-1] if row.output_ids else None)
        if isinstance(matched, str):
            return _Stopped(ids, "stop", ("stop_string", f"stopped on the stop string {matched!r}"), "string")
        if matched is not None:
            if matched not in self.stop_ids:
                return _Stopped(
                    ids,
                    "stop",
                    (
                        "wrong_stop",
                        f"the engine stopped on id {matched} ({self._text(matched)}), "
                        f"not an audited stop id {self.stop_ids}",
                    ),
                    "matched",
                )
            return _Stopped(ids if last == matched else ids + [matched], "stop", None, "matched")
        if row.finish_reason == "length":
            if last in self.stop_ids:
                return _Stopped(
                    ids, "length", ("wrong_stop", f"finish_reason length, but the ids end with stop id {last}"), None
                )
            return _Stopped(ids, "length", None, None)
        if last in self.stop_ids:
            return _Stopped(ids, "stop", None, "id")
        if row.finish_reason is None:
            return _Stopped(ids, "length", None, None)
        if self.stops.kind == "included":
            shown = f"id {last} ({self._text(last)})" if last is not None else "nothing"
            return _Stopped(
                ids,
                "stop",
                (
                    "wrong_stop",
                    f"stop row ends with {shown}, not an audited stop id "
                    f"{self.stop_ids}, while this dataset's stop rows include theirs",
                ),
                None,
            )
        return _Stopped(ids + [self.im_end], "stop", None, "added")

    def _text(self, tid: int) -> str:
        return repr(self.codec.decode([tid]))

    def prepare_one(self, row: InputRow) -> _Prepared:
        ids, finish, verdict, stop = self._stop(row)
        view = self.fmt.provider_view(ids, finish, row.tools, row.history_tool_calls)  # trims one trailing stop id
        view_ids = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        notes = list(dict.fromkeys(view.notes))
        message = AssistantMessage.from_openai(view.message)
        offered = bool(row.tools) if row.tools is not None else self.section_begin in ids
        reason = unreconstructable_reason(message, view.finish_reason, offered, thinking=self.fmt.thinking)
        if verdict is None and reason is not None:
            verdict = ("unreconstructable", reason)
        try:
            parts = self.fmt.render_parts(message, view.finish_reason, view.tool_call_index_start)
        except UserError as exc:
            parts, notes = [], notes + [str(exc)]
        return _Prepared(ids, parts, verdict, notes, self._literal(view_ids, view.text), stop, view.hides_last_token)

    def _literal(self, ids: list[int], text: str) -> tuple[str, ...]:
        """Special-token names that the ids spell out as ordinary text (`text` = their decode)."""
        found = []
        for name in self.fmt.literal_special_text([text]):
            if text.count(name) > ids.count(self.id_of[name]):
                found.append(name)
        return tuple(found)

    def prepare(self, rows: Sequence[InputRow]) -> list[_Prepared]:
        return [self.prepare_one(r) for r in rows]

    def encode(self, prepared: Sequence[_Prepared]) -> list[list[int]]:
        return self.fmt.encode_parts_batch([p.parts for p in prepared])

    def rebuilds(self, rows: Sequence[InputRow]) -> list[list[int] | None]:
        """The ids the overflow path would have for each row: its provider view rebuilt and
        encoded, as `validate` compares them; None where the row has no rebuild to stand for it
        (a wrong stop, a stop string, text that cannot determine the ids)."""
        prepared = self.prepare(rows)
        ids = self.encode(prepared)
        return [None if p.verdict is not None or not p.parts else new for p, new in zip(prepared, ids)]

    def validate(self, rows: Sequence[InputRow]) -> list[RowResult]:
        prepared = self.prepare(rows)
        return [self.compare(r.sample_id, p, n) for r, p, n in zip(rows, prepared, self.encode(prepared))]

    def compare(self, sample_id: str, prep: _Prepared, new: list[int]) -> RowResult:
        orig = prep.original
        extra = {"literal_special": prep.literal, "stop": prep.stop}
        if prep.verdict is None and not prep.notes and not prep.hides_last and orig == new:
            return RowResult(sample_id, "exact", None, [], [], len(orig), len(new), len(orig), **extra)
        shortest = min(len(orig), len(new))
        first = next((i for i in range(shortest) if orig[i] != new[i]), shortest)
        suffix = 0
        while suffix < shortest - first and orig[-1 - suffix] == new[-1 - suffix]:
            suffix += 1
        detail = None
        if prep.verdict is not None:
            cls, detail = prep.verdict
        elif prep.hides_last and not prep.notes and new == orig[:-1]:
            cls, detail = "prefix", prep.hides_last
        elif prep.notes or prep.hides_last:
            cls, detail = "structure", "; ".join([*prep.notes, *filter(None, [prep.hides_last])])
        elif self.codec.decode_bytes(orig) != self.codec.decode_bytes(new):
            cls = "text_diff"
        elif self._structure(orig) != self._structure(new):
            cls = "special_token"
        else:
            cls = "bpe_only"
        if first == len(orig) == len(new):
            first = None
        return RowResult(
            sample_id,
            cls,
            first,
            self._window(orig, first or 0, len(orig) - suffix),
            self._window(new, first or 0, len(new) - suffix),
            len(orig),
            len(new),
            (first if first is not None else len(orig)) + (suffix if first is not None else 0),
            detail,
            **extra,
        )

    def _structure(self, ids: list[int]) -> list[int | str]:
        """Special ids and the text between them: equal text with different structure means a
        special token's text appears as ordinary tokens on one side."""
        out: list[int | str] = []
        start = 0
        for i, tid in enumerate(ids):
            if tid in self.special_ids:
                out += [self.codec.decode(ids[start:i]), tid]
                start = i + 1
        out.append(self.codec.decode(ids[start:]))
        return out

    def _window(self, ids: list[int], start: int, end: int) -> list[str]:
        end = min(max(end, start + 1), start + WINDOW, len(ids))
        return [self.codec.decode([t]) for t in ids[start:end]]
