"""Stage 5a, the policy check's scoring (eagle3_data.stages.policy): after reconstruction, before the gate.

The local engine (the endpoints local generation used) scores sampled overflow answers on their
reconstructed ids and as many sampled local answers on their rebuilt ids, and the calibration
pairs (one prompt answered greedily on both paths) on both sides. How many sampled answers: a
pilot of `policy.pilot_samples` a side measures the spread of the samples' mean log-probabilities;
the sample then grows to what the dataset's `validation.policy_shift_nats` needs at
`policy_power` and `policy_false_alarm_rate` (`compare.required_samples`), at most
`policy.max_samples` a side. The figures are committed with the scored samples, and the validate
stage's gate decides on them with the same settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from eagle3_data.errors import UserError
from eagle3_data.runs.results import PolicyResult
from eagle3_data.runs.reuse import settle
from eagle3_data.runs.run import Run, bulk_tokenizer_for, log, output_format, stage_ref, tokenizer_hashes
from eagle3_data.runs.upstream import row_routes, table_rows
from eagle3_data.stages import LOCAL, POLICY, POLICY_REPORT, RECONSTRUCT, SCORES_FILE
from eagle3_data.storage.writer import StageWriter

if TYPE_CHECKING:
    from eagle3_data.nucleus import Item
    from eagle3_data.storage.store import ArtifactStore


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_data.schemas import POLICY_SCORES

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=POLICY_SCORES), buf)
    return buf.getvalue()


def score_policy(
    run: Run, store: ArtifactStore, dataset: str, endpoints: list[str], api_key: str | None = None
) -> PolicyResult:
    """Score the dataset's sample on the local engine's `endpoints` (http(s) URLs; `api_key`: theirs,
    sent on every request when given, never logged) and commit the figures (`policy.json` beside the
    scored rows; `sizing`: the pilot, its spreads, the sample size they call for, how many were
    available; `compare.sample_size`). No overflow answers, or `policy.max_samples` 0: committed as
    skipped, no request sent. When the run's sampling has a nucleus (`Nucleus.of`: top_p < 1 or a
    top_k), each sampled item's request also asks for the `policy.top_logprobs` likeliest ids at every
    position, and the answer tokens provably outside the nucleus are counted per side (`nucleus`:
    samples, tokens, outside; `nucleus_rule`: how): the gate runs the nucleus test on them (nucleus,
    policy_check). The calibration answers (greedy on both paths) are always counted, their tokens off
    the target's argmax (`greedy`, `off_argmax`): the greedy test."""
    from eagle3_data.engines import wire_for
    from eagle3_data.engines.client import Media, read_media
    from eagle3_data.images import parse_refs
    from eagle3_data.nucleus import Nucleus, nucleus_counts
    from eagle3_data.policy_check import Thresholds, sample_size, worst_samples
    from eagle3_data.policy_check import rows as score_rows
    from eagle3_data.stages.policy import ScoreEndpoints, local_items, overflow_items, score_items, summarize
    from eagle3_data.stages.policy.select import Selection, has_images

    local, rebuilt, ref = (stage_ref(run, s, dataset) for s in (LOCAL, RECONSTRUCT, POLICY))
    tokenizer = bulk_tokenizer_for(run, store)
    hashes = tokenizer_hashes(tokenizer)
    cfg = run.config.policy
    th = Thresholds.from_config(run.config.dataset(dataset).validation)
    nucleus = Nucleus.of(run.config.generation.sampling.model_dump())
    # image prompts are scored with their images where the local engines take them, else left out
    with_images = run.config.generation.local.images
    params = {
        "pilot_samples": cfg.pilot_samples,
        "max_samples": cfg.max_samples,
        "seed": cfg.seed,
        "thresholds": vars(th),
        "engine": run.config.generation.local.engine,
        "nucleus": {"top_logprobs": cfg.top_logprobs, "logit_margin": cfg.nucleus_logit_margin} if nucleus else None,
        "greedy": {"top_logprobs": 1, "logit_margin": cfg.nucleus_logit_margin, "max_gap": cfg.greedy_max_gap},
        "thinking": run.config.generation.sampling.thinking,
        **({"score_images": True} if with_images else {}),  # absent otherwise: earlier manifests stay reusable
        **hashes,
    }
    if (manifest := settle(run, store, ref, [local, rebuilt], params, what=f"score_policy {dataset}")) is not None:
        extra = manifest["extra"]
        return PolicyResult(
            uri=store.uri(ref), scored=extra["scored"], gap_nats_per_token=extra["gap_nats_per_token"], reused=True
        )
    routes = row_routes(run, store, dataset)
    scored_columns = ["sample_id", "status", "prompt_ids", "output_ids", "images"]
    columns = [*scored_columns, "finish_reason", "provenance", "tools", "messages"]
    pairs = cfg.max_samples
    n = min(cfg.pilot_samples, cfg.max_samples)
    over = overflow_items(
        table_rows(store, rebuilt, scored_columns), routes, Selection(n, cfg.seed, pairs, with_images)
    )
    items: list[Item] = []
    scores: list[list[float] | None] = []
    left_out = {  # select.has_images
        side: 0 if with_images else sum(has_images(r) for r in table_rows(store, stage, ["images"]))
        for side, stage in (("local", local), ("overflow", rebuilt))
    }
    if cfg.max_samples == 0 or not over:
        summary: dict[str, Any] = {
            "skipped": "policy.max_samples is 0"
            if cfg.max_samples == 0
            else "no overflow answers"
            + (f" to text prompts ({left_out['overflow']} to image prompts left out)" if left_out["overflow"] else ""),
            "image_samples_left_out": left_out,
        }
    elif not endpoints:
        raise UserError(f"score_policy {dataset}: no local endpoints configured to score on")
    else:
        fmt = output_format(run, store, template=False)
        wire = wire_for(run.config.generation.local.engine, api_key)
        refused: dict[str, str] = {}
        done: dict[tuple[str, str, tuple[int, ...]], tuple[list[float] | None, int | None]] = {}

        def media(item: Item) -> Media:
            """An image item's images as its generation sent them (each stored object verified)."""
            return read_media(store, parse_refs(item.images), fmt.media_pad_id)

        def at(n: int) -> tuple[list[Item], list[list[float] | None], list[int | None]]:
            """The items at `n` sampled answers a side (and the pairs), scoring only the new ones:
            the items, their log-probabilities, their answer tokens outside the nucleus."""
            sel = Selection(n, cfg.seed, pairs, with_images)
            items = overflow_items(table_rows(store, rebuilt, scored_columns), routes, sel) + local_items(
                fmt, table_rows(store, local, columns), routes, sel, len(tokenizer)
            )
            todo = [it for it in items if (it.side, it.sample_id, it.ids) not in done]
            got, more, far = score_items(todo, ScoreEndpoints(endpoints, wire), cfg, nucleus, len(tokenizer), media)
            done.update({(it.side, it.sample_id, it.ids): sf for it, sf in zip(todo, zip(got, far))})
            refused.update(more)
            results = [done[(it.side, it.sample_id, it.ids)] for it in items]
            return items, [r[0] for r in results], [r[1] for r in results]

        items, scores, outside = at(n)  # the pilot
        sizing = sample_size(th, summarize(items, scores, {}), n, cfg.max_samples)
        if sizing["chosen"] > n:
            items, scores, outside = at(sizing["chosen"])
        sizing["available"] = {side: sum(r == side for r in routes.values()) for side in ("local", "overflow")}
        summary = {
            **summarize(items, scores, refused),
            "sizing": sizing,
            "image_samples_left_out": left_out,
            "worst": worst_samples(items, scores, tokenizer.decode),
        }
        rule = {
            "top_logprobs": cfg.top_logprobs,
            "logit_margin": cfg.nucleus_logit_margin,
            "vocab_size": len(tokenizer),
        }
        if nucleus is not None:
            summary["nucleus"] = nucleus_counts(items, outside)
            summary["nucleus_rule"] = {**rule, **vars(nucleus)}
        summary["greedy"] = nucleus_counts(items, outside, greedy=True)
        summary["greedy_rule"] = {**rule, "top_logprobs": 1, "max_gap": cfg.greedy_max_gap}
    # the scored samples as a file beside the (empty) parts: a calibration sample is scored on
    # both sides under one sample_id, which the parts (one row per sample_id) cannot hold
    with StageWriter(
        store,
        ref,
        "policy_scores",
        rows_per_part=4096,
        params=params,
        inputs=[local, rebuilt],
        fresh=True,
        tokenizer_sha256=hashes["tokenizer_sha256"],
        template_sha256=hashes["template_sha256"],
    ) as w:
        store.put_bytes(ref, SCORES_FILE, _parquet(score_rows(items, scores, dataset)))
        store.put_json(ref, POLICY_REPORT, {"dataset": dataset, **summary})
        scored = {
            side: sum(it.side == side and s is not None for it, s in zip(items, scores))
            for side in ("local", "overflow")
        }
        gap = summary.get("gap_nats_per_token")
        w.commit(
            extra={"scored": scored, "gap_nats_per_token": gap, "skipped": summary.get("skipped")},
            files=[POLICY_REPORT, SCORES_FILE],
        )
    log.info("score_policy %s: %s", dataset, summary.get("skipped") or f"scored {scored}, gap {gap}")
    return PolicyResult(uri=store.uri(ref), scored=scored, gap_nats_per_token=gap)
