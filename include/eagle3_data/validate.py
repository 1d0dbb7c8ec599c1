"""Bulk mismatch validation, the gate before training ids are trusted.

Local generations carry the engine's exact ids. Each is decoded, parsed into a message the way
the overflow path receives one, reconstructed, and compared: how often (and how) reconstruction
disagrees with the model's own ids is exactly the error the overflow share will carry.
Classes: `exact`; `bpe_only` (same text and special-token structure, different split);
`special_token` (structure differs: e.g. literal "<|im_end|>" text re-encodes as the real token);
`text_diff` (decoded text differs: e.g. a cut inside a multi-byte character).
The core streams rows in bounded chunks, so memory does not grow with the input.
"""

from __future__ import annotations

import heapq
import json
import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_data.chat_format import get_output_format, normalize_finish_reason
from eagle3_data.errors import UserError

CLASSES = ("exact", "bpe_only", "special_token", "text_diff")
DEFAULT_MAX_BPE_MISMATCH_RATE = 0.10
DEFAULT_MAX_BILLING_DEVIATION = 0.01
WINDOW = 8  # most ids shown, per side, from the first difference
CHUNK_ROWS = 256


@dataclass
class InputRow:
    where: str  # "line 12" or "row 12": how a person finds the row in the input
    sample_id: str
    output_ids: list[int]
    finish_reason: str | None = None


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

    def mismatch_json(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "class": self.cls,
            "first_diff": self.first_diff,
            "original": self.original,
            "reconstructed": self.reconstructed,
        }


# ---------------------------------------------------------------- input rows


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
    finish = record.get("finish_reason")
    if finish is not None:
        try:
            finish = normalize_finish_reason(finish)
        except UserError:
            return BadRow(where, sid, "finish_reason", f"{finish!r} is not 'stop' or 'length'")
    return InputRow(where, sid, ids, finish)


def rows_from_jsonl(path: str | Path, vocab_size: int) -> Iterator[InputRow | BadRow]:
    """One row per line, read lazily; a line that is not JSON (or not UTF-8) is a bad row, not a crash."""
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield BadRow(f"line {n}", None, "<line>", f"invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            except ValueError as exc:  # bytes that are not UTF-8
                yield BadRow(f"line {n}", None, "<line>", f"not UTF-8 text ({exc})")
                continue
            yield _check_row(f"line {n}", record, vocab_size)


def rows_from_batches(batches: Iterable[Any], vocab_size: int) -> Iterator[InputRow | BadRow]:
    """Rows from Arrow record batches (Parquet read by batches, or the DAG's S3 reader)."""
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
        finishes = batch.column("finish_reason").to_pylist() if "finish_reason" in names else [None] * len(sids)
        values = col.values.to_numpy(zero_copy_only=False)  # the whole batch's ids, one array
        offsets = col.offsets.to_numpy()
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        for i, sid in enumerate(sids):
            ids = values[offsets[i] : offsets[i + 1]].tolist() if valid[i] else None
            yield _check_row(
                f"row {start + i + 1}",
                {"sample_id": sid, "output_ids": ids, "finish_reason": finishes[i]},
                vocab_size,
                ints_checked=True,
            )
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
        cols = [c for c in ("sample_id", "output_ids", "finish_reason") if c in pf.schema_arrow.names]
        return rows_from_batches(pf.iter_batches(batch_size=batch_rows, columns=cols), vocab_size)
    return rows_from_jsonl(p, vocab_size)


# ---------------------------------------------------------------- comparison


class Validator:
    """Round-trips generated ids through parse -> render -> encode and classifies the difference."""

    def __init__(self, tokenizer: Any, *, thinking: bool = True):
        self.fmt = get_output_format(tokenizer)
        self.codec = self.fmt.codec
        self.thinking = thinking
        self.vocab_size = len(tokenizer)
        self.special_ids = frozenset(tokenizer.get_added_vocab().values())
        self.im_end = self.fmt.stop_token_ids[0]

    def prepare(self, rows: Sequence[InputRow]) -> tuple[list[list[int]], list[str]]:
        """Normalised original ids and the rendered text of each row's parsed message."""
        originals: list[list[int]] = []
        texts: list[str] = []
        for row in rows:
            parsed = self.fmt.parse_ids(row.output_ids, row.finish_reason, thinking=self.thinking)
            ids = row.output_ids
            if parsed.finish_reason == "stop" and parsed.stop_token_id is None:
                ids = ids + [self.im_end]  # engine output without its stop id: normalise
            originals.append(ids)
            texts.append(
                self.fmt.render(
                    parsed.message, parsed.finish_reason, parsed.tool_call_index_start or 0, thinking=self.thinking
                )
            )
        return originals, texts

    def validate(self, rows: Sequence[InputRow]) -> list[RowResult]:
        originals, texts = self.prepare(rows)
        rebuilt = self.codec.encode_batch(texts)
        return [self.compare(r.sample_id, o, n) for r, o, n in zip(rows, originals, rebuilt)]

    def compare(self, sample_id: str, orig: list[int], new: list[int]) -> RowResult:
        if orig == new:
            return RowResult(sample_id, "exact", None, [], [], len(orig), len(new), len(orig))
        shortest = min(len(orig), len(new))
        first = next((i for i in range(shortest) if orig[i] != new[i]), shortest)
        suffix = 0
        while suffix < shortest - first and orig[-1 - suffix] == new[-1 - suffix]:
            suffix += 1
        if self.codec.decode_bytes(orig) != self.codec.decode_bytes(new):
            cls = "text_diff"
        elif self._structure(orig) != self._structure(new):
            cls = "special_token"
        else:
            cls = "bpe_only"
        return RowResult(
            sample_id,
            cls,
            first,
            self._window(orig, first, len(orig) - suffix),
            self._window(new, first, len(new) - suffix),
            len(orig),
            len(new),
            first + suffix,
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
    tokenizer: Any,
    rows: Iterable[InputRow | BadRow],
    *,
    on_bad_row: str = "fail",
    thinking: bool = True,
    chunk_rows: int = CHUNK_ROWS,
    workers: int = 1,
) -> Iterator[RowResult | BadRow]:
    """Per-row results in input order (the DAG keeps them as `validation_rows`).

    Rows go in bounded chunks. With `workers > 1` (and fork available) chunks are validated in
    forked processes, at most two per worker in flight; otherwise one chunk is encoded on threads
    while the next is parsed. A bad row raises `UserError` unless `on_bad_row == "skip"`."""
    if on_bad_row not in ("fail", "skip"):
        raise ValueError(f"on_bad_row must be 'fail' or 'skip', not {on_bad_row!r}")
    validator = Validator(tokenizer, thinking=thinking)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        yield from _validate_forked(validator, rows, on_bad_row, chunk_rows, workers)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:
        pending = None
        for items in _chunks(rows, chunk_rows):
            good = _good_rows(items, on_bad_row)
            originals, texts = validator.prepare(good)
            future = encoder.submit(validator.codec.encode_batch, texts)
            if pending is not None:
                yield from _finish(validator, *pending)
            pending = (items, originals, future)
        if pending is not None:
            yield from _finish(validator, *pending)


def validate_batches(tokenizer: Any, batches: Iterable[Any], **kwargs: Any) -> Iterator[RowResult | BadRow]:
    """`validate_rows` over Arrow record batches (the DAG's reader of S3 parts)."""
    return validate_rows(tokenizer, rows_from_batches(batches, len(tokenizer)), **kwargs)


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


def _forked_init() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    codec = _FORKED.codec
    if hasattr(codec, "num_threads"):
        codec.num_threads, codec._pool = 1, None  # the parent's threads do not survive a fork


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


def _finish(validator: Validator, items: list, originals: list[list[int]], future: Future) -> Iterator[RowResult | BadRow]:
    pairs = iter(zip(originals, future.result()))
    for item in items:
        if isinstance(item, BadRow):
            yield item
        else:
            original, rebuilt = next(pairs)
            yield validator.compare(item.sample_id, original, rebuilt)


# ---------------------------------------------------------------- report and gate


@dataclass
class ValidationSummary:
    """Accumulates per-row results into the report; holds only the mismatches, not every row."""

    max_bpe_mismatch_rate: float = DEFAULT_MAX_BPE_MISMATCH_RATE
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    bad_rows: list[dict[str, Any]] = field(default_factory=list)
    output_tokens: int = 0
    agreed_tokens: int = 0

    def add(self, item: RowResult | BadRow) -> None:
        if isinstance(item, BadRow):
            self.bad_rows.append(item.to_json())
            return
        self.counts[item.cls] += 1
        self.output_tokens += item.output_tokens
        self.agreed_tokens += item.agreed_tokens
        if item.cls != "exact":
            self.mismatches.append(item.mismatch_json())

    def report(self) -> dict[str, Any]:
        samples = sum(self.counts.values())
        reasons = []
        for cls in ("special_token", "text_diff"):
            if self.counts[cls]:
                reasons.append(f"{self.counts[cls]} sample(s) classified {cls}")
        bpe_rate = self.counts["bpe_only"] / samples if samples else 0.0
        if bpe_rate > self.max_bpe_mismatch_rate:
            reasons.append(f"bpe_only rate {bpe_rate:.4f} exceeds {self.max_bpe_mismatch_rate}")
        if not samples:
            reasons.append("no valid samples")
        return {
            "samples": samples,
            "counts": dict(self.counts),
            "sample_mismatch_rate": (samples - self.counts["exact"]) / samples if samples else 0.0,
            "token_agreement": self.agreed_tokens / self.output_tokens if self.output_tokens else 1.0,
            "mismatches": self.mismatches,
            "bad_rows": self.bad_rows,
            "gate": {"passed": not reasons, "reasons": reasons},
        }


def validate_to_report(
    tokenizer: Any,
    rows: Iterable[InputRow | BadRow],
    *,
    max_bpe_mismatch_rate: float = DEFAULT_MAX_BPE_MISMATCH_RATE,
    on_bad_row: str = "fail",
    thinking: bool = True,
    workers: int = 1,
) -> dict[str, Any]:
    summary = ValidationSummary(max_bpe_mismatch_rate)
    for item in validate_rows(tokenizer, rows, on_bad_row=on_bad_row, thinking=thinking, workers=workers):
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
    rows: Iterable[tuple[str, int, int] | tuple[str, int, int, str | None]],
    *,
    max_aggregate_deviation: float = DEFAULT_MAX_BILLING_DEVIATION,
    worst: int = 20,
) -> dict[str, Any]:
    """OpenRouter's `usage.completion_tokens` vs reconstructed lengths, per (sample_id, billed,
    reconstructed[, unreconstructable reason]). The provider counted with the model's own
    tokenizer, so an aggregate gap means reconstruction (or the provider's text) differs
    systematically; gate on it. Rows with a reason (text that cannot determine the ids, see
    `reconstruct.unreconstructable_reason`) would show a gap that says nothing about
    reconstruction: they are counted under `excluded` and left out of the deviation."""
    billed_total = rebuilt_total = n = 0
    abs_sum = 0.0
    top: list[tuple[float, str, int, int]] = []
    excluded: dict[str, Any] = {"rows": 0, "billed_completion_tokens": 0, "reasons": {}}

    for sample_id, billed, rebuilt, *reason in rows:
        if reason and reason[0]:
            excluded["rows"] += 1
            excluded["billed_completion_tokens"] += billed
            excluded["reasons"][reason[0]] = excluded["reasons"].get(reason[0], 0) + 1
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
    notes = [
        f"{count} row(s) excluded from the deviation and from training data, unreconstructable: {why}"
        for why, count in sorted(excluded["reasons"].items())
    ]
    return {
        "rows": n,  # faithful rows: the ones the deviation is computed over
        "excluded": excluded,
        "billed_completion_tokens": billed_total,
        "reconstructed_completion_tokens": rebuilt_total,
        "deviation": aggregate,
        "mean_abs_sample_deviation": abs_sum / n if n else 0.0,
        "worst_samples": [
            {"sample_id": s, "billed": b, "reconstructed": r, "deviation": (r - b) / b if b else None}
            for _, s, b, r in sorted(top, reverse=True)
        ],
        "gate": {"passed": not reasons, "reasons": reasons, "notes": notes, "max_aggregate_deviation": max_aggregate_deviation},
    }
