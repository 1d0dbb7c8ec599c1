"""Bulk mismatch validation, the gate before training ids are trusted.

Local generations carry the engine's exact ids. The gate compares them with the rebuild of
exactly what an OpenAI-compatible server returns for that generation (the provider's view:
`OutputFormat.provider_view`, the kimi_k2 reasoning and tool-call parsers' split, checked against
SGLang's own parsers), put through the overflow reconstruction code path. So the error it
measures is the error the overflow share carries, including what the parsers throw away.

Classes (CLASSES, the one definition; reports render whatever is in it):
- `exact`: the rebuild is the engine's ids.
- `bpe_only`: same bytes and special-token structure, a different (non-canonical) BPE split.
- `structure`: the server's parsers reshape this generation (an implicit reasoning end, a
  leading `<think>`, whitespace the tool regexes drop, a call they discard, arguments that are not
  valid JSON, a tool section with no tools offered, ...): the overflow path cannot reproduce it,
  whatever the ids look like. `detail` says which.
- `special_token`: equal text, different special structure: literal special-token text that a
  parser reads as structure (a literal `</think>` inside reasoning), or a different stop id.
- `text_diff`: the decoded text differs (e.g. a cut inside a multi-byte character).
- `wrong_stop`: the row stopped on an id that is not an audited stop id (the engine's `matched`,
  or a trailing id where the dataset's stop rows include theirs), or a `length` row ends with one.
- `stop_string`: the engine stopped on a stop string: the ids run through the token completing
  it, which no overflow answer reproduces.
- `prefix`: a length cut right after `</think>`: the provider's answer cannot show that last
  token, so the overflow rebuild is the engine's ids minus it (a strict prefix, never a wrong id);
  counted, does not fail the gate.
- `unreconstructable`: had this generation gone the overflow way, its answer could not determine
  the ids (`reconstruct.unreconstructable_reason`: a length cut with tools offered, inside a
  multi-byte character, ...), so the overflow path excludes it instead of rebuilding it: it
  carries no error into training data and does not fail the gate; `detail` says why.
Literal special-token text the server passes through (a literal `<|im_end|>` in content) is
rebuilt as text and counts as exact; samples containing any are counted either way.

How stop ids appear is decided per dataset (`detect_stop_convention`) before the rows are
classed. The core streams rows in bounded chunks, so memory does not grow with the input.
"""

from __future__ import annotations

import heapq
import json
import multiprocessing
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_data.chat_format import AssistantMessage, OutputFormat, normalize_finish_reason
from eagle3_data.chat_format.kimi_k2 import CUT_AFTER_THINK_END
from eagle3_data.gate_defaults import (  # the thresholds' defaults, shared with the config (one place)
    DEFAULT_MAX_BAD_ROW_RATE,
    DEFAULT_MAX_BILLING_DEVIATION,
    DEFAULT_MAX_BPE_MISMATCH_RATE,
    DEFAULT_MAX_MISSING_USAGE_RATE,
)
from eagle3_data import json_records
from eagle3_data.errors import UserError
from eagle3_data.reconstruct import unreconstructable_reason

CLASSES = ("exact", "bpe_only", "prefix", "unreconstructable", "structure", "special_token", "text_diff", "wrong_stop", "stop_string")
FAILING_CLASSES = ("structure", "special_token", "text_diff", "wrong_stop", "stop_string")
WINDOW = 8  # most ids shown, per side, from the first difference
CHUNK_ROWS = 256
EXAMPLES = 20  # sample_ids kept per reported case


@dataclass
class InputRow:
    where: str  # "line 12" or "row 12": how a person finds the row in the input
    sample_id: str
    output_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None (infer from the ids)
    matched: int | str | None = None  # the engine's finish_reason.matched: a stop id or a stop string
    tools: list[dict[str, Any]] | None = None  # the tools offered; None = unknown


@dataclass
class BadRow:
    where: str
    sample_id: str | None
    field: str
    error: str

    def message(self) -> str:
        sid = f" (sample_id {self.sample_id})" if self.sample_id else ""
        return f"{self.where}{sid}: field {self.field!r}: {self.error}"

    def to_json(self) -> dict[str, Any]:
        return {"row": self.where, "sample_id": self.sample_id, "field": self.field, "error": self.error}


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


# ---------------------------------------------------------------- input rows


def _engine_finish(record: dict) -> tuple[Any, Any]:
    """(finish_reason, matched) as the engine gave them: a `finish_reason` object, the
    provenance's `finish_reason` (local generation rows), or `matched_stop` (OpenAI-style)."""
    finish = record.get("finish_reason")
    matched = record.get("matched_stop")
    prov = record.get("provenance")
    if isinstance(prov, str) and prov:
        try:
            prov = json_records.loads(prov)
        except ValueError:  # unreadable (or refused) provenance: the finish comes from the row alone
            prov = None
    engine = prov.get("finish_reason") if isinstance(prov, dict) else None
    for obj in (finish, engine):
        if isinstance(obj, dict):
            matched = obj.get("matched", matched) if matched is None else matched
            if obj is finish:
                finish = obj.get("type")
    return finish, matched


def _check_row(where: str, record: Any, vocab_size: int, ints_checked: bool = False) -> InputRow | BadRow:
    if not isinstance(record, dict):
        return BadRow(where, None, "<row>", "not a JSON object")
    sid = record.get("sample_id")
    if not isinstance(sid, str) or not sid:
        return BadRow(where, None, "sample_id", "missing or not a non-empty string")
    ids = record.get("output_ids")
    if ids is None:
        return BadRow(where, sid, "output_ids", "missing")
    if not isinstance(ids, list):
        return BadRow(where, sid, "output_ids", f"not a list of ints ({type(ids).__name__})")
    if not ints_checked and ids and set(map(type, ids)) != {int}:
        bad = next(i for i in ids if type(i) is not int)
        return BadRow(where, sid, "output_ids", f"non-integer id {bad!r}")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        return BadRow(where, sid, "output_ids", f"id {bad} outside the vocabulary (0..{vocab_size - 1})")
    finish, matched = _engine_finish(record)
    if finish is not None:
        try:
            finish = normalize_finish_reason(finish)
        except UserError:
            return BadRow(where, sid, "finish_reason", f"{finish!r} is not 'stop' or 'length'")
    if matched is not None and (isinstance(matched, bool) or not isinstance(matched, (int, str))):
        return BadRow(where, sid, "finish_reason.matched", f"{matched!r} is not a token id or a stop string")
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json_records.loads(tools)
        except json_records.JsonRefused as exc:
            return BadRow(where, sid, json_records.join_field("tools", exc.field), exc.reason)
        except json.JSONDecodeError as exc:
            return BadRow(where, sid, "tools", f"not valid JSON ({exc.msg})")
    if "tools" in record and tools is None:
        tools = []  # the column exists and says: none offered
    if tools is not None and not isinstance(tools, list):
        return BadRow(where, sid, "tools", "not a list of OpenAI tools")
    return InputRow(where, sid, ids, finish, matched, tools)


def rows_from_jsonl(path: str | Path, vocab_size: int) -> Iterator[InputRow | BadRow]:
    """One row per line, read lazily; a line that is not JSON (or not UTF-8) is a bad row, not a crash."""
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json_records.loads(line)
            except json_records.JsonRefused as exc:
                yield BadRow(f"line {n}", None, exc.field or "<line>", exc.reason)
                continue
            except json.JSONDecodeError as exc:
                yield BadRow(f"line {n}", None, "<line>", f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            except ValueError as exc:  # bytes that are not UTF-8
                yield BadRow(f"line {n}", None, "<line>", f"not UTF-8 text ({exc})")
                continue
            yield _check_row(f"line {n}", record, vocab_size)


# Read when present: the engine's finish (finish_reason, and provenance's finish_reason with its
# `matched`) and the tools offered (a generation rows' `tools` column: null = none offered).
OPTIONAL_COLUMNS = ("finish_reason", "provenance", "tools")
COLUMNS = ("sample_id", "output_ids", *OPTIONAL_COLUMNS)


def rows_from_batches(batches: Iterable[Any], vocab_size: int) -> Iterator[InputRow | BadRow]:
    """Rows from Arrow record batches (Parquet read by batches, or the DAG's S3 reader); reads
    COLUMNS, of which only sample_id and output_ids are required."""
    import pyarrow as pa

    start = 0
    for batch in batches:
        names = batch.schema.names
        for required in ("sample_id", "output_ids"):
            if required not in names:
                raise UserError(f"input has no column {required!r} (columns: {', '.join(names)})")
        col = batch.column("output_ids")
        is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
        if not (is_list and pa.types.is_integer(col.type.value_type)):
            raise UserError(f"column 'output_ids' has type {col.type}, not a list of integers")
        sids = batch.column("sample_id").to_pylist()
        optional = {c: batch.column(c).to_pylist() for c in OPTIONAL_COLUMNS if c in names}
        values = col.values.to_numpy(zero_copy_only=False)  # the whole batch's ids, one array
        offsets = col.offsets.to_numpy()
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        for i, sid in enumerate(sids):
            ids = values[offsets[i] : offsets[i + 1]].tolist() if valid[i] else None
            record = {"sample_id": sid, "output_ids": ids, **{c: v[i] for c, v in optional.items()}}
            yield _check_row(f"row {start + i + 1}", record, vocab_size, ints_checked=True)
        start += len(sids)


def rows_from_file(path: str | Path, vocab_size: int, batch_rows: int = 1024) -> Iterator[InputRow | BadRow]:
    """JSONL (line by line) or Parquet (batch by batch): memory does not grow with the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(p)
        except Exception as exc:  # pyarrow raises several types for a non-Parquet file
            raise UserError(f"--input {path}: not a readable Parquet file ({exc})") from exc
        cols = [c for c in COLUMNS if c in pf.schema_arrow.names]
        return rows_from_batches(pf.iter_batches(batch_size=batch_rows, columns=cols), vocab_size)
    return rows_from_jsonl(p, vocab_size)


# ---------------------------------------------------------------- stop provenance


@dataclass
class StopConvention:
    """How this dataset's engine output shows the stop: decided over all its rows, before any
    row is classed, because a row without a trailing stop id is only wrong when others have one.

    `included`: stop rows end with an audited stop id (SGLang's `output_ids` run through the
    matched stop token), or the engine names it (`matched`); a stop row ending otherwise is
    `wrong_stop`. `stripped`: no stop row carries one; each is normalised by appending
    `<|im_end|>`, and the report says so, since the ids then cannot show a wrong stop id.
    `dominant_token`: the ordinary id that most stop rows end with and that never occurs earlier
    in them; a server stops at the first occurrence of its stop id, so this is what a server told
    to stop on the wrong id (163533 "chas") produces, and the gate fails naming it.
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
        return (f"{d['rows']} of {self.stop_rows} stop rows end with id {d['id']} ({d['text']!r}), an ordinary token "
                f"that never occurs earlier in them: the server stops on {d['id']}, not on an audited stop id")

    def warning(self) -> str | None:
        if self.kind == "stripped":
            return ("stop ids stripped: no stop row ends with an audited stop id and none names the matched one, "
                    f"so each was taken to end with <|im_end|> and a wrong stop id cannot show ({self.stop_rows} rows)")
        return None

    def to_json(self) -> dict[str, Any]:
        return {"convention": self.kind, "stop_rows": self.stop_rows, "with_stop_id": self.with_stop_id,
                "without_stop_id": self.without_stop_id, "matched_rows": self.matched_rows,
                "stop_string_rows": self.stop_string_rows, "dominant_token": self.dominant_token,
                "warning": self.warning(), "failure": self.failure()}


def detect_stop_convention(fmt: OutputFormat, rows: Iterable[InputRow | BadRow]) -> StopConvention:
    """One cheap pass over a dataset's rows (last ids and finish reasons only)."""
    stop_ids = set(fmt.stop_token_ids)
    conv = StopConvention("none")
    last_counts: Counter = Counter()
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
            if last is not None:
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


# ---------------------------------------------------------------- comparison


@dataclass
class _Prepared:
    original: list[int]
    parts: list
    verdict: tuple[str, str] | None  # a class decided before comparing ids, and why
    notes: list[str]
    literal: tuple[str, ...]
    stop: str | None


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
        self.section_begin = fmt.special_ids.get("<|tool_calls_section_begin|>")

    def _stop(self, row: InputRow) -> tuple[list[int], str, tuple[str, str] | None, str | None]:
        """(ids normalised to end with their stop id, finish, verdict, stop provenance)."""
        ids, matched, last = row.output_ids, row.matched, (row.output_ids[-1] if row.output_ids else None)
        if isinstance(matched, str):
            return ids, "stop", ("stop_string", f"stopped on the stop string {matched!r}"), "string"
        if matched is not None:
            if matched not in self.stop_ids:
                return ids, "stop", ("wrong_stop", f"the engine stopped on id {matched} ({self._text(matched)}), "
                                     f"not an audited stop id {self.stop_ids}"), "matched"
            return (ids if last == matched else ids + [matched]), "stop", None, "matched"
        if row.finish_reason == "length":
            if last in self.stop_ids:
                return ids, "length", ("wrong_stop", f"finish_reason length, but the ids end with stop id {last}"), None
            return ids, "length", None, None
        if last in self.stop_ids:
            return ids, "stop", None, "id"
        if row.finish_reason is None:
            return ids, "length", None, None
        if self.stops.kind == "included":
            shown = f"id {last} ({self._text(last)})" if last is not None else "nothing"
            return ids, "stop", ("wrong_stop", f"stop row ends with {shown}, not an audited stop id "
                                 f"{self.stop_ids}, while this dataset's stop rows include theirs"), None
        return ids + [self.im_end], "stop", None, "added"

    def _text(self, tid: int) -> str:
        return repr(self.codec.decode([tid]))

    def prepare_one(self, row: InputRow) -> _Prepared:
        ids, finish, verdict, stop = self._stop(row)
        view = self.fmt.provider_view(ids, finish, row.tools)  # the server trims one trailing stop id
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
        return _Prepared(ids, parts, verdict, notes, self._literal(view_ids, view.text), stop)

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

    def validate(self, rows: Sequence[InputRow]) -> list[RowResult]:
        prepared = self.prepare(rows)
        return [self.compare(r.sample_id, p, n) for r, p, n in zip(rows, prepared, self.encode(prepared))]

    def compare(self, sample_id: str, prep: _Prepared, new: list[int]) -> RowResult:
        orig = prep.original
        extra = {"literal_special": prep.literal, "stop": prep.stop}
        if prep.verdict is None and not prep.notes and orig == new:
            return RowResult(sample_id, "exact", None, [], [], len(orig), len(new), len(orig), **extra)
        shortest = min(len(orig), len(new))
        first = next((i for i in range(shortest) if orig[i] != new[i]), shortest)
        suffix = 0
        while suffix < shortest - first and orig[-1 - suffix] == new[-1 - suffix]:
            suffix += 1
        detail = None
        if prep.verdict is not None:
            cls, detail = prep.verdict
        elif prep.notes == [CUT_AFTER_THINK_END] and new == orig[:-1]:
            cls, detail = "prefix", CUT_AFTER_THINK_END
        elif prep.notes:
            cls, detail = "structure", "; ".join(prep.notes)
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


def validate_rows(
    fmt: OutputFormat,
    rows: Iterable[InputRow | BadRow],
    *,
    stops: StopConvention,
    on_bad_row: str = "fail",
    chunk_rows: int = CHUNK_ROWS,
    workers: int = 1,
) -> Iterator[RowResult | BadRow]:
    """Per-row results in input order (the DAG keeps them as `validation_rows`).

    `stops`: the dataset's stop convention (`detect_stop_convention` over the same rows).
    Rows go in bounded chunks. With `workers > 1` (and fork available) chunks are validated in
    forked processes, at most two per worker in flight; otherwise one chunk is encoded on threads
    while the next is parsed. A bad row raises `UserError` unless `on_bad_row == "skip"`."""
    if on_bad_row not in ("fail", "skip"):
        raise ValueError(f"on_bad_row must be 'fail' or 'skip', not {on_bad_row!r}")
    validator = Validator(fmt, stops)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods() and can_fork_workers():
        yield from _validate_forked(validator, rows, on_bad_row, chunk_rows, workers)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:
        pending = None
        for items in _chunks(rows, chunk_rows):
            good = _good_rows(items, on_bad_row)
            prepared = validator.prepare(good)
            future = encoder.submit(validator.encode, prepared)
            if pending is not None:
                yield from _finish(validator, *pending)
            pending = (items, prepared, future)
        if pending is not None:
            yield from _finish(validator, *pending)


def validate_batches(fmt: OutputFormat, batches: Iterable[Any], **kwargs: Any) -> Iterator[RowResult | BadRow]:
    """`validate_rows` over Arrow record batches (the DAG's reader of S3 parts)."""
    return validate_rows(fmt, rows_from_batches(batches, fmt.vocab_size), **kwargs)


def _good_rows(items: list, on_bad_row: str) -> list[InputRow]:
    for item in items:
        if isinstance(item, BadRow) and on_bad_row == "fail":
            raise UserError(item.message() + " (use --on-bad-row skip to validate the other rows)")
    return [item for item in items if isinstance(item, InputRow)]


_FORKED: Validator | None = None  # set in the parent just before forking; children inherit it


@contextmanager
def _default_sigterm() -> Iterator[None]:
    """Fork workers with SIGTERM's default action. A host process (an Airflow task; pytest after
    dag.test) may hold a handler that does not exit: a worker born with it swallows the SIGTERM of
    Pool.terminate() and the pool's join waits forever."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal.signal is main-thread only; _forked_init still resets it in the worker
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def can_fork_workers() -> bool:
    """False inside a daemonic process, which multiprocessing forbids to have children: a Celery
    prefork worker runs Airflow tasks in one, and a pool there dies with "daemonic processes are
    not allowed to have children". The rows are then validated in-process (same results, one core)."""
    return not multiprocessing.current_process().daemon


def _forked_init() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    codec = _FORKED.codec
    if hasattr(codec, "num_threads"):
        codec.num_threads = 1  # one worker process per core: no encode threads beside it


def _forked_validate(items: list) -> list[RowResult | BadRow]:
    results = iter(_FORKED.validate([i for i in items if isinstance(i, InputRow)]))
    return [item if isinstance(item, BadRow) else next(results) for item in items]


def _validate_forked(
    validator: Validator, rows: Iterable[InputRow | BadRow], on_bad_row: str, chunk_rows: int, workers: int
) -> Iterator[RowResult | BadRow]:
    global _FORKED
    _FORKED = validator
    try:
        with _default_sigterm():
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_forked_init)
        try:
            inflight: deque = deque()
            for items in _chunks(rows, chunk_rows):
                _good_rows(items, on_bad_row)
                inflight.append(pool.apply_async(_forked_validate, (items,)))
                while len(inflight) > 2 * workers:
                    yield from inflight.popleft().get()
            while inflight:
                yield from inflight.popleft().get()
        except BaseException:  # bad row, or the consumer stopped early (GeneratorExit)
            pool.terminate()
            raise
        else:
            pool.close()  # all work done: the workers exit on their own
        finally:
            pool.join()
    finally:
        _FORKED = None


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _finish(validator: Validator, items: list, prepared: list[_Prepared], future: Future) -> Iterator[RowResult | BadRow]:
    pairs = iter(zip(prepared, future.result()))
    for item in items:
        if isinstance(item, BadRow):
            yield item
        else:
            prep, rebuilt = next(pairs)
            yield validator.compare(item.sample_id, prep, rebuilt)


# ---------------------------------------------------------------- report and gate


@dataclass
class ValidationSummary:
    """Accumulates per-row results into the report; holds only the mismatches, not every row.

    The gate cannot pass on nothing: no samples fail it unless `allow_unvalidated_overflow`
    (then the report warns that the overflow share goes unvalidated), and bad rows count
    against `max_bad_row_rate` (default 0)."""

    max_bpe_mismatch_rate: float = DEFAULT_MAX_BPE_MISMATCH_RATE
    stops: StopConvention | None = None
    max_bad_row_rate: float = DEFAULT_MAX_BAD_ROW_RATE
    allow_unvalidated_overflow: bool = False
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    details: dict[str, Counter] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    bad_rows: list[dict[str, Any]] = field(default_factory=list)
    literal_samples: int = 0
    literal_exact: int = 0
    literal_names: Counter = field(default_factory=Counter)
    literal_examples: list[str] = field(default_factory=list)
    output_tokens: int = 0
    agreed_tokens: int = 0

    def add(self, item: RowResult | BadRow) -> None:
        if isinstance(item, BadRow):
            self.bad_rows.append(item.to_json())
            return
        self.counts[item.cls] += 1
        self.output_tokens += item.output_tokens
        self.agreed_tokens += item.agreed_tokens
        if item.detail:
            self.details.setdefault(item.cls, Counter())[item.detail] += 1
        if item.literal_special:
            self.literal_samples += 1
            self.literal_exact += item.cls == "exact"
            self.literal_names.update(item.literal_special)
            if len(self.literal_examples) < EXAMPLES:
                self.literal_examples.append(item.sample_id)
        if item.cls != "exact":
            self.mismatches.append(item.mismatch_json())

    def report(self) -> dict[str, Any]:
        samples = sum(self.counts.values())
        reasons, warnings = [], []
        for cls in FAILING_CLASSES:
            if self.counts[cls]:
                top = self.details.get(cls, Counter()).most_common(2)
                why = f" ({'; '.join(f'{n}x {d}' for d, n in top)})" if top else ""
                reasons.append(f"{self.counts[cls]} sample(s) classified {cls}{why}")
        bpe_rate = self.counts["bpe_only"] / samples if samples else 0.0
        if bpe_rate > self.max_bpe_mismatch_rate:
            reasons.append(f"bpe_only rate {bpe_rate:.4f} exceeds {self.max_bpe_mismatch_rate}")
        reasons += bad_row_reasons(len(self.bad_rows), samples, self.max_bad_row_rate)
        if not samples:
            if self.allow_unvalidated_overflow:
                warnings.append("no local samples: the overflow share goes UNVALIDATED "
                                "(validation.allow_unvalidated_overflow is set for this dataset)")
            else:
                reasons.append("no local samples to validate: the overflow share cannot be trusted "
                               "(set validation.allow_unvalidated_overflow to accept that)")
        if self.stops is not None:
            if failure := self.stops.failure():
                reasons.append(failure)
            if warning := self.stops.warning():
                warnings.append(warning)
        return {
            "samples": samples,
            "counts": dict(self.counts),
            "details": {cls: dict(c) for cls, c in self.details.items()},
            "sample_mismatch_rate": (samples - self.counts["exact"]) / samples if samples else 0.0,
            "token_agreement": self.agreed_tokens / self.output_tokens if self.output_tokens else 1.0,
            "literal_special_text": {"samples": self.literal_samples, "exact": self.literal_exact,
                                     "names": dict(self.literal_names), "examples": self.literal_examples},
            "stop_convention": self.stops.to_json() if self.stops is not None else None,
            "mismatches": self.mismatches,
            "bad_rows": self.bad_rows,
            "gate": {"passed": not reasons, "reasons": reasons, "warnings": warnings},
        }


def bad_row_reasons(bad: int, good: int, max_rate: float) -> list[str]:
    """Bad rows count against a threshold: a gate that skipped them would judge a subset."""
    total = bad + good
    rate = bad / total if total else 0.0
    if bad and rate > max_rate:
        return [f"{bad} bad row(s) ({rate:.2%} of {total}) exceed max_bad_row_rate {max_rate:.2%}"]
    return []


def validate_to_report(
    fmt: OutputFormat,
    rows: Callable[[], Iterable[InputRow | BadRow]] | Sequence[InputRow | BadRow],
    *,
    max_bpe_mismatch_rate: float = DEFAULT_MAX_BPE_MISMATCH_RATE,
    max_bad_row_rate: float = DEFAULT_MAX_BAD_ROW_RATE,
    allow_unvalidated_overflow: bool = False,
    on_bad_row: str = "fail",
    workers: int = 1,
) -> dict[str, Any]:
    """Two passes over `rows` (a sequence, or a function that opens the rows afresh): the stop
    convention first, then the classification."""
    open_rows = rows if callable(rows) else (lambda: rows)
    stops = detect_stop_convention(fmt, open_rows())
    summary = ValidationSummary(max_bpe_mismatch_rate, stops, max_bad_row_rate, allow_unvalidated_overflow)
    for item in validate_rows(fmt, open_rows(), stops=stops, on_bad_row=on_bad_row, workers=workers):
        summary.add(item)
    return summary.report()


def validation_rows_table(results: Iterable[RowResult], dataset: str, source: str):
    """Per-row results as a `schemas.VALIDATION_ROWS` table (billed_tokens null: local ids)."""
    import pyarrow as pa

    from eagle3_data.schemas import VALIDATION_ROWS

    rs = [r for r in results if isinstance(r, RowResult)]
    return pa.Table.from_pylist(
        [
            {
                "sample_id": r.sample_id,
                "dataset": dataset,
                "source": source,
                "class": r.cls,
                "first_diff": r.first_diff,
                "original": r.original,
                "reconstructed": r.reconstructed,
                "output_tokens": r.output_tokens,
                "billed_tokens": None,
            }
            for r in rs
        ],
        schema=VALIDATION_ROWS,
    )


# ---------------------------------------------------------------- overflow billing check


def compare_billed_counts(
    rows: Iterable[tuple[str, int | None, int] | tuple[str, int | None, int, str | None]],
    *,
    max_aggregate_deviation: float = DEFAULT_MAX_BILLING_DEVIATION,
    max_missing_usage_rate: float = DEFAULT_MAX_MISSING_USAGE_RATE,
    worst: int = 20,
) -> dict[str, Any]:
    """OpenRouter's `usage.completion_tokens` vs reconstructed lengths, per (sample_id, billed,
    reconstructed[, unreconstructable reason]). The provider counted with the model's own
    tokenizer, so an aggregate gap means reconstruction (or the provider's text) differs
    systematically; gate on it. Rows with a reason (text that cannot determine the ids, see
    `reconstruct.unreconstructable_reason`) would show a gap that says nothing about
    reconstruction: they are counted under `excluded` and left out of the deviation. A row whose
    billed count is missing (None: the answer had no `usage`) is counted under `missing_usage`,
    never as 0 tokens, and more of them than `max_missing_usage_rate` fails the gate: with every
    count missing there is nothing to compare, which must not read as a deviation of 0."""
    billed_total = rebuilt_total = n = 0
    abs_sum = 0.0
    top: list[tuple[float, str, int, int]] = []
    excluded: dict[str, Any] = {"rows": 0, "billed_completion_tokens": 0, "reasons": {}}
    missing: list[str] = []
    missing_rows = 0

    for sample_id, billed, rebuilt, *reason in rows:
        if reason and reason[0]:
            excluded["rows"] += 1
            excluded["billed_completion_tokens"] += billed or 0
            excluded["reasons"][reason[0]] = excluded["reasons"].get(reason[0], 0) + 1
            continue
        if billed is None:
            missing_rows += 1
            if len(missing) < EXAMPLES:
                missing.append(sample_id)
            continue
        n += 1
        billed_total += billed
        rebuilt_total += rebuilt
        dev = (rebuilt - billed) / billed if billed else (0.0 if rebuilt == 0 else 1.0)
        abs_sum += abs(dev)
        item = (abs(dev), sample_id, billed, rebuilt)
        if len(top) < worst:
            heapq.heappush(top, item)
        else:
            heapq.heappushpop(top, item)
    aggregate = (rebuilt_total - billed_total) / billed_total if billed_total else 0.0
    reasons = []
    if abs(aggregate) > max_aggregate_deviation:
        reasons.append(f"aggregate deviation {aggregate:+.4%} exceeds ±{max_aggregate_deviation:.2%}")
    checked = n + missing_rows
    missing_rate = missing_rows / checked if checked else 0.0
    if missing_rows and missing_rate > max_missing_usage_rate:
        reasons.append(f"{missing_rows} row(s) ({missing_rate:.2%}) have no usage.completion_tokens, above "
                       f"max_missing_usage_rate {max_missing_usage_rate:.2%} (e.g. {', '.join(missing[:3])})")
    notes = [
        f"{count} row(s) excluded from the deviation and from training data, unreconstructable: {why}"
        for why, count in sorted(excluded["reasons"].items())
    ]
    return {
        "rows": n,  # faithful rows: the ones the deviation is computed over
        "excluded": excluded,
        "missing_usage": {"rows": missing_rows, "rate": missing_rate, "examples": missing},
        "billed_completion_tokens": billed_total,
        "reconstructed_completion_tokens": rebuilt_total,
        "deviation": aggregate,
        "mean_abs_sample_deviation": abs_sum / n if n else 0.0,
        "worst_samples": [
            {"sample_id": s, "billed": b, "reconstructed": r, "deviation": (r - b) / b if b else None}
            for _, s, b, r in sorted(top, reverse=True)
        ],
        "gate": {"passed": not reasons, "reasons": reasons, "notes": notes, "max_aggregate_deviation": max_aggregate_deviation,
                 "max_missing_usage_rate": max_missing_usage_rate},
    }
