"""Merge validated generations of all datasets into shuffled, sharded training records.

A record is `input_ids = prompt_ids + output_ids` with `loss_mask` aligned to it, unshifted:
0 on every prompt token, 1 on every generated token (the trainer does the next-token shift).
The final `<|im_end|>` of a finished answer is a generated token and keeps mask 1: the target
emits it, so a drafter that predicts it saves a verification step at every turn end.
Generations cut by the engine (`finish_reason == "length"`) keep mask 1 on all their tokens:
they are true target outputs that simply have no end token. Rows cut here by `max_length`
are marked `truncated`.

Memory is bounded whatever the input size: pass 1 streams every input and appends each row to
one of B local bucket files chosen by a seeded 64-bit hash of its sample_id (a range partition
of the hash, so all copies of a sample land in the same bucket); pass 2 loads one bucket at a
time, dedupes it, and sorts it by the hash. B = ceil(rows / rows_per_bucket), so resident
memory is about `rows_per_bucket` records plus one output shard being written. Because the
buckets partition the hash range, the output order is the global hash order: it depends on the
seed and the sample ids only, not on input order or bucket count.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.errors import UserError
from eagle3_data.schemas import MERGED
from eagle3_data.storage import ArtifactStore, StageRef

MERGE_STAGE = "merge"
SOURCE_RANK = {"sglang": 0, "openrouter": 1}  # local ground truth beats reconstruction
LENGTH_POLICIES = ("truncate", "drop")
_COLUMNS = ["sample_id", "dataset", "source", "status", "prompt_ids", "output_ids", "finish_reason", "provenance"]
_BUCKET_SCHEMA = pa.schema(
    [
        ("key", pa.uint64()),
        ("rank", pa.int32()),  # source rank, then input order: the dedupe preference
        ("order", pa.int64()),
        ("sample_id", pa.string()),
        ("dataset", pa.string()),
        ("source", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),
        ("finish_reason", pa.string()),
        ("provenance", pa.string()),
    ]
)


def shuffle_key(seed: int, sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{sample_id}".encode(), digest_size=8).digest(), "big")


def build_record(row: dict, max_length: int, length_policy: str) -> tuple[dict | None, str | None]:
    """The training record of one generation, or (None, reason) when the policy drops it."""
    prompt, output = list(row["prompt_ids"]), list(row["output_ids"])
    if not output:
        return None, "empty_output"
    ids = prompt + output
    mask = [0] * len(prompt) + [1] * len(output)
    truncated = len(ids) > max_length
    if truncated:
        if length_policy == "drop":
            return None, "too_long"
        ids, mask = ids[:max_length], mask[:max_length]
        if len(prompt) >= max_length:
            return None, "prompt_too_long"
    return {
        "sample_id": row["sample_id"],
        "dataset": row["dataset"],
        "source": row["source"],
        "input_ids": ids,
        "loss_mask": mask,
        "prompt_tokens": len(prompt),
        "output_tokens": sum(mask),
        "truncated": truncated,
        "finish_reason": row["finish_reason"],
        "provenance": row["provenance"],
    }, None


def _check_row(row: dict, ref: StageRef) -> None:
    sid = row.get("sample_id")
    if not sid:
        raise UserError(f"{ref.path}: a row has no sample_id")
    if row.get("source") not in SOURCE_RANK:
        raise UserError(f"{ref.path}: sample {sid}: field source is {row.get('source')!r}, expected sglang or openrouter")
    for field in ("prompt_ids", "output_ids"):
        ids = row.get(field)
        if ids is None:
            raise UserError(f"{ref.path}: sample {sid}: field {field} is missing on a row with status ok")
        if ids and min(ids) < 0:
            raise UserError(f"{ref.path}: sample {sid}: field {field} holds a negative token id")
    if not row.get("prompt_ids"):
        raise UserError(f"{ref.path}: sample {sid}: field prompt_ids is empty")


def _common_hash(manifests: list[dict], field: str) -> str | None:
    values = {m.get(field) for m in manifests} - {None}
    if len(values) > 1:
        raise UserError(f"inputs disagree on {field} ({sorted(values)}): ids from different tokenizers/templates "
                        "cannot be merged into one training set")
    return values.pop() if values else None


class _ShardWriter:
    """Parquet shards of about `shard_tokens` tokens each, uploaded as they close."""

    def __init__(self, store: ArtifactStore, ref: StageRef, work: Path, shard_tokens: int):
        self.store, self.ref, self.work, self.shard_tokens = store, ref, work, shard_tokens
        self.shards: list[dict] = []
        self._rows: list[dict] = []
        self._tokens = 0
        self._writer: pq.ParquetWriter | None = None
        self._path: Path | None = None
        self._samples = 0

    def add(self, record: dict) -> None:
        if self._writer is None:
            self._path = self.work / f"shard-{len(self.shards):05d}.parquet"
            self._writer = pq.ParquetWriter(str(self._path), MERGED)
        self._rows.append(record)
        self._tokens += len(record["input_ids"])
        self._samples += 1
        if len(self._rows) >= 1024:
            self._flush_rows()
        if self._tokens >= self.shard_tokens:
            self.close_shard()

    def _flush_rows(self) -> None:
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=MERGED))
            self._rows = []

    def close_shard(self) -> None:
        if self._writer is None:
            return
        self._flush_rows()
        self._writer.close()
        self.store.put_file(self.ref, self._path.name, self._path)
        self.shards.append({**_ref_dict(self.ref), "name": self._path.name, "samples": self._samples, "tokens": self._tokens})
        self._path.unlink()
        self._writer, self._tokens, self._samples = None, 0, 0


def _ref_dict(ref: StageRef) -> dict:
    return {"run_key": ref.run_key, "stage": ref.stage, "dataset": ref.dataset}


def merge_datasets(
    store: ArtifactStore,
    inputs: list[StageRef],
    out_run_key: str,
    *,
    max_length: int = 4096,
    length_policy: str = "truncate",
    shard_tokens: int = 1 << 20,
    seed: int = 0,
    out_dataset: str = "all",
    rows_per_bucket: int = 50_000,
    work_dir: str | Path | None = None,
) -> dict:
    """Merge `inputs` (schemas.GENERATIONS stages) into `runs/{out_run_key}/merge/{out_dataset}/`.

    Returns the summary also stored in the manifest's `extra`: shard refs (one dict per shard,
    what the extraction stage maps over), per-dataset token statistics and drop counts.
    """
    if length_policy not in LENGTH_POLICIES:
        raise UserError(f"length_policy {length_policy!r}: expected one of {', '.join(LENGTH_POLICIES)}")
    if max_length < 2 or shard_tokens < 1:
        raise UserError(f"max_length={max_length} and shard_tokens={shard_tokens} must be positive (max_length >= 2)")
    if not inputs:
        raise UserError("merge: no inputs given")
    out_ref = StageRef(out_run_key, MERGE_STAGE, out_dataset)
    manifests = [store.read_manifest(ref) for ref in inputs]  # refuses incomplete inputs up front
    tokenizer_sha = _common_hash(manifests, "tokenizer_sha256")
    template_sha = _common_hash(manifests, "template_sha256")
    total_rows = sum(m.get("rows", 0) for m in manifests)
    n_buckets = max(1, math.ceil(total_rows / rows_per_bucket))
    stats: dict[str, Counter] = defaultdict(Counter)

    with tempfile.TemporaryDirectory(prefix="eagle3-merge-", dir=work_dir) as tmp:
        work = Path(tmp)
        writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
        order = 0
        for index, ref in enumerate(inputs):
            for batch in store.iter_batches(ref, columns=_COLUMNS):
                by_bucket: dict[int, list[dict]] = defaultdict(list)
                for row in batch.to_pylist():
                    dataset = row.get("dataset") or ref.dataset
                    row["dataset"] = dataset
                    order += 1
                    if row.get("status") != "ok":  # failed, or unreconstructable (text cannot determine the ids)
                        kind = "unreconstructable" if row.get("status") == "unreconstructable" else "failed"
                        stats[dataset][f"{kind}_{row.get('source') or 'unknown'}"] += 1
                        continue
                    _check_row(row, ref)
                    key = shuffle_key(seed, row["sample_id"])
                    row.update(key=key, rank=SOURCE_RANK[row["source"]] * 65_536 + index, order=order)
                    by_bucket[(key * n_buckets) >> 64].append(row)
                for bucket, rows in by_bucket.items():
                    if bucket not in writers:
                        writers[bucket] = pa.ipc.new_stream(str(work / f"bucket-{bucket:06d}.arrow"), _BUCKET_SCHEMA)
                    writers[bucket].write_batch(pa.RecordBatch.from_pylist(rows, schema=_BUCKET_SCHEMA))
        for w in writers.values():
            w.close()

        shards = _ShardWriter(store, out_ref, work, shard_tokens)
        for bucket in sorted(writers):
            path = work / f"bucket-{bucket:06d}.arrow"
            with pa.ipc.open_stream(str(path)) as reader:
                rows = reader.read_all().to_pylist()
            path.unlink()
            best: dict[str, dict] = {}
            for row in rows:
                kept = best.get(row["sample_id"])
                if kept is None or (row["rank"], row["order"]) < (kept["rank"], kept["order"]):
                    best[row["sample_id"]] = row
                if kept is not None:
                    stats[row["dataset"]]["duplicates"] += 1
            for row in sorted(best.values(), key=lambda r: (r["key"], r["sample_id"])):
                record, reason = build_record(row, max_length, length_policy)
                st = stats[row["dataset"]]
                if record is None:
                    st[f"dropped_{reason}"] += 1
                    continue
                st["samples"] += 1
                st[f"source_{record['source']}"] += 1
                st["prompt_tokens"] += record["prompt_tokens"]
                st["loss_tokens"] += record["output_tokens"]
                st["tokens"] += len(record["input_ids"])
                st["truncated"] += record["truncated"]
                st["max_tokens"] = max(st["max_tokens"], len(record["input_ids"]))
                shards.add(record)
        shards.close_shard()

    datasets = {name: dict(sorted(c.items())) for name, c in sorted(stats.items())}
    totals = Counter()
    for c in stats.values():
        totals.update({k: v for k, v in c.items() if k != "max_tokens"})
    summary = {
        "ref": _ref_dict(out_ref),
        "uri": store.uri(out_ref),
        "shards": shards.shards,
        "datasets": datasets,
        "totals": dict(sorted(totals.items())),
    }
    params = {"max_length": max_length, "length_policy": length_policy, "shard_tokens": shard_tokens, "seed": seed}
    store.commit_files(out_ref, [s["name"] for s in shards.shards], params=params, inputs=inputs,
                       tokenizer_sha256=tokenizer_sha, template_sha256=template_sha,
                       extra={"shards": shards.shards, "datasets": datasets, "totals": summary["totals"]})
    return summary


def merged_shards(store: ArtifactStore, ref: StageRef) -> list[dict]:
    """The shard refs of a committed merge stage, from its manifest (never from a listing)."""
    return list(store.read_manifest(ref).get("extra", {}).get("shards", []))

