"""Stage 4, reconstruction: overflow rows (text only) -> output_ids in the model's own format,
one batched encode. Waits for both generation stages (the gate compares them)."""

from __future__ import annotations

from eagle3_data.pipeline.results import ReconstructResult
from eagle3_data.pipeline.reuse import reusable
from eagle3_data.pipeline.run import Run, bulk_tokenizer_for, output_format, stage_ref, tokenizer_hashes
from eagle3_data.stages import OVERFLOW, RECONSTRUCT


def reconstruct(run: Run, store, dataset: str) -> ReconstructResult:
    from eagle3_data.reconstruct import reconstruct_rows, row_to_reconstruct

    src, ref = stage_ref(run, OVERFLOW, dataset), stage_ref(run, RECONSTRUCT, dataset)
    tokenizer = bulk_tokenizer_for(run, store)  # encodes only: no chat template needed
    hashes = tokenizer_hashes(tokenizer)
    params = {"thinking": run.config.generation.sampling.thinking, **hashes}
    if (manifest := reusable(store, ref, [src], params)) is not None:
        return ReconstructResult(uri=store.uri(ref), rows=manifest["rows"], reused=True)
    fmt, counts = output_format(run, store, template=False), {"ok": 0, "failed": 0, "unreconstructable": 0, "literal_special_text": 0}
    with store.writer(ref, "generations", rows_per_part=1024, params=params, inputs=[src], fresh=True, **hashes) as w:
        for batch in store.iter_batches(src):
            rows = batch.to_pylist()
            ok = [r for r in rows if r["status"] == "ok"]
            todo = [row_to_reconstruct(fmt, r, store.uri(src)) for r in ok]
            by_id = {r["sample_id"]: r for r in ok}
            out = []
            for item, ids in reconstruct_rows(fmt, todo):
                counts["literal_special_text"] += bool(item.literal_special)  # special-token names as text
                if item.unreconstructable:  # text cannot determine the ids: kept for the billing report, never merged
                    out.append({**by_id[item.sample_id], "status": "unreconstructable", "error": f"unreconstructable: {item.unreconstructable}"})
                    counts["unreconstructable"] += 1
                else:
                    out.append({**by_id[item.sample_id], "output_ids": ids})
                    counts["ok"] += 1
            out += [r for r in rows if r["status"] != "ok"]
            counts["failed"] += len(rows) - len(ok)
            w.write(out)
        manifest = w.commit(extra={"counts": counts})
    return ReconstructResult(uri=store.uri(ref), rows=manifest["rows"], reused=False)
