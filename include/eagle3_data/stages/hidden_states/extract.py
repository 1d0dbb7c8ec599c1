"""Hidden-state extraction: merged records in, checked packed shards out.

Throughput comes from three choices: batches are cut from length-sorted samples up to a token
budget (padding waste is bounded by the length spread inside a batch, not the dataset's);
only the aux layers are captured; and a writer thread serialises and uploads finished shards
while the next batches compute. Correctness checks run on every sample before anything is
written: state rows == token count, all values finite (the error names the sample), and
per-layer norm outliers go into the summary for a person to look at.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from eagle3_data.config import HiddenStatesConfig
from eagle3_data.errors import UserError
from eagle3_data.exports.shards import Sample, dtype_name, encoding_name, resolve_storage_dtype, write_shard
from eagle3_data.forksafe import PerProcess
from eagle3_data.nucleus import Nucleus
from eagle3_data.stages import SAMPLE_MEANS, SUMMARY_SUFFIX
from eagle3_data.stages.hidden_states.backends import HiddenStateBackend
from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices
from eagle3_data.target_head.final_norm import check_norm, rms_norm
from eagle3_data.target_head.logprobs import LogprobHead, LogprobStats
from eagle3_data.target_head.verify import LogprobCheck, engine_answers

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from eagle3_data.storage import StageRef

OUTLIER_FACTOR = 8.0  # a token whose layer norm exceeds 8x that layer's shard median is reported


class CorruptHiddenStates(RuntimeError):
    """The engine returned states that must not be trained on (NaN/Inf, wrong length)."""


@dataclass
class _ShardStats:
    norms: list[torch.Tensor] = field(default_factory=list)  # per token [T, n_layers]
    owners: list[str] = field(default_factory=list)  # sample id per token block


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that (longest in batch) x (batch size) <= token_budget.

    Sorting by length first means right padding costs at most the length spread within a
    batch; a sample longer than the budget runs alone rather than being refused.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[current[0]] * (len(current) + 1) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def check_rows(rows: Sequence[dict[str, Any]], vocab_size: int) -> None:
    """Refuse bad merged records before any GPU time is spent."""
    for row in rows:
        sid, ids, mask = row.get("sample_id"), row.get("input_ids"), row.get("loss_mask")
        if not ids:
            raise UserError(f"sample {sid}: field input_ids is empty")
        if mask is None or len(mask) != len(ids):
            raise UserError(
                f"sample {sid}: field loss_mask has {None if mask is None else len(mask)} "
                f"entries for {len(ids)} input_ids"
            )
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            raise UserError(
                f"sample {sid}: field input_ids holds id {low if low < 0 else high}, "
                f"outside the model's vocabulary [0, {vocab_size})"
            )


def _check_sample(sid: str, n_tokens: int, aux: torch.Tensor, last: torch.Tensor | None) -> None:
    for name, t in (("aux_hidden_states", aux), ("last_hidden_states", last)):
        if t is None:
            continue
        if t.shape[0] != n_tokens:
            raise CorruptHiddenStates(f"sample {sid}: {name} has {t.shape[0]} rows for {n_tokens} tokens")
        if not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).any(dim=-1).nonzero().flatten()[:5].tolist()
            raise CorruptHiddenStates(f"sample {sid}: {name} holds NaN/Inf at token positions {bad}")


def _norm_report(stats: _ShardStats, layer_ids: list[int], top: int = 5) -> dict[str, Any]:
    if not stats.norms:
        return {}
    norms = torch.cat(stats.norms)  # [N, n_layers]
    owner_of = [sid for sid, block in zip(stats.owners, stats.norms) for _ in range(block.shape[0])]
    report = {}
    for j, layer in enumerate(layer_ids):
        col = norms[:, j]
        median = float(col.median())
        flagged = (col > OUTLIER_FACTOR * median).nonzero().flatten()
        worst = col[flagged].argsort(descending=True)[:top]
        report[str(layer)] = {
            "median": median,
            "max": float(col.max()),
            "outlier_tokens": int(flagged.numel()),
            "outlier_samples": sorted({owner_of[int(flagged[k])] for k in worst}),
        }
    return report


class _BackgroundWriter:
    """Serialises and ships finished shards on a thread while the model keeps computing.

    The thread, its queue and what it wrote belong to one process: a child forked while the
    writer exists starts its own on its first `put` (the parent's thread is not in it, and the
    shards the parent queued are the parent's to write)."""

    def __init__(self, write: Callable[[list[Sample], int], dict[str, Any]], depth: int = 2):
        self._write, self._depth = write, depth
        self._state = PerProcess(self._start)
        self._state.get()

    def _start(self) -> _WriterState:
        state = _WriterState(queue.Queue(maxsize=self._depth))  # bounds memory to `depth` shards
        state.thread = threading.Thread(target=self._run, args=(state,), name="hidden-state-writer", daemon=True)
        state.thread.start()
        return state

    def _run(self, state: _WriterState) -> None:
        while (item := state.queue.get()) is not None:
            if state.error is None:
                try:
                    state.results.append(self._write(*item))
                except BaseException as exc:  # re-raised in the caller's thread by put()/close()
                    state.error = exc

    def put(self, samples: list[Sample], index: int) -> None:
        state = self._state.get()
        if state.error is not None:
            raise state.error
        state.queue.put((samples, index))

    def close(self) -> list[dict[str, Any]]:
        state = self._state.get()
        state.queue.put(None)
        state.thread.join()
        if state.error is not None:
            raise state.error
        return state.results


@dataclass
class _WriterState:
    queue: queue.Queue[Any]
    thread: threading.Thread | None = None
    error: BaseException | None = None
    results: list[dict[str, Any]] = field(default_factory=list)


def extract_rows(
    backend: HiddenStateBackend,
    rows: Sequence[dict[str, Any]],
    out_dir: str | Path,
    stem: str,
    config: HiddenStatesConfig,
    on_file: Callable[[Path], None] | None = None,
    check: LogprobCheck | None = None,
    images: Mapping[str, Sequence[bytes]] | None = None,
) -> dict[str, Any]:
    """Extract states for `rows` (sample_id, input_ids, loss_mask[, prompt_tokens]) into
    `{stem}-{k:04d}.safetensors`.

    `config`: the config's `hidden_states` section, what decides the bytes (layers, last state and
    its norm, storage dtype, fp8, log-probabilities) and the forward batch and file sizes.
    `images`: sample_id -> its images' encoded bytes in prompt order, for a backend started to take
    them (`max_images`); the ids already hold each image's expanded placeholder run.

    `on_file` is called on the writer thread after each file is written (e.g. upload + delete).
    `check` (verify.py) compares each local answer's log-probabilities with the engine's own and
    raises ExtractionDisagrees after the last file, before anything marks the work done.
    """
    info = backend.describe()
    layer_ids = list(config.layer_ids or default_layer_ids(info.num_layers, config.convention))
    indices = hidden_state_indices(layer_ids, config.convention, info.num_layers)
    dtype = resolve_storage_dtype(config.storage_dtype, info.dtype)
    check_norm(config.last_hidden_norm)
    final_norm = backend.final_norm if config.last_hidden else None
    head = (
        LogprobHead(backend.final_norm, backend.lm_head, device=info.device, compute_dtype=info.dtype)
        if config.logprobs
        else None
    )
    check_rows(rows, info.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def write(samples: list[Sample], index: int) -> dict[str, Any]:
        path = out / f"{stem}-{index:04d}.safetensors"
        size = write_shard(
            path,
            samples,
            layer_ids=layer_ids,
            convention=config.convention,
            model=info.name,
            compute_dtype=info.dtype,
            dtype=dtype,
            use_fp8=config.fp8,
            backend=info.backend,
            engine=info.engine,
            last_hidden_norm=config.last_hidden_norm,
            final_norm=final_norm,
        )
        if on_file is not None:
            on_file(path)
        return {
            "name": path.name,
            "samples": len(samples),
            "tokens": sum(len(s.input_ids) for s in samples),
            "bytes": size,
        }

    writer = _BackgroundWriter(write)
    stats = _ShardStats()
    logprob_stats = LogprobStats()
    pending: list[Sample] = []
    pending_tokens = 0
    file_index = 0
    forward_seconds = 0.0
    try:
        for batch in plan_batches([len(r["input_ids"]) for r in rows], config.batch_tokens):
            t0 = time.perf_counter()
            ids = [rows[i]["input_ids"] for i in batch]
            if images:
                states = backend.forward(
                    ids,
                    indices,
                    config.last_hidden or config.logprobs,
                    images=[images.get(rows[i]["sample_id"], ()) for i in batch],
                )
            else:
                states = backend.forward(ids, indices, config.last_hidden or config.logprobs)
            forward_seconds += time.perf_counter() - t0
            for i, st in zip(batch, states):
                row = rows[i]
                sid = row["sample_id"]
                _check_sample(sid, len(row["input_ids"]), st.aux, st.last)
                token_logprobs = None
                if head is not None:
                    nucleus, answer_from = _nucleus(row)
                    token_logprobs, outside = head.token_logprobs(st.last, row["input_ids"], nucleus, answer_from)
                    logprob_stats.add(
                        sid,
                        token_logprobs,
                        row["loss_mask"],
                        row.get("source"),
                        _greedy(row),
                        row["input_ids"],
                        outside,
                        answer_from,
                    )
                    if check is not None and row.get("prompt_tokens") is not None:
                        check.observe(sid, token_logprobs, row["prompt_tokens"])
                last = st.last if config.last_hidden else None
                if last is not None and config.last_hidden_norm == "post":
                    last = rms_norm(last, *final_norm)
                stats.norms.append(st.aux.float().reshape(st.aux.shape[0], len(indices), -1).norm(dim=-1))
                stats.owners.append(sid)
                # cast now (checks ran in the compute dtype), so queued shards hold storage-size tensors;
                # fp8 quantises from the compute dtype when the shard is written
                pending.append(
                    Sample(
                        sample_id=sid,
                        input_ids=torch.as_tensor(row["input_ids"], dtype=torch.int32),
                        loss_mask=torch.as_tensor(row["loss_mask"], dtype=torch.uint8),
                        aux_hidden_states=st.aux if config.fp8 else st.aux.to(dtype),
                        last_hidden_states=last.to(dtype) if last is not None else None,
                        target_logprobs=token_logprobs,
                    )
                )
                pending_tokens += len(row["input_ids"])
            if pending_tokens >= config.shard_tokens:
                writer.put(pending, file_index)
                pending, pending_tokens, file_index = [], 0, file_index + 1
        if pending:
            writer.put(pending, file_index)
    finally:
        files = writer.close()
    if check is not None:
        check.raise_if_failed(f"{stem}: hidden-state extraction")
    tokens = sum(f["tokens"] for f in files)
    size = sum(f["bytes"] for f in files)
    return {
        "files": files,
        "samples": sum(f["samples"] for f in files),
        "tokens": tokens,
        "bytes": size,
        "bytes_per_token": size / tokens if tokens else 0.0,
        "min_bytes_per_token": len(layer_ids) * info.hidden_size * 2,
        "layer_ids": layer_ids,
        "convention": config.convention,
        "last_hidden": config.last_hidden,
        "last_hidden_norm": config.last_hidden_norm if config.last_hidden else None,
        "aux_encoding": encoding_name(dtype, config.fp8),
        "model": info.name,
        "dtype": dtype_name(dtype),
        "compute_dtype": info.dtype,
        "device": backend.describe().device,  # an engine knows its device once started
        "backend": info.backend,
        "engine": info.engine,
        "forward_seconds": forward_seconds,
        "seconds": time.perf_counter() - started,
        "norms": _norm_report(stats, layer_ids),
        "logprobs": logprob_stats.summary() if head is not None else None,
        "logprob_check": check.summary() if check is not None else None,
    }


def _greedy(row: dict[str, Any]) -> bool:
    """A calibration answer (generated at temperature 0 on both paths), by its provenance."""
    sampling = json.loads(row.get("provenance") or "{}").get("sampling") or {}
    return sampling.get("temperature") == 0


def _nucleus(row: dict[str, Any]) -> tuple[Nucleus | None, int]:
    """The nucleus the row's answer was sampled under (its provenance's sampling) and where its
    answer starts (`prompt_tokens`: the tokens after it are the generated ones); (None, 0) when it
    cannot be checked (no sampling recorded, greedy, penalties, or no answer start)."""
    if row.get("prompt_tokens") is None:
        return None, 0
    nucleus = Nucleus.of(json.loads(row.get("provenance") or "{}").get("sampling"))
    return nucleus, int(row["prompt_tokens"]) if nucleus is not None else 0


# The columns extraction reads from a merged shard (schemas.MERGED).
EXTRACT_COLUMNS = ("sample_id", "source", "input_ids", "loss_mask", "prompt_tokens", "provenance")


def check_merged_columns(where: str, names: Iterable[str]) -> None:
    """A UserError naming every column extraction reads that a merged shard lacks (Arrow would say
    only "No match for FieldRef.Name(source)")."""
    present = set(names)
    if missing := [c for c in EXTRACT_COLUMNS if c not in present]:
        from eagle3_data.schemas import MERGED

        raise UserError(
            f"{where}: missing column(s) {', '.join(missing)} (a merge stage's parquet has {', '.join(MERGED.names)})"
        )


def read_merged_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The columns extraction needs from merged parquet shards (schemas.MERGED)."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in paths:
        pf = pq.ParquetFile(str(path))
        check_merged_columns(str(path), pf.schema_arrow.names)
        rows.extend(pf.read(columns=list(EXTRACT_COLUMNS)).to_pylist())
    return rows


def _shard_ref(shard) -> tuple[StageRef, str]:
    """A merged shard as the merge summary lists it ({run_key, stage, dataset, name}) or (ref, name)."""
    from eagle3_data.storage import StageRef

    if isinstance(shard, dict):
        try:
            return StageRef(shard["run_key"], shard["stage"], shard["dataset"]), shard["name"]
        except KeyError as exc:
            raise UserError(
                f"shard {shard!r}: field {exc.args[0]} missing (expected run_key, stage, dataset, name)"
            ) from None
    ref, name = shard
    return ref, name


def summary_name(shard_name: str) -> str:
    return f"{Path(shard_name).stem}{SUMMARY_SUFFIX}"


def merged_sha256s(merge_manifest: dict[str, Any]) -> dict[str, str]:
    """The sha256 of every shard a merge manifest lists, by name: what an extraction of a shard
    is tied to (a re-merge writes new bytes under the same shard names)."""
    return {f["name"]: f["sha256"] for f in merge_manifest.get("files", [])}


def extracted(
    store, out_ref: StageRef, shard, merged_sha256: str | None, committed: set[str] | None = None
) -> dict[str, Any] | None:
    """The committed summary of `shard` if it was extracted from the bytes `merged_sha256` names,
    else None (not extracted, or extracted from an earlier merge's shard of the same name: a
    zombie worker that finished after a re-merge deleted the stage). Only a summary that is
    `extracted` is skipped on resume or committed, so no states are ever paired with other ids.
    `committed`: the caller's `store.committed_files(out_ref)`, when it has one."""
    name = summary_name(_shard_ref(shard)[1])
    if name not in (store.committed_files(out_ref) if committed is None else committed):
        return None
    summary = store.get_json(out_ref, name)
    return summary if merged_sha256 and summary.get("merged_shard", {}).get("sha256") == merged_sha256 else None


def extract_shard(
    store,
    shard,
    model_dir: str | Path,
    out_ref,
    config: HiddenStatesConfig = HiddenStatesConfig(),
    *,
    backend: HiddenStateBackend | None = None,
    work_dir: str | Path | None = None,
    merged_sha256: str | None = None,
    image_refs: Mapping[str, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Extract one merged shard into `out_ref` (the DAG maps this over the merge's shards).

    Resumable by shard: a shard whose summary was committed by an earlier attempt from the same
    merged bytes (`merged_sha256`: the merge manifest's, read here unless given) is skipped.
    Each output file is uploaded by the writer thread as soon as it is written, then deleted
    locally, so local disk holds at most a couple of output files. Call `commit_extraction`
    once all shards are done.
    """
    import tempfile

    from eagle3_data.stages.hidden_states.backends import TransformersBackend
    from eagle3_data.storage import IncompleteStage

    merged_ref, name = _shard_ref(shard)
    merge_manifest = store.read_manifest(merged_ref)
    merged_sha256 = merged_sha256 or merged_sha256s(merge_manifest).get(name)
    if merged_sha256 is None:
        raise IncompleteStage(f"{store.uri(merged_ref, name)} is not in its merge's manifest")
    if (done := extracted(store, out_ref, shard, merged_sha256)) is not None:
        return {**done, "skipped": True}
    # One writer per shard, not per stage: the GPU workers of one stage extract different shards in
    # parallel, while a second writer of the same shard (a zombie and its retry) gets StageBusy.
    with store.lease(out_ref, scope=Path(name).stem) as lease:
        if (done := extracted(store, out_ref, shard, merged_sha256)) is not None:  # done by the writer before us
            return {**done, "skipped": True}
        backend = backend or TransformersBackend(model_dir)
        with tempfile.TemporaryDirectory(prefix="eagle3-extract-", dir=work_dir) as tmp:
            local = store.get_file(
                merged_ref, name, Path(tmp) / name, sha256=merged_sha256
            )  # a merge rewriting it: refused
            rows = read_merged_rows([local])
            local.unlink()
            if image_refs is None:  # a worker extracting several shards reads the merge's index once
                from eagle3_data.images import read_merged_images

                image_refs = read_merged_images(store, merged_ref)
            rows, images, left_out = _images_for(store, image_refs, rows, backend, merged_ref)

            def upload(path: Path) -> None:
                lease.check()  # fencing: a writer whose lease was taken over uploads nothing more
                store.put_file(out_ref, path.name, path)
                path.unlink()

            check = None
            if config.logprobs:
                datasets = (merge_manifest.get("extra") or {}).get("datasets") or {}
                answers, skipped = engine_answers(store, merged_ref.run_key, datasets, {r["sample_id"] for r in rows})
                check = LogprobCheck.for_dtype(answers, backend.describe().dtype, skipped)
            summary = extract_rows(
                backend, rows, Path(tmp) / "out", Path(name).stem, config, on_file=upload, check=check, images=images
            )
        summary["left_out"] = left_out
        summary["merged_shard"] = {
            "run_key": merged_ref.run_key,
            "stage": merged_ref.stage,
            "dataset": merged_ref.dataset,
            "name": name,
            "sha256": merged_sha256,
        }
        lease.check()
        store.put_json(out_ref, summary_name(name), summary)  # last: its presence marks the shard done
    return summary


def _images_for(
    store, refs: Mapping[str, list[dict[str, Any]]], rows: list[dict[str, Any]], backend, merged_ref
) -> tuple[list[dict[str, Any]], dict[str, list[bytes]] | None, dict[str, Any]]:
    """The shard's image samples: their bytes (read and hash-checked once) for a backend started
    to take images (`hidden_states.max_images` > 0), else the samples left out, counted and named,
    never extracted over their ids alone (states without the pixels are not the model's)."""
    from eagle3_data.images import ImageError, read_image

    mine = {r["sample_id"]: refs[r["sample_id"]] for r in rows if r["sample_id"] in refs}
    if not mine:
        return rows, None, {}
    if getattr(backend, "max_images", 0) > 0:
        found: dict[str, list[bytes]] = {}
        for sid, rs in mine.items():
            try:
                found[sid] = [read_image(store, ref) for ref in rs]
            except ImageError as exc:
                raise UserError(f"sample {sid}: field 'images': {exc}") from None
        return rows, found, {}
    log.warning(
        "%s: %d image samples left out of extraction: the %s backend was not started for images "
        "(hidden_states.max_images)",
        merged_ref.path,
        len(mine),
        backend.describe().backend,
    )
    return (
        [r for r in rows if r["sample_id"] not in mine],
        None,
        {
            "image_samples": len(mine),
            "sample_ids": sorted(mine)[:20],
            "reason": "the backend was not started for images (hidden_states.max_images: 0, or a text-only backend)",
        },
    )


def _logprob_totals(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' log-probability figures added up: the target's mean over every trained token,
    and what the self-check compared (verify.py)."""
    stats = [s["logprobs"] for s in summaries if s.get("logprobs")]
    checks = [s["logprob_check"] for s in summaries if s.get("logprob_check")]
    out: dict[str, Any] = {}
    means: dict[str, list[float]] = {}
    if stats:
        sources: dict[str, dict[str, Any]] = {}
        for x in stats:
            for source, side in x["sources"].items():
                acc = sources.setdefault(
                    source,
                    {
                        "samples": 0,
                        "trained_tokens": 0,
                        "sum_trained_logprob": 0.0,
                        "histogram": [0] * len(side["histogram"]),
                        "least_likely_samples": [],
                    },
                )
                means.setdefault(source, []).extend(side.get("sampled_means") or [])
                for k in ("samples", "trained_tokens", "sum_trained_logprob"):
                    acc[k] += side[k]
                acc["histogram"] = [a + b for a, b in zip(acc["histogram"], side["histogram"])]
                acc["least_likely_samples"] = sorted(
                    acc["least_likely_samples"] + side["least_likely_samples"], key=lambda w: w["mean_logprob"]
                )[:5]
                if (nucleus := side.get("nucleus")) is not None:
                    n = acc.setdefault("nucleus", {"samples": 0, "tokens": 0, "outside": 0, "samples_outside": []})
                    for k in ("samples", "tokens", "outside"):
                        n[k] += nucleus[k]
                    n["samples_outside"] = sorted(n["samples_outside"] + nucleus["samples_outside"])[
                        : LogprobStats.SHOWN_OUTSIDE
                    ]
        for acc in sources.values():
            acc["mean_trained_logprob"] = (
                acc["sum_trained_logprob"] / acc["trained_tokens"] if acc["trained_tokens"] else None
            )
        tokens = sum(x["trained_tokens"] for x in stats)
        out["logprobs"] = {
            "trained_tokens": tokens,
            "mean_trained_logprob": sum(x["sum_trained_logprob"] for x in stats) / tokens if tokens else None,
            "histogram_edges": stats[0]["histogram_edges"],
            "sources": sources,
        }
        out["sampled_means"] = means  # written beside the shards (SAMPLE_MEANS), not into the manifest
    if checks:
        skipped: dict[str, int] = {}
        for c in checks:
            for k, v in c["not_compared"].items():
                skipped[k] = skipped.get(k, 0) + v
        out["logprob_check"] = {
            "compared_samples": sum(c["compared_samples"] for c in checks),
            "compared_tokens": sum(c["compared_tokens"] for c in checks),
            "worst_mean_abs_diff": max(c["worst_mean_abs_diff"] for c in checks),
            "tolerance": checks[0]["tolerance"],
            "not_compared": skipped,
        }
    return out


def commit_extraction(store, merge_ref, out_ref, *, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the extraction manifest once every merged shard has its summary; refuse otherwise."""
    with store.lease(out_ref) as lease:  # one committer per stage (shard writers hold shard leases)
        return _commit_extraction(store, merge_ref, out_ref, params, lease)


def _commit_extraction(store, merge_ref, out_ref, params: dict[str, Any] | None, lease) -> dict[str, Any]:
    from eagle3_data.runs.upstream import merged_shards
    from eagle3_data.storage import IncompleteStage

    manifest = store.read_manifest(merge_ref)
    shards, shas = merged_shards(store, merge_ref, manifest), merged_sha256s(manifest)
    committed = store.committed_files(out_ref)
    found = {s["name"]: extracted(store, out_ref, s, shas.get(s["name"]), committed) for s in shards}
    missing = [name for name, summary in found.items() if summary is None]
    if missing:
        raise IncompleteStage(
            f"{store.uri(out_ref)}: {len(missing)} merged shards not extracted yet "
            f"(or extracted from an earlier merge): {missing[:5]}"
        )
    summaries = list(found.values())
    files = [f["name"] for s in summaries for f in s["files"]] + [summary_name(s["name"]) for s in shards]
    first = summaries[0] if summaries else {}
    totals = {
        "samples": sum(s["samples"] for s in summaries),
        "left_out_image_samples": sum((s.get("left_out") or {}).get("image_samples", 0) for s in summaries),
        "tokens": sum(s["tokens"] for s in summaries),
        "bytes": sum(s["bytes"] for s in summaries),
    }
    keys = (
        "layer_ids",
        "convention",
        "last_hidden",
        "last_hidden_norm",
        "aux_encoding",
        "model",
        "dtype",
        "compute_dtype",
        "min_bytes_per_token",
        "backend",
    )
    mixed = [k for k in keys if len({json.dumps(s.get(k)) for s in summaries}) > 1]
    if mixed:
        raise UserError(f"{store.uri(out_ref)}: shards were extracted with different {mixed}; re-extract them alike")
    logprob_totals = _logprob_totals(summaries)
    if (means := logprob_totals.pop("sampled_means", None)) is not None:
        store.put_json(out_ref, SAMPLE_MEANS, means)
        files.append(SAMPLE_MEANS)
    extra = {
        **{k: first.get(k) for k in keys},
        "totals": totals,
        **logprob_totals,
        "engines": sorted({s.get("engine") or "" for s in summaries}),
        "bytes_per_token": totals["bytes"] / totals["tokens"] if totals["tokens"] else 0.0,
    }
    lease.check()
    store.commit_files(out_ref, files, params=params, inputs=[merge_ref], extra=extra)
    return {"uri": store.uri(out_ref), **extra}
