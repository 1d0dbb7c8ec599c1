"""Stage 4, reconstruction: overflow rows (text only) -> output_ids in the model's own format,
one batched encode. Waits for both generation stages (the gate compares them)."""

from __future__ import annotations

from typing import Any

from eagle3_data.runs.results import ReconstructResult
from eagle3_data.runs.reuse import settle
from eagle3_data.runs.run import Run, bulk_tokenizer_for, log, output_format, stage_ref, tokenizer_hashes
from eagle3_data.stages import OVERFLOW, RECONSTRUCT
from eagle3_data.storage.writer import StageWriter


def reconstruct(run: Run, store, dataset: str) -> ReconstructResult:
    """Rebuild the ids of the dataset's overflow answers. A row that cannot be used (malformed:
    `row_to_reconstruct` names the field; or text that cannot determine the ids) is kept in the
    stage as `unreconstructable` (it was paid for: the billing check sees it) and listed in
    `rejects.parquet` beside the parts; the rejects are logged per reason. Rows in, none usable:
    the stage fails before its manifest."""
    from eagle3_data.errors import UserError
    from eagle3_data.reconstruction import reconstruct_rows, row_to_reconstruct
    from eagle3_data.rejects import REJECTS_FILE, field_of, format_rejects, reject, rejects_parquet, require_accepted

    src, ref = stage_ref(run, OVERFLOW, dataset), stage_ref(run, RECONSTRUCT, dataset)
    tokenizer = bulk_tokenizer_for(run, store)  # encodes only: no chat template needed
    hashes = tokenizer_hashes(tokenizer)
    params = {"thinking": run.config.generation.sampling.thinking, **hashes}
    if (manifest := settle(run, store, ref, [src], params, what=f"reconstruct {dataset}")) is not None:
        return ReconstructResult(uri=store.uri(ref), rows=manifest["rows"], reused=True)
    fmt = output_format(run, store, template=False)
    counts = {"ok": 0, "failed": 0, "unreconstructable": 0, "rejected": 0, "literal_special_text": 0}
    rejects: list[dict[str, Any]] = []
    source, line, read = store.uri(src), 0, 0
    with StageWriter(
        store, ref, "generations", rows_per_part=1024, params=params, inputs=[src], fresh=True, **hashes
    ) as w:
        for batch in store.iter_batches(src):
            rows = batch.to_pylist()
            todo, lines, out = [], {}, []
            for r in rows:
                line += 1
                if r["status"] != "ok":
                    continue
                read += 1
                try:
                    todo.append(row_to_reconstruct(fmt, r, f"{source} row {line}"))
                    lines[r["sample_id"]] = line
                except UserError as exc:  # a malformed row: rejected, the others go on
                    why = (
                        str(exc).split("): ", 1)[-1] if "(sample_id " in str(exc) else str(exc)
                    )  # row/sample: own columns
                    rejects.append(reject(dataset, source, line, field_of(why), why, {"sample_id": r["sample_id"]}))
                    out.append({**r, "status": "unreconstructable", "error": f"rejected: {exc}"})
                    counts["rejected"] += 1
            by_id = {r["sample_id"]: r for r in rows if r["status"] == "ok"}
            for item, ids in reconstruct_rows(fmt, todo):
                counts["literal_special_text"] += bool(item.literal_special)  # special-token names as text
                if item.unreconstructable:  # text cannot determine the ids: kept for the billing report, never merged
                    out.append(
                        {
                            **by_id[item.sample_id],
                            "status": "unreconstructable",
                            "error": f"unreconstructable: {item.unreconstructable}",
                        }
                    )
                    rejects.append(
                        reject(
                            dataset,
                            source,
                            lines[item.sample_id],
                            field_of(item.unreconstructable, "output"),
                            f"unreconstructable: {item.unreconstructable}",
                            {"sample_id": item.sample_id},
                        )
                    )
                    counts["unreconstructable"] += 1
                else:
                    out.append({**by_id[item.sample_id], "output_ids": ids})
                    counts["ok"] += 1
            out += [r for r in rows if r["status"] != "ok"]
            counts["failed"] += sum(r["status"] != "ok" for r in rows)
            w.write(out)
        store.put_bytes(ref, REJECTS_FILE, rejects_parquet(rejects))
        (log.warning if rejects else log.info)("%s", format_rejects(rejects, read, f"reconstruct {dataset}"))
        require_accepted(counts["ok"], read, rejects, f"reconstruct {dataset}", store.uri(ref, REJECTS_FILE))
        manifest = w.commit(extra={"counts": counts}, files=[REJECTS_FILE])
    return ReconstructResult(uri=store.uri(ref), rows=manifest["rows"], reused=False)
