"""Merge validated generations of all datasets into shuffled, sharded training records.

A record is `input_ids = prompt_ids + output_ids` with `loss_mask` aligned to it, unshifted:
0 on every prompt token, 1 on every generated token (the trainer does the next-token shift).
The final stop token of a finished answer is a generated token and keeps mask 1: the target
emits it, so a drafter that predicts it saves a verification step at every turn end.
Generations cut by the engine (`finish_reason == "length"`) keep mask 1 on all their tokens:
they are true target outputs that simply have no end token. Rows cut here by `max_length`
are marked `truncated`. A trajectory (conversations) is one record made of its last
turn's row: `input_ids` the last turn's prompt and output, mask 1 on every turn's generated
span and 0 on the tool results and headers between them (`folds`); its earlier turns' rows
are folded into it.

Memory is bounded by tokens, whatever the number or length of the samples. Pass 1 streams every
input once into a local Arrow spill file (ok rows only, with a seeded 64-bit hash of the sample_id
as shuffle key) and keeps 16 bytes a row in memory (key, token count). Pass 1b cuts the key range
at token quantiles into buckets of about `tokens_per_bucket` tokens each (all copies of a sample
share a key, so a bucket); pass 2 loads one bucket at a time, dedupes it, orders it by key and
builds the records from flat numpy/Arrow buffers in chunks of at most 1024 rows, so token ids are
never Python objects and a bucket is freed before the next one loads. Because the buckets
partition the key range in order, the output is the global key order: it depends on the seed and
the sample ids only, not on input order or bucket size (tests/unit/test_merge_golden.py pins the
bytes).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3_data import draft_vocab, images
from eagle3_data.config import MergeConfig
from eagle3_data.conversations import Folds, TurnRow
from eagle3_data.errors import UserError
from eagle3_data.schemas import MERGED
from eagle3_data.stages import MERGE
from eagle3_data.storage import ArtifactStore, StageRef
from eagle3_data.storage.lease import Lease

SOURCE_RANK = {"sglang": 0, "vllm": 0, "openrouter": 1}  # local ground truth (either engine) beats reconstruction
_COLUMNS = ["sample_id", "dataset", "source", "status", "prompt_ids", "output_ids", "finish_reason", "provenance"]
ROW_GROUP_ROWS = 1024  # rows per Parquet row group of a shard (streaming readers get at most this many)
DEFAULT_TOKENS_PER_BUCKET = 1 << 24  # ~16.8M tokens: ~64 MiB of ids resident per bucket (x2 while it loads)
MAX_BUCKETS = 256  # bucket files open at once while partitioning (stays far below the usual fd limit)
_CHUNK_TOKENS = 1 << 20  # records are built in chunks of at most ~this many tokens (or ROW_GROUP_ROWS rows)
_IDS = pa.list_(pa.int32())
_BUCKET_SCHEMA = pa.schema(
    [
        ("key", pa.uint64()),
        ("rank", pa.int32()),  # source rank, then input order: the dedupe preference
        ("order", pa.int64()),
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source", pa.string()),
        ("prompt_ids", _IDS),
        ("output_ids", _IDS),
        ("finish_reason", pa.string()),
        ("provenance", pa.string()),
        (
            "masked",
            _IDS,
        ),  # [start, end) pairs of output positions with mask 0 (a trajectory's tool results); null: none
    ]
)

Stats = defaultdict[str, Counter[str]]  # per dataset, the figures of the manifest's `datasets`


@dataclass(frozen=True)
class MergeContext:
    """What a caller brings to one merge besides its inputs and settings (`MergeConfig`, all of
    the manifest's params): how it runs here (a lease already held, memory, work dir), which never
    changes the output, and the trajectories' folds, which follow from the run's generation stages."""

    # per input, its trajectories' turn rows (`conversations.trajectory_folds`: stage.trajectory_folds_of)
    folds: Mapping[StageRef, Folds] | None = None
    # the output stage's lease when the caller already holds it; None: the merge takes it
    lease: Lease | None = None
    # bounds memory (about 8 bytes per token of it while a bucket loads); never changes the output
    tokens_per_bucket: int = DEFAULT_TOKENS_PER_BUCKET
    # where the spill and the buckets live (None: the system's temporary directory)
    work_dir: str | Path | None = None


def shuffle_key(seed: int, sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{sample_id}".encode(), digest_size=8).digest(), "big")


def build_record(row: dict[str, Any], max_length: int, length_policy: str) -> tuple[dict[str, Any] | None, str | None]:
    """The training record of one generation, or (None, reason) when the policy drops it.

    The reference semantics of one row; `merge_datasets` applies the same rules to whole Arrow
    chunks (`_drop_reason` + `_build_records`), and a test holds the two equal.
    """
    prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
    reason = _drop_reason(len(prompt), len(output), max_length, length_policy)
    if reason:
        return None, reason
    ids = (prompt + output)[:max_length]
    generated = [1] * len(output)
    spans = row.get("masked") or []
    for start, end in zip(spans[::2], spans[1::2]):
        generated[start:end] = [0] * (end - start)
    mask = ([0] * len(prompt) + generated)[:max_length]
    return {
        "sample_id": row["sample_id"],
        "dataset": row["dataset"],
        "source": row["source"],
        "input_ids": ids,
        "loss_mask": mask,
        "prompt_tokens": len(prompt),
        "output_tokens": sum(mask),
        "truncated": len(prompt) + len(output) > max_length,
        "finish_reason": row["finish_reason"],
        "provenance": row["provenance"],
    }, None


def _drop_reason(prompt: int, output: int, max_length: int, length_policy: str) -> str | None:
    if not output:
        return "empty_output"
    if prompt + output > max_length:
        if length_policy == "drop":
            return "too_long"
        if prompt >= max_length:
            return "prompt_too_long"
    return None


def _check_row(row: dict[str, Any], ref: StageRef, vocab_size: int | None = None) -> None:
    sid = row.get("sample_id")
    if not sid:
        raise UserError(f"{ref.path}: a row has no sample_id")
    if row.get("source") not in SOURCE_RANK:
        raise UserError(
            f"{ref.path}: sample {sid}: field source is {row.get('source')!r}, expected one of {sorted(SOURCE_RANK)}"
        )
    for field in ("prompt_ids", "output_ids"):
        ids = row.get(field)
        if ids is None:
            raise UserError(f"{ref.path}: sample {sid}: field {field} is missing on a row with status ok")
        if ids and min(ids) < 0:
            raise UserError(f"{ref.path}: sample {sid}: field {field} holds a negative token id")
        if ids and vocab_size is not None and max(ids) >= vocab_size:
            raise UserError(
                f"{ref.path}: sample {sid}: field {field} holds id {max(ids)}, outside the vocabulary "
                f"(0..{vocab_size - 1})"
            )
    if not row.get("prompt_ids"):
        raise UserError(f"{ref.path}: sample {sid}: field prompt_ids is empty")


def _rows_look_valid(
    sids: Sequence[str | None],
    sources: Sequence[str | None],
    prompt: pa.Array,
    output: pa.Array,
    vocab_size: int | None = None,
) -> bool:
    """Every check of `_check_row` over a whole batch of ok rows at C speed; False sends the batch
    through `_check_row` row by row, so the first bad row is named exactly as before."""
    if not all(sids) or not all(s in SOURCE_RANK for s in sources) or prompt.null_count or output.null_count:
        return False
    if len(prompt) and pc.min(pc.list_value_length(prompt)).as_py() < 1:
        return False
    for ids in (prompt, output):
        flat = ids.flatten()
        if len(flat) and pc.min(flat).as_py() < 0:
            return False
        if len(flat) and vocab_size is not None and pc.max(flat).as_py() >= vocab_size:
            return False
    return True


def _common_hash(manifests: list[dict[str, Any]], field: str) -> str | None:
    values: set[str] = {value for m in manifests if (value := m.get(field)) is not None}
    if len(values) > 1:
        raise UserError(
            f"inputs disagree on {field} ({sorted(values)}): ids from different tokenizers/templates "
            "cannot be merged into one training set"
        )
    return values.pop() if values else None


class _ShardWriter:
    """Parquet shards of about `shard_tokens` tokens each, uploaded as they close.

    Row groups are the first ROW_GROUP_ROWS rows of a shard, the next ROW_GROUP_ROWS, ..., so the
    bytes depend on the record sequence only, not on how it arrives in chunks.
    """

    def __init__(self, store: ArtifactStore, ref: StageRef, work: Path, shard_tokens: int):
        self.store, self.ref, self.work, self.shard_tokens = store, ref, work, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._pending: list[pa.Table] = []  # slices of small record chunks, never of a whole bucket
        self._pending_rows = 0
        self._tokens = 0
        self._writer: pq.ParquetWriter | None = None
        self._path: Path | None = None
        self._samples = 0
        self.trained_counts = np.zeros(0, dtype=np.int64)  # per token id: trained (loss_mask 1) occurrences

    def add(self, records: pa.Table) -> None:
        ids = records["input_ids"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        mask = records["loss_mask"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        self.trained_counts = draft_vocab.add_counts(self.trained_counts, ids.astype(np.int64), mask)
        start = 0
        for i, n in enumerate(pc.list_value_length(records["input_ids"]).to_pylist()):
            if self._writer is None:
                self._path = self.work / f"shard-{len(self.shards):05d}.parquet"
                self._writer = pq.ParquetWriter(str(self._path), MERGED)
            self._pending_rows += 1
            self._tokens += n
            self._samples += 1
            full, close = self._pending_rows >= ROW_GROUP_ROWS, self._tokens >= self.shard_tokens
            if full or close:
                self._pending.append(records.slice(start, i + 1 - start))
                start = i + 1
                self._flush_rows()
                if close:
                    self.close_shard()
        if start < records.num_rows:
            self._pending.append(records.slice(start))

    def _flush_rows(self) -> None:
        if self._pending:
            assert self._writer is not None  # rows are pending only while a shard is open
            self._writer.write_table(pa.concat_tables(self._pending).combine_chunks())
            self._pending, self._pending_rows = [], 0

    def close_shard(self) -> None:
        if self._writer is None or self._path is None:  # both set together when a shard opens
            return
        self._flush_rows()
        self._writer.close()
        self.store.put_file(self.ref, self._path.name, self._path)
        self.shards.append(
            {**_ref_dict(self.ref), "name": self._path.name, "samples": self._samples, "tokens": self._tokens}
        )
        self._path.unlink()
        self._writer, self._tokens, self._samples = None, 0, 0


def _ref_dict(ref: StageRef) -> dict[str, str]:
    return {"run_key": ref.run_key, "stage": ref.stage, "dataset": ref.dataset}


def _spill(
    store: ArtifactStore,
    inputs: list[StageRef],
    seed: int,
    stats: Stats,
    path: Path,
    vocab_size: int | None = None,
    folds: Mapping[StageRef, Folds] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1: stream every input into one local Arrow file of its ok rows, in input order, with
    their shuffle key and dedupe rank. Returns (key, tokens) per spilled row, the only per-row
    state kept in memory (16 bytes a row); token ids only ever live in one input batch.
    `folds` (per input, `conversations.trajectory_folds`): turn rows that become a trajectory's record."""
    keys: list[np.ndarray] = []
    tokens: list[np.ndarray] = []
    order = 0
    writer: pa.ipc.RecordBatchStreamWriter | None = None
    for ref, input_folds in (folds or {}).items():  # what became of each sample: whole, cut, dropped
        stats[ref.dataset].update(input_folds.counts)
    try:
        for index, ref in enumerate(inputs):
            for batch in store.iter_batches(ref, columns=_COLUMNS):
                datasets = [d or ref.dataset for d in batch.column("dataset").to_pylist()]
                sources = batch.column("source").to_pylist()
                fold = (folds or {}).get(ref)
                turn_rows = fold.rows if fold else {}
                all_sids = batch.column("sample_id").to_pylist() if turn_rows else ()
                ok = []
                for i, status in enumerate(batch.column("status").to_pylist()):
                    if status == "ok":
                        ok.append(i)
                    else:  # failed, or unreconstructable (text cannot determine the ids)
                        kind = "unreconstructable" if status == "unreconstructable" else "failed"
                        stats[datasets[i]][f"{kind}_{sources[i] or 'unknown'}"] += 1
                        if all_sids and all_sids[i] in turn_rows:  # an unusable turn: its sample is cut before it
                            stats[datasets[i]]["trajectory_turns_dropped"] += 1
                first_order, order = order + 1, order + batch.num_rows
                if not ok:
                    continue
                taken = batch.take(pa.array(ok, pa.int64()))
                rows = _OkRows(
                    positions=ok,
                    sample_ids=taken.column("sample_id").to_pylist(),
                    datasets=[datasets[i] for i in ok],
                    prompt_ids=taken.column("prompt_ids").cast(_IDS),
                    output_ids=taken.column("output_ids").cast(_IDS),
                    masked=pa.nulls(len(ok), _IDS),
                    provenance=taken.column("provenance"),
                )
                if not _rows_look_valid(
                    rows.sample_ids, [sources[i] for i in ok], rows.prompt_ids, rows.output_ids, vocab_size
                ):
                    for i in ok:
                        _check_row(batch.slice(i, 1).to_pylist()[0], ref, vocab_size)
                if fold is not None and turn_rows and any(sid in turn_rows for sid in rows.sample_ids):
                    rows = _fold(rows, fold, stats)
                    taken = batch.take(pa.array(rows.positions, pa.int64()))
                    if not rows.positions:
                        continue
                key = np.fromiter((shuffle_key(seed, s) for s in rows.sample_ids), np.uint64, len(rows.sample_ids))
                spilled = pa.RecordBatch.from_arrays(
                    [
                        pa.array(key),
                        pa.array([SOURCE_RANK[sources[i]] * 65_536 + index for i in rows.positions], pa.int32()),
                        pa.array(first_order + np.asarray(rows.positions, np.int64)),
                        pa.array(rows.sample_ids, pa.string()),
                        pa.array(rows.datasets, pa.string()),
                        taken.column("source"),
                        rows.prompt_ids,
                        rows.output_ids,
                        taken.column("finish_reason"),
                        rows.provenance,
                        rows.masked,
                    ],
                    schema=_BUCKET_SCHEMA,
                )
                if writer is None:
                    writer = pa.ipc.new_stream(str(path), _BUCKET_SCHEMA)
                writer.write_batch(spilled)
                keys.append(key)
                tokens.append(
                    pc.add(pc.list_value_length(rows.prompt_ids), pc.list_value_length(rows.output_ids))
                    .to_numpy()
                    .astype(np.int64)
                )
    finally:
        if writer is not None:
            writer.close()
    if not keys:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return np.concatenate(keys), np.concatenate(tokens)


class _OkRows(NamedTuple):
    """An input batch's ok rows as pass 1 spills them."""

    positions: list[int]  # their positions in the batch
    sample_ids: list[str]
    datasets: list[str]
    prompt_ids: pa.Array
    output_ids: pa.Array
    masked: pa.Array  # a trajectory record's [start, end) output spans with mask 0; null: none
    provenance: pa.Array


def _fold(rows: _OkRows, folds: Folds, stats: Stats) -> _OkRows:
    """`rows` with the trajectory folds of their input applied (`conversations.Folds.apply`):
    an earlier turn's row left out, the last usable turn's row become its trajectory's record."""
    prompts, outputs, provenance = rows.prompt_ids.to_pylist(), rows.output_ids.to_pylist(), rows.provenance.to_pylist()
    positions: list[int] = []
    datasets: list[str] = []
    out: list[TurnRow] = []
    for j, (i, sid) in enumerate(zip(rows.positions, rows.sample_ids)):
        row = folds.apply(TurnRow(sid, prompts[j], outputs[j], provenance[j]), stats[rows.datasets[j]])
        if row is not None:
            positions.append(i)
            datasets.append(rows.datasets[j])
            out.append(row)
    return _OkRows(
        positions,
        [r.sample_id for r in out],
        datasets,
        pa.array([r.prompt_ids for r in out], _IDS),
        pa.array([r.output_ids for r in out], _IDS),
        pa.array([r.masked for r in out], _IDS),
        pa.array([r.provenance for r in out], pa.string()),
    )


def _masked_within(spans: list[int] | None, room: int) -> int:
    """Output positions with mask 0 among the first `room` (what max_length leaves of the output)."""
    return sum(max(0, min(end, room) - start) for start, end in zip(spans[::2], spans[1::2])) if spans else 0


def _partition(spill: Path, keys: np.ndarray, tokens: np.ndarray, tokens_per_bucket: int, work: Path) -> list[Path]:
    """Pass 1b: split the spill into hash-range buckets of about `tokens_per_bucket` tokens each.

    The ranges are cut at exact token quantiles of the key order (known from pass 1), so a bucket
    holds its budget whatever the sample lengths; all copies of a sample share a key, so they
    share a bucket. One bucket: the spill itself is it.
    """
    if not len(keys):
        return []
    budget = max(tokens_per_bucket, -(-int(tokens.sum()) // MAX_BUCKETS))
    by_key = np.argsort(keys, kind="stable")
    before = np.cumsum(tokens[by_key]) - tokens[by_key]
    cuts = np.flatnonzero(np.diff(before // budget)) + 1
    bounds = np.unique(keys[by_key][cuts])
    if not len(bounds):
        return [spill]
    writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    with pa.OSFile(str(spill)) as f, pa.ipc.open_stream(f) as reader:  # read, not memory-mapped (see _merge_bucket)
        for batch in reader:
            bucket = np.searchsorted(bounds, batch.column("key").to_numpy(), side="right")
            for b in np.unique(bucket):
                if b not in writers:
                    writers[b] = pa.ipc.new_stream(str(work / f"bucket-{b:06d}.arrow"), _BUCKET_SCHEMA)
                writers[b].write_batch(batch.take(pa.array(np.flatnonzero(bucket == b))))
    for w in writers.values():
        w.close()
    spill.unlink()
    return [work / f"bucket-{b:06d}.arrow" for b in sorted(writers)]


def _build_records(rows: pa.Table, max_length: int) -> pa.Table:
    """MERGED records of rows that `_drop_reason` keeps: input_ids = (prompt + output)[:max_length],
    loss_mask 0 on the prompt and 1 after it but for a trajectory's `masked` spans, assembled from
    flat numpy buffers."""
    prompt, output = rows["prompt_ids"].combine_chunks(), rows["output_ids"].combine_chunks()
    p = pc.list_value_length(prompt).to_numpy().astype(np.int64)
    o = pc.list_value_length(output).to_numpy().astype(np.int64)
    length = np.minimum(p + o, max_length)
    offsets = np.zeros(len(p) + 1, np.int64)
    np.cumsum(length, out=offsets[1:])
    p_start, o_start = np.zeros_like(offsets), np.zeros_like(offsets)
    np.cumsum(p, out=p_start[1:])
    np.cumsum(o, out=o_start[1:])
    ids = np.empty(int(offsets[-1]), np.int32)
    mask = np.ones(int(offsets[-1]), np.uint8)
    # prompt token j of row r (flat index j) goes to offsets[r] + (j - p_start[r])
    dest = np.arange(int(p_start[-1])) + np.repeat(offsets[:-1] - p_start[:-1], p)
    ids[dest] = prompt.flatten().to_numpy()
    mask[dest] = 0
    # output token j of row r goes right after the prompt, while it fits in max_length
    within = np.arange(int(o_start[-1])) - np.repeat(o_start[:-1], o)
    keep = within < np.repeat(length - p, o)
    dest = (within + np.repeat(offsets[:-1] + p, o))[keep]
    ids[dest] = output.flatten().to_numpy()[keep]
    masked_out = np.zeros(len(p), np.int64)
    if rows["masked"].null_count < rows.num_rows:
        for r, spans in enumerate(rows["masked"].to_pylist()):
            room = int(length[r] - p[r])
            for start, end in zip((spans or [])[::2], (spans or [])[1::2]):
                if start < room:
                    mask[offsets[r] + p[r] + start : offsets[r] + p[r] + min(end, room)] = 0
            masked_out[r] = _masked_within(spans, room)
    list_offsets = pa.array(offsets.astype(np.int32))
    columns = {
        "input_ids": pa.ListArray.from_arrays(list_offsets, pa.array(ids), type=pa.list_(pa.int32())),
        "loss_mask": pa.ListArray.from_arrays(list_offsets, pa.array(mask), type=pa.list_(pa.uint8())),
        "prompt_tokens": pa.array(p.astype(np.int32)),
        "output_tokens": pa.array((length - p - masked_out).astype(np.int32)),
        "truncated": pa.array(p + o > max_length),
    }
    return pa.Table.from_arrays([columns[f.name] if f.name in columns else rows[f.name] for f in MERGED], schema=MERGED)


def _merge_bucket(path: Path, max_length: int, length_policy: str, stats: Stats, shards: _ShardWriter) -> None:
    """Pass 2 for one bucket: dedupe (local beats overflow, then input order), order by hash key,
    build records in small chunks and hand them to the shard writer."""
    # pa.OSFile, not the path: a path is memory-mapped, and every mapped page read stays in the
    # process's RSS, so reading the spill or a bucket that way grows RSS with the input (83k: +240 MiB)
    with pa.OSFile(str(path)) as f, pa.ipc.open_stream(f) as reader:
        table = reader.read_all().combine_chunks()
    path.unlink()
    keys, sids = table["key"].to_pylist(), table["sample_id"].to_pylist()
    datasets, sources = table["dataset"].to_pylist(), table["source"].to_pylist()
    ranks, orders = table["rank"].to_pylist(), table["order"].to_pylist()
    best: dict[str, int] = {}
    for i in sorted(range(len(sids)), key=orders.__getitem__):  # input order: the first copy is not a duplicate
        kept = best.get(sids[i])
        if kept is None or (ranks[i], orders[i]) < (ranks[kept], orders[kept]):
            best[sids[i]] = i
        if kept is not None:
            stats[datasets[i]]["duplicates"] += 1
    p_len = pc.list_value_length(table["prompt_ids"]).to_pylist()
    o_len = pc.list_value_length(table["output_ids"]).to_pylist()
    spans = table["masked"].to_pylist() if table["masked"].null_count < table.num_rows else None
    chunk: list[int] = []
    chunk_tokens = 0
    for i in sorted(best.values(), key=lambda i: (keys[i], sids[i])):
        st = stats[datasets[i]]
        reason = _drop_reason(p_len[i], o_len[i], max_length, length_policy)
        if reason:
            st[f"dropped_{reason}"] += 1
            continue
        n = min(p_len[i] + o_len[i], max_length)
        st["samples"] += 1
        st[f"source_{sources[i]}"] += 1
        st["prompt_tokens"] += p_len[i]
        st["loss_tokens"] += n - p_len[i] - (_masked_within(spans[i], n - p_len[i]) if spans else 0)
        st["tokens"] += n
        st["truncated"] += p_len[i] + o_len[i] > max_length
        st["max_tokens"] = max(st["max_tokens"], n)
        chunk.append(i)
        chunk_tokens += n
        if len(chunk) >= ROW_GROUP_ROWS or chunk_tokens >= _CHUNK_TOKENS:
            shards.add(_build_records(table.take(pa.array(chunk, pa.int64())), max_length))
            chunk, chunk_tokens = [], 0
    if chunk:
        shards.add(_build_records(table.take(pa.array(chunk, pa.int64())), max_length))


def merge_datasets(
    store: ArtifactStore,
    inputs: list[StageRef],
    out_run_key: str,
    config: MergeConfig = MergeConfig(),
    *,
    vocab_size: int,
    out_dataset: str = "all",
    context: MergeContext = MergeContext(),
) -> dict[str, Any]:
    """Merge `inputs` (schemas.GENERATIONS stages) into `runs/{out_run_key}/merge/{out_dataset}/`
    as `config` (the config's `merge`, validated there) says; its params are `merge_params(config)`.

    `vocab_size` (the tokenizer's, which is the target's LM head's: 163,840 for Kimi): an id outside
    it stops the merge naming the sample; such an id can only come from a broken engine or a
    foreign artifact, and would poison training. Required, because the draft vocabulary
    (`draft_vocab_size` tokens, draft_vocab.py), written beside the shards in both trainers'
    formats with its coverage in the manifest, maps every target id: speculators'
    `load_vocab_mappings` and SpecForge's `t2d` buffer refuse a `t2d` shorter than the LM head.

    Returns the summary also stored in the manifest's `extra`: shard refs (one dict per shard,
    what the extraction stage maps over), per-dataset token statistics and drop counts.

    One writer per output stage: the merge takes the stage's lease (or uses `context.lease`, one
    the caller already holds), so a second merge of the same run key fails at once with StageBusy
    instead of overwriting shards the first is writing; the lease is checked again right before
    the commit. `context`: also the trajectories' folds and how much memory a bucket takes.
    """
    if context.tokens_per_bucket < 1:
        raise UserError(f"tokens_per_bucket={context.tokens_per_bucket} must be positive")
    if not inputs:
        raise UserError("merge: no inputs given")
    out_ref = StageRef(out_run_key, MERGE, out_dataset)
    with nullcontext(context.lease) if context.lease is not None else store.lease(out_ref) as held:
        manifests = [store.read_manifest(ref) for ref in inputs]  # refuses incomplete inputs up front
        tokenizer_sha = _common_hash(manifests, "tokenizer_sha256")
        template_sha = _common_hash(manifests, "template_sha256")
        stats: Stats = defaultdict(Counter)

        with tempfile.TemporaryDirectory(prefix="eagle3-merge-", dir=context.work_dir) as tmp:
            work = Path(tmp)
            keys, tokens = _spill(store, inputs, config.seed, stats, work / "spill.arrow", vocab_size, context.folds)
            buckets = _partition(work / "spill.arrow", keys, tokens, context.tokens_per_bucket, work)
            del keys, tokens
            shards = _ShardWriter(store, out_ref, work, config.shard_tokens)
            for path in buckets:  # one bucket resident at a time: _merge_bucket's table dies with its call
                _merge_bucket(path, config.max_length, config.length_policy, stats, shards)
            shards.close_shard()
            vocab_files, vocab = draft_vocab.write(work, shards.trained_counts, config.draft_vocab_size, vocab_size)
            for name in vocab_files:
                store.put_file(out_ref, name, work / name)
        image_files, image_extra = [], {}
        if (found := images.merged_images(store, inputs)) is not None:  # image samples' references, by sample_id
            store.put_bytes(out_ref, images.MERGED_IMAGES_FILE, found[0])
            image_files, image_extra = [images.MERGED_IMAGES_FILE], {"images": found[1]}

        datasets = {name: dict(sorted(c.items())) for name, c in sorted(stats.items())}
        totals: Counter[str] = Counter()
        for c in stats.values():
            totals.update({k: v for k, v in c.items() if k != "max_tokens"})
        summary = {
            "ref": _ref_dict(out_ref),
            "uri": store.uri(out_ref),
            "shards": shards.shards,
            "datasets": datasets,
            "totals": dict(sorted(totals.items())),
            "draft_vocab": {**vocab, "files": vocab_files},
        }
        held.check()  # fencing: a writer whose lease was taken over commits nothing
        store.commit_files(
            out_ref,
            [s["name"] for s in shards.shards] + vocab_files + image_files,
            params=merge_params(config),
            inputs=inputs,
            tokenizer_sha256=tokenizer_sha,
            template_sha256=template_sha,
            extra={
                "shards": shards.shards,
                "datasets": datasets,
                "totals": summary["totals"],
                "draft_vocab": summary["draft_vocab"],
                **image_extra,
            },
        )
        return summary


def merge_params(config: MergeConfig) -> dict[str, Any]:
    """The merge stage's manifest params: the whole `merge` section, so a key added to it is in
    them, and a merge made under another value of it is never reused (runs.reuse)."""
    return config.model_dump(mode="json")
