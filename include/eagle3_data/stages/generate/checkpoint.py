"""Bookkeeping shared by both generation stages: resume, journal, failures, completion.

Paid work must never be lost or paid twice, so every answer takes three steps:
  1. appended to a local journal (one JSON line, flushed: survives SIGKILL of the worker),
  2. handed to the storage writer, which commits a part every `rows_per_part` rows or
     `flush_interval_s` seconds, whichever comes first,
  3. on resume, journal rows not yet committed are written again without a request.
A worker resumed on another machine has no journal: it loses at most the answers of one
unfinished part (bounded by rows and seconds). Only one worker runs a stage at a time: the
storage writer holds the stage's S3 lease from before the first request to the manifest, and a
resume re-hashes every committed part before it trusts it (storage/lease.py, storage/writer.py).
Requests in flight at the kill may still be billed by a provider that does not cancel on
disconnect (at most `concurrency` samples), and the
overflow client's answers received but not yet journaled are lost with them (its settler queue:
at most `concurrency` more, in practice the answers of the last few milliseconds).

Failures: a failed row is committed only when it is final: a paid answer that cannot be used
(committed at once like an answer: asking again would pay again), a permanent error (HTTP 400, a
prompt the template refuses) or a sample that failed in `max_failed_runs` attempts of the stage.
Until then the stage is left incomplete (parts committed, no manifest) so the next attempt (an
Airflow retry, a rerun of the CLI) retries exactly those samples. Failure counts per sample live in
the side file `failures.json`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from eagle3_data.cache import cache_root
from eagle3_data.canonical import canonical_json
from eagle3_data.errors import UserError
from eagle3_data.images import parse_refs
from eagle3_data.spill import RowSpill
from eagle3_data.stages.generate.contracts import GenerationRow, StageSummary, StopReason
from eagle3_data.stages.generate.progress import ProgressSink
from eagle3_data.storage.refs import StageRef
from eagle3_data.storage.store import ArtifactStore
from eagle3_data.storage.writer import StageWriter

if TYPE_CHECKING:
    from eagle3_data.conversations import TurnDriver

log = logging.getLogger(__name__)

FAILURES_FILE = "failures.json"


def default_journal_dir() -> Path:
    return Path(os.environ.get("EAGLE3_JOURNAL_DIR") or cache_root() / "journal")


@dataclass
class Prompt:
    """One prompt row (schemas.PROMPTS) with its JSON fields decoded; `messages_json` and
    `tools_json` are the row's own spellings, copied into the stage's rows unchanged."""

    sample_id: str
    dataset: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    route: str | None
    messages_json: str = field(repr=False)
    tools_json: str | None = field(repr=False)
    source_id: str | None = None  # the prompt row's own id, recorded as provenance
    images_json: str | None = field(default=None, repr=False)  # the row's `images` (images.py), null for text

    @property
    def images(self) -> list[dict[str, Any]]:
        """The prompt's image references in prompt order (empty for a text prompt)."""
        return parse_refs(self.images_json)


_SPILLED = pa.schema(
    [
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("messages", pa.string()),
        ("tools", pa.string()),
        ("route", pa.string()),
        ("source_id", pa.string()),
        ("images", pa.string()),
    ]
)


class Prompts:
    """A stage's validated prompts: their sample ids in memory (resume, counts, progress), the
    rows in a local spill, decoded into `Prompt`s one at a time as they are iterated. A stage
    of 10^5 prompts with kilobytes of tool schema each thus holds only the prompts in flight."""

    def __init__(self, spill: RowSpill, ids: list[str]) -> None:
        self.spill, self.ids = spill, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[Prompt]:
        return self.iter()

    def iter(self, skip: Container[str] = ()) -> Iterator[Prompt]:
        """The prompts in input order, those in `skip` (sample ids) left out."""
        for row in self.spill.rows():
            if row["sample_id"] in skip:
                continue
            tools = json.loads(row["tools"]) if row["tools"] is not None else None
            yield Prompt(
                row["sample_id"],
                row["dataset"],
                json.loads(row["messages"]),
                tools or None,
                row["route"],
                row["messages"],
                row["tools"],
                row["source_id"],
                row["images"],
            )


def parse_prompts(rows: Iterable[dict[str, Any]], dataset: str, routes: tuple[str, ...] | None) -> Prompts:
    """Validate prompt rows (every one, before any request); a bad one is a UserError naming the
    record and the field. Rows of other `routes` are left out. One pass over `rows` (a stream
    is fine): the kept rows are spilled, not held."""
    spill, ids, seen = RowSpill(_SPILLED), [], set()
    for i, row in enumerate(rows):
        sid = row.get("sample_id")
        where = f"prompt {i} (sample_id {sid!r})"
        if not isinstance(sid, str) or not sid:
            raise UserError(f"{where}: field 'sample_id' must be a non-empty string")
        if sid in seen:
            raise UserError(f"{where}: field 'sample_id' is duplicated in the input")
        seen.add(sid)
        if routes is not None and row.get("route") is not None and row["route"] not in routes:
            continue
        try:
            messages = json.loads(row["messages"]) if isinstance(row.get("messages"), str) else row.get("messages")
            tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: field 'messages' or 'tools' is not valid JSON: {exc}") from None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise UserError(f"{where}: field 'messages' must be a non-empty list of chat messages")
        if tools is not None and not isinstance(tools, list):
            raise UserError(f"{where}: field 'tools' must be a list of tools or null")
        spill.append(
            {
                "sample_id": sid,
                "dataset": row.get("dataset") or dataset,
                "route": row.get("route"),
                "source_id": row.get("source_id"),
                "images": _images_json(row.get("images"), where),
                "messages": row["messages"] if isinstance(row["messages"], str) else canonical_json(messages),
                "tools": (row["tools"] if isinstance(row["tools"], str) else canonical_json(tools)) if tools else None,
            }
        )
        ids.append(sid)
    return Prompts(spill, ids)


@dataclass(frozen=True)
class StageSetup:
    """What a generation stage records and where it keeps its own state, besides its prompts, its
    format and its engine: the same for the local and the overflow stage."""

    model: str = ""  # the target model's name, recorded in provenance and params
    inputs: tuple[Any, ...] = ()  # upstream manifests (StageRef) or file records ({"uri", "bytes", "sha256"})
    progress: ProgressSink | None = None  # None: silent (a plain progress.Progress)
    journal_dir: str | Path | None = None  # None: $EAGLE3_JOURNAL_DIR, else the cache's journal/
    rerun: bool = False  # reopen a complete stage: re-verify its parts, redo only what is missing
    fresh: bool = False  # a person named this stage in --fresh: an unfinished attempt is archived, then dropped
    routes: tuple[str, ...] | None = None  # the prompts' routes this stage takes; None: the stage's own
    side_files: Mapping[str, bytes] = field(default_factory=dict)  # files committed beside the parts
    turns: TurnDriver | None = None  # the stage runs in rounds (every_turn regenerated, trajectory)


def sampling_for(p: Prompt, sampling: dict[str, Any]) -> dict[str, Any]:
    """Calibration samples (route "both") are generated greedily on both paths, to be comparable."""
    return dict(sampling, temperature=0.0) if p.route == "both" else sampling


def generation_row(p: Prompt, prompt_ids: list[int] | None, source: str, *, failed: str | None = None) -> GenerationRow:
    """The one place a generation row is made: `p`'s fields copied as the prompt row spells them,
    the answer's fields empty for the client to fill; `failed`: the reason of a failed row."""
    row: GenerationRow = {
        "sample_id": p.sample_id,
        "dataset": p.dataset,
        "messages": p.messages_json,
        "tools": p.tools_json if p.tools else None,
        "prompt_ids": prompt_ids,
        "output_ids": None,
        "output_logprobs": None,
        "source": source,
        "status": "ok" if failed is None else "failed",
        "error": failed,
        "reasoning": None,
        "content": None,
        "tool_calls": None,
        "finish_reason": None,
        "usage": None,
        "provenance": None,
    }
    if p.images_json:  # a text row's: null (the column's default)
        row["images"] = p.images_json
    return row


def _images_json(images: Any, where: str) -> str | None:
    """A prompt row's `images` as its canonical JSON (null for none); a malformed one is a
    UserError naming the row."""
    if not images:
        return None
    try:
        refs = json.loads(images) if isinstance(images, str) else images
        ok = isinstance(refs, list) and all(
            isinstance(r, dict) and isinstance(r.get("uri"), str) and isinstance(r.get("media_tokens"), int)
            for r in refs
        )
    except json.JSONDecodeError:
        ok = False
    if not ok:
        raise UserError(f"{where}: field 'images' must be a JSON list of image references (uri, sha256, media_tokens)")
    return images if isinstance(images, str) else canonical_json(refs)


class Stop(Exception):
    """Raised inside the writer to leave the stage incomplete with everything done committed."""


class StageRun:
    """Open with `with StageRun(...) as run:`; then `run.pending`, `run.record(row)`, `run.finish()`.

    `run.pending` is a one-shot iterator of the prompts not yet done (decoded one at a time, so
    a client holds only what it has in flight); `run.pending_count` says how many it yields."""

    max_failed_runs = 2  # stage attempts a sample may fail in before its failed row is final

    def __init__(
        self,
        store: ArtifactStore,
        ref: StageRef,
        prompts: Prompts,
        params: dict[str, Any],
        hashes: Mapping[str, str | None],
        setup: StageSetup,
        *,
        rows_per_part: int,
        flush_interval_s: float = 30.0,
    ) -> None:
        """`params`: the stage's (manifest) params; `hashes`: `tokenizer_sha256`, `template_sha256`."""
        self.store, self.ref, self.prompts = store, ref, prompts
        self.writer_args: dict[str, Any] = dict(
            rows_per_part=rows_per_part,
            params=params,
            inputs=list(setup.inputs),
            reopen=setup.rerun,
            fresh=setup.fresh,
            archive=True,
            **hashes,
        )
        key = hashlib.sha256(json.dumps([store.uri(ref), params], sort_keys=True, default=str).encode()).hexdigest()[
            :20
        ]
        self.journal_path = Path(setup.journal_dir or default_journal_dir()) / f"{ref.stage}-{ref.dataset}-{key}.jsonl"
        self.side_files = dict(setup.side_files)
        self.tokenizer_sha256 = hashes.get("tokenizer_sha256")  # recorded in every row's provenance
        self.flush_interval_s = flush_interval_s
        self.turns = setup.turns
        self.total = 0 if self.turns is not None else len(prompts)
        self.counts = {
            "ok": 0,
            "failed": 0,
            "paid_failed": 0,
            "skipped": 0,
            "replayed": 0,
            "from_archive": 0,
            "retry_later": 0,
            "lost_attempts": 0,
        }
        self.tokens = 0
        self.cost_usd = 0.0
        self.spent_before_usd = 0.0
        self.lost_attempts: dict[str, list[dict[str, Any]]] = {}  # sample id -> its priced attempts without an answer
        self.unsettled_attempts: list[dict[str, Any]] = []  # attempts an earlier process opened and never settled
        self.pending: Iterator[Prompt] = iter(())
        self.pending_count = 0
        self.failures: dict[str, dict[str, Any]] = {}  # sample id -> {"runs", "error"}: failures.json
        self.result: StageSummary | None = None  # set by `finish`
        self._held: dict[str, GenerationRow] = {}  # failed rows not (yet) final
        self._rows: list[GenerationRow] = []  # ok rows journaled, not yet handed to the writer
        self._done: set[str] = set()  # sample ids committed or replayed
        self._batch = min(64, rows_per_part)
        self._last_flush = time.monotonic()
        self._cm: StageWriter | None = None  # opened by `__enter__`: it takes the stage's lease
        self.writer: StageWriter | None = None
        self._journal: io.TextIOBase | None = None  # opened by `_resume`, after the replay

    def __enter__(self) -> StageRun:
        # the writer takes the stage's lease first: a second writer fails here, before any request
        self._cm = StageWriter(self.store, self.ref, "generations", part_summary=part_cost, **self.writer_args)
        self.writer = self._cm.__enter__()
        try:
            self._resume()
            for name, data in self.side_files.items():
                self.store.put_bytes(self.ref, name, data)
        except BaseException as exc:
            self._cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    @property
    def _open_writer(self) -> StageWriter:
        """The writer `__enter__` opened (the run is used inside its `with`)."""
        assert self.writer is not None, "StageRun used outside its `with`"
        return self.writer

    @property
    def _open_journal(self) -> io.TextIOBase:
        """The local journal `_resume` opened."""
        assert self._journal is not None, "StageRun's journal used before `_resume` opened it"
        return self._journal

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._journal is not None:
            self._journal.close()
        if exc_type is not None:
            try:
                self._hand_over()  # the rows land in the writer's buffer even when S3 is down
            except Exception:
                pass  # the writer's exit below retries the upload once and says what it kept
        assert self._cm is not None
        self._cm.__exit__(exc_type, exc, tb)  # flushes what is buffered when an error propagates
        unsaved = getattr(self.writer, "unsaved_rows", 0)
        if unsaved:
            log.warning(
                "%s: the %d answers not in S3 are kept in the local journal %s: a resume on this machine "
                "replays them without a request; on another machine they are requested (and paid) again",
                self.store.uri(self.ref),
                unsaved,
                self.journal_path,
            )
        return exc_type is Stop

    def _resume(self) -> None:
        done = self._open_writer.committed_sample_ids()
        self.spent_before_usd = committed_cost(self.store, self.ref, self._open_writer.committed_records())
        wanted = set(self.prompts.ids)  # in rounds every journaled row (this stage's, these params') is a turn
        replay: list[dict[str, Any]] = []
        attempts: dict[str, dict[str, Any]] = {}
        if self.journal_path.exists():
            for line in self.journal_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the kill
                if isinstance(row.get("attempt"), dict):  # journal_attempt's records: the last state of each wins
                    attempts[row["attempt"].get("attempt")] = row["attempt"]
                    continue
                sid = row.get("sample_id")
                if (sid in wanted or (self.turns is not None and isinstance(sid, str))) and sid not in done:
                    replay.append(row)
                    done.add(row["sample_id"])
        self._take_back(replay, "replayed", "answers recovered from the local journal")
        archived = self._archived_answers(wanted, done)
        self._take_back(archived, "from_archive", "paid answers taken back from the archive of a replaced attempt")
        replay += archived
        self._resume_attempts(attempts.values(), done)
        self.failures = self._load_failures()
        self._done = done
        if self.turns is not None:  # the rounds ask for their turns (`add`); the walk needs every final one
            self.turns.start(self.prompts)
            self._observe_committed()
            for row in replay:
                self.turns.observe(row)
        else:
            self.pending_count = sum(sid not in done for sid in self.prompts.ids)
            self.pending = self.prompts.iter(skip=done)
            self.counts["skipped"] = len(self.prompts) - self.pending_count
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        self._journal = self.journal_path.open("a", encoding="utf-8")

    def _take_back(self, rows: list[dict[str, Any]], count: str, what: str) -> None:
        """Rows paid for earlier (the journal's, the archive's) into the writer without a request:
        counted under `count`, their cost spent before this attempt."""
        if not rows:
            return
        log.info("%s: %d %s, not requested again", self.store.uri(self.ref), len(rows), what)
        self._open_writer.write(rows)
        self.counts[count] = len(rows)
        self.spent_before_usd += sum((r.get("usage") or {}).get("cost_usd") or 0.0 for r in rows)

    def _archived_answers(self, wanted: set[str], done: set[str]) -> list[dict[str, Any]]:
        """Rows of attempts archived by a `--fresh` (storage/archive.py) made with this stage's
        params and tokenizer, for samples still to do: the answers (`ok`) and every row that was
        paid for; an unpaid failure is asked again (the fresh run may be what fixes it). `done`
        gains their ids."""
        from eagle3_data.storage.archive import archived_tables

        args = self.writer_args
        hashes = {k: args.get(k) for k in ("tokenizer_sha256", "template_sha256")}
        out = []
        for table in archived_tables(self.store, self.ref, args["params"], hashes):
            for row in table.to_pylist():
                sid = row.get("sample_id")
                wanted_here = sid in wanted or (self.turns is not None and isinstance(sid, str))
                paid = row.get("status") == "ok" or ((row.get("usage") or {}).get("cost_usd") or 0) > 0
                if wanted_here and sid not in done and paid:
                    out.append(row)
                    done.add(sid)
        return out

    def _resume_attempts(self, attempts: Iterable[dict[str, Any]], done: set[str]) -> None:
        """Attempts of samples still pending: the priced ones count as spent (their sample's row
        will carry them), the ones an earlier process opened and never settled are listed for the
        client to price before it asks again (`unsettled_attempts`). A committed sample's row
        carries its attempts already."""
        for a in attempts:
            if a.get("sample_id") in done or a.get("state") == "closed":  # closed: an error that was not billed
                continue
            if a.get("state") == "settled":
                self.lost_attempts.setdefault(a["sample_id"], []).append(a)
                self.spent_before_usd += a.get("cost_usd") or 0.0
            else:
                self.unsettled_attempts.append(a)
        if self.unsettled_attempts:
            log.warning(
                "%s: %d requests of an earlier attempt were cut while the provider may have billed them: "
                "priced before their samples are asked again",
                self.store.uri(self.ref),
                len(self.unsettled_attempts),
            )

    def journal_attempt(self, record: dict[str, Any]) -> None:
        """A paid-or-maybe-paid request without an answer, in the local journal (flushed): `state`
        "open" when the provider named its generation, "settled" once it is priced (`cost_usd`,
        `cost_source`). A resume prices the open ones before their samples are asked again, so no
        request is retried while the journal says its first attempt may still be billed uncounted;
        "closed" when it ended in an error that was not billed (nothing to price)."""
        self._open_journal.write(json.dumps({"attempt": record}, ensure_ascii=False) + "\n")
        self._open_journal.flush()
        if record.get("state") == "settled":
            self.cost_usd += record.get("cost_usd") or 0.0
            self.counts["lost_attempts"] += 1

    def reprice_attempt(self, record: dict[str, Any], cost_usd: float, *, earlier: bool = False) -> float:
        """A settled attempt priced at the estimate, priced again from OpenRouter's record of its
        generation (which came late): `record` updated in place and journaled again (a resume takes
        its last state), the difference added to this attempt's cost, or to what earlier attempts
        spent (`earlier`: it was settled by one of them). Returns the difference."""
        delta = cost_usd - (record.get("cost_usd") or 0.0)
        record.update(cost_usd=cost_usd, cost_source="generation_lookup", estimate_usd=record.get("cost_usd"))
        self._open_journal.write(json.dumps({"attempt": record}, ensure_ascii=False) + "\n")
        self._open_journal.flush()
        if earlier:
            self.spent_before_usd += delta
        else:
            self.cost_usd += delta
        return delta

    def _observe_committed(self) -> None:
        """Hand the turn driver every row earlier attempts committed (verified parts, the columns a
        walk reads), so a resumed attempt knows where each conversation stands."""
        columns = ["sample_id", "status", "finish_reason", "content", "reasoning", "tool_calls", "output_ids"]
        turns = self.turns
        assert turns is not None, "only a stage run in rounds observes its committed rows"
        for record in self._open_writer.committed_records():
            for row in committed_part(self.store, self.ref, record, columns).to_pylist():
                turns.observe(row)

    def add(self, prompts: Prompts) -> None:
        """A round's prompts (the turns a TurnDriver asks for): `pending` yields those not done."""
        self.pending_count = sum(sid not in self._done for sid in prompts.ids)
        self.pending = prompts.iter(skip=self._done)
        self.counts["skipped"] += len(prompts) - self.pending_count
        self.total += len(prompts)

    def _load_failures(self) -> dict[str, dict[str, Any]]:
        from eagle3_data.storage import IncompleteStage

        try:
            return dict(self.store.get_json(self.ref, FAILURES_FILE))
        except IncompleteStage:  # absent on a first attempt (an S3 outage is not "absent": it propagates)
            return {}

    def record(self, row: GenerationRow, *, permanent: bool = False) -> None:
        """An answer (status ok) or a failure (status failed + error) for one pending sample:
        `journal`, then `checkpoint` when one is due."""
        self.journal(row, permanent=permanent)
        if self.checkpoint_due():
            self.checkpoint()

    def checkpoint_due(self) -> bool:
        return len(self._rows) >= self._batch or time.monotonic() - self._last_flush > self.flush_interval_s

    def checkpoint(self) -> None:
        """Hand the journaled rows to the writer, which uploads a part every `rows_per_part` rows;
        every `flush_interval_s` it commits what it buffers, however few. This is the blocking
        half (S3 round trips), so an event loop can run it in a thread (openrouter's settler)."""
        self._hand_over()
        if time.monotonic() - self._last_flush > self.flush_interval_s:
            self._open_writer.flush()
            self._last_flush = time.monotonic()

    def journal(self, row: GenerationRow, *, permanent: bool = False, paid: bool = False) -> None:
        """Count one sample's row. An answer, and any row of a paid answer (`paid`: a failed or
        unusable one is final: asking again would pay again), is appended to the local journal
        (flushed: it survives a SIGKILL) and queued for the writer; an unpaid failure is held
        until it is final (`finish`)."""
        usage: dict[str, Any] = dict(row.get("usage") or {})
        self.cost_usd += usage.get("cost_usd") or 0.0
        if row["status"] == "ok" or paid:
            self.tokens += usage.get("completion_tokens") or 0
            self._open_journal.write(json.dumps(row, ensure_ascii=False) + "\n")
            self._open_journal.flush()
            self._rows.append(row)
            if self.turns is not None:
                self.turns.observe(row)
            if row["status"] == "ok":
                self.counts["ok"] += 1
            else:
                self.counts["failed"] += 1
                self.counts["paid_failed"] += 1
            return
        prior = self.failures.get(row["sample_id"], {}).get("runs", 0)
        self.failures[row["sample_id"]] = {"runs": prior + 1, "error": row["error"]}
        if permanent or prior + 1 >= self.max_failed_runs:
            self._held[row["sample_id"]] = row
            self.counts["failed"] += 1
            if self.turns is not None:
                self.turns.observe(row)
        else:
            self.counts["retry_later"] += 1

    def finish(
        self, stopped_reason: StopReason | None, extra: dict[str, Any] | None = None, *, stop_detail: str | None = None
    ) -> None:
        """Commit the manifest if every sample is settled, else leave the stage for the next attempt
        (raises Stop, which `__exit__` swallows after the writer checkpointed). Result: `self.result`."""
        self.store.put_json(self.ref, FAILURES_FILE, self.failures)
        if stopped_reason is None and self.counts["retry_later"]:
            stopped_reason = StopReason.RETRYABLE_FAILURES
        summary = self.summary(stopped_reason, stop_detail)
        if stopped_reason is None:
            if self.turns is not None:  # every conversation has ended: its samples go beside the parts
                from eagle3_data.conversations import SAMPLES_FILE

                data, figures = self.turns.samples_file()
                self.store.put_bytes(self.ref, SAMPLES_FILE, data)
                self.side_files[SAMPLES_FILE] = data
                extra = {**(extra or {}), "conversations": figures}
            self._hand_over()
            self._open_writer.write(list(self._held.values()))
            self._open_writer.commit(
                extra={"counts": summary["counts"], **(extra or {})}, files=[FAILURES_FILE, *self.side_files]
            )
            self._open_journal.close()
            self.journal_path.unlink(missing_ok=True)
            summary["complete"] = True
            self.result = summary
            return
        log.warning(
            "%s left incomplete (%s): %s; rerun to resume",
            self.store.uri(self.ref),
            summary["stopped_reason"],
            summary["counts"],
        )
        self.result = summary
        raise Stop(summary["stopped_reason"])

    def _hand_over(self) -> None:
        """Rows go to the writer in batches: one Arrow conversion per batch, not per row (they are
        journaled already, so batching risks nothing)."""
        if self._rows:
            rows, self._rows = self._rows, []
            self._open_writer.write(rows)  # buffered there before any upload: a failed upload keeps them

    def summary(self, stopped_reason: StopReason | None, stop_detail: str | None = None) -> StageSummary:
        """This attempt's summary, not complete (`finish` says when it is)."""
        return stage_summary(
            self.store.uri(self.ref),
            dict(self.counts, total=self.total),
            complete=False,
            stopped_reason=stopped_reason,
            stop_detail=stop_detail,
            tokens=self.tokens,
            cost_usd=round(self.cost_usd, 6),
            spent_before_usd=round(self.spent_before_usd, 6),
        )


def stage_summary(
    uri: str,
    counts: dict[str, int],
    *,
    complete: bool,
    reused: bool = False,
    stopped_reason: StopReason | None = None,
    stop_detail: str | None = None,
    tokens: int = 0,
    cost_usd: float = 0.0,
    spent_before_usd: float = 0.0,
) -> StageSummary:
    """The one shape of a generation stage's summary, fresh (`StageRun.summary`) or reused."""
    return {
        "uri": uri,
        "complete": complete,
        "reused": reused,
        "stopped_reason": stopped_reason,
        "stop_detail": stop_detail,
        "counts": counts,
        "tokens": tokens,
        "cost_usd": cost_usd,
        "spent_before_usd": spent_before_usd,
    }


def run_rounds(
    run: StageRun, dataset: str, go: Callable[[], StopReason | None], progress: ProgressSink, label: str
) -> StopReason | None:
    """Run a client (`go`: one pass over `run.pending`, its stop reason) once, or, for a stage
    whose turns depend on each other (`run.turns`), once per round until no conversation asks for
    another turn or the client stops. `progress` is closed however it ends: a bar left open would
    swallow the start of an error's line."""
    try:
        if run.turns is None:
            progress.start(run.total, run.total - run.pending_count, label=label)
            return go()
        number = 0
        while rows := run.turns.next_prompts():
            if number:
                progress.close()  # the round before's line (bar)
            number += 1
            run.add(parse_prompts(rows, dataset, None))
            progress.start(run.pending_count, 0, label=f"{label} round {number}")
            if stopped := go():
                return stopped
        return None
    finally:
        progress.close()


def reused_summary(store: ArtifactStore, ref: StageRef) -> StageSummary:
    """A complete stage is never regenerated (opening its writer would discard paid work)."""
    counts = (store.read_manifest(ref).get("extra") or {}).get("counts") or {}
    return stage_summary(store.uri(ref), counts, complete=True, reused=True)


def part_cost(table: pa.Table) -> dict[str, Any]:
    """The summary each generations part's progress record carries, so resume prices committed
    work from the (verified) records without downloading the parts again."""
    usage = table.column("usage").to_pylist()
    return {"cost_usd": sum((u or {}).get("cost_usd") or 0.0 for u in usage) + lost_cost(table)}


def lost_cost(table: pa.Table) -> float:
    """USD of the attempts the rows of `table` lost before their answer (their provenance's
    `lost_cost_usd`: cut streams, unreadable answers), which their usage does not hold."""
    if "provenance" not in table.column_names:
        return 0.0
    return sum(
        json.loads(p).get("lost_cost_usd") or 0.0
        for p in table.column("provenance").to_pylist()
        if p and '"lost_cost_usd"' in p
    )


def committed_cost(store: ArtifactStore, ref: StageRef, records: list[dict[str, Any]]) -> float:
    """USD of rows earlier attempts committed (verified parts without a manifest yet), for the budget.
    Records written before summaries existed are priced from their part, read through the store
    (sha256 checked, a bad part named)."""
    total = 0.0
    for record in records:
        if "summary" in record:
            total += record["summary"].get("cost_usd") or 0.0
            continue
        total += part_cost(committed_part(store, ref, record, ["usage", "provenance"]))["cost_usd"]
    return total


def committed_part(store: ArtifactStore, ref: StageRef, record: dict[str, Any], columns: list[str]) -> pa.Table:
    """`columns` of one committed generations part, read through the store (sha256 and schema
    checked, a bad part named)."""
    from eagle3_data.schemas import schema_for
    from eagle3_data.storage.parts import check_part_schema

    with store.open_verified(ref, record["name"], sha256=record["sha256"], nbytes=record["bytes"]) as f:
        return check_part_schema(f, schema_for("generations"), store.uri(ref, record["name"])).read(columns=columns)
