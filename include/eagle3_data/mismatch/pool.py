"""Rows through the classifier in bounded chunks: on forked worker processes (one chunk per worker
in flight, twice), or in-process with the encode of one chunk on a thread while the next parses."""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from eagle3_data.chat_format import OutputFormat
from eagle3_data.errors import UserError
from eagle3_data.mismatch.classify import RowResult, Validator, _Prepared
from eagle3_data.mismatch.rows import BadRow, InputRow, rows_from_batches
from eagle3_data.mismatch.stops import StopConvention

CHUNK_ROWS = 256


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


def _good_rows(items: list[Any], on_bad_row: str) -> list[InputRow]:
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
    assert _FORKED is not None, "set in the parent before the fork"
    codec = _FORKED.codec
    if hasattr(codec, "num_threads"):
        codec.num_threads = 1  # one worker process per core: no encode threads beside it


def _forked_validate(items: list[Any]) -> list[RowResult | BadRow]:
    assert _FORKED is not None, "set in the parent before the fork"
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
            inflight: deque[Any] = deque()
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


def _finish(
    validator: Validator, items: list[Any], prepared: list[_Prepared], future: Future[Any]
) -> Iterator[RowResult | BadRow]:
    pairs = iter(zip(prepared, future.result()))
    for item in items:
        if isinstance(item, BadRow):
            yield item
        else:
            prep, rebuilt = next(pairs)
            yield validator.compare(item.sample_id, prep, rebuilt)
