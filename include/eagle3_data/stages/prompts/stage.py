"""Stage 2, load + route: a dataset's prompts (its date partition for scheduled runs), each with a
stable sample_id and a route (local | overflow | both); refused rows go to rejects.parquet. In a dry
run nothing is written but the plan: counts, token and cost estimates."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from eagle3_data.canonical import canonical_json
from eagle3_data.errors import UserError
from eagle3_data.images import parse_refs
from eagle3_data.rejects import REJECTS_FILE, rejects_parquet, require_reject_rate
from eagle3_data.runs.results import RouteResult
from eagle3_data.runs.reuse import settle
from eagle3_data.runs.run import Run, log, output_format, prompt_date, sampling, stage_ref, tokenizer_for
from eagle3_data.runs.upstream import rate_inputs, rates
from eagle3_data.stages import LOCAL, OVERFLOW, PLAN, PLAN_REPORT, PROMPTS
from eagle3_data.storage.writer import StageWriter

if TYPE_CHECKING:
    from eagle3_data.chat_format.base import OutputFormat
    from eagle3_data.stages.prompts.load import PromptRows
    from eagle3_data.storage import ArtifactStore

# Rows per part of the prompts stage: each holds its conversations and tool schemas (kilobytes
# each), and the writer buffers one part in memory, so parts are bounded in rows, not one per stage.
PROMPT_ROWS_PER_PART = 2048
BALANCE_FIELDS = ("local_endpoints", "local_latency_s", "overflow_latency_s")


def recorded_balance(store, ref) -> dict[str, Any] | None:
    """The balance inputs this run's committed prompts stage was routed with, if any.

    A run's routes are decided once. Recomputed on a rerun or a backfill's reprocessing, they
    would come from whatever run committed since (`previous_generation` takes the newest): other
    routes, a rewritten prompts stage, and every generation stage after it invalidated and paid
    for again. So a rerun keeps the inputs its first attempt recorded; a new run key (or a
    discarded prompts stage) takes fresh ones."""
    if not store.is_complete(ref):
        return None
    return ((store.read_manifest(ref).get("params") or {}).get("routing") or {}).get("balance_inputs")


def load_route(run: Run, store, dataset: str, *, write_plan: bool = True) -> RouteResult:
    """The prompts stage of `dataset`; in a dry run its plan instead (`plan`), written to
    `runs/{run_key}/plan/{dataset}/plan.json` unless `write_plan` is False (`eagle3-data plan`)."""
    from eagle3_data.balance import side_rates
    from eagle3_data.images import ImageSink
    from eagle3_data.prompt_files import prompt_files
    from eagle3_data.stages import IMAGE_COUNTS
    from eagle3_data.stages.prompts.load import (
        PromptShape,
        format_load_rejects,
        limit_prompt_tokens,
        load_prompts,
        prompt_token_limit,
    )
    from eagle3_data.stages.prompts.routing import assign_routes

    ds, g, limits = run.config.dataset(dataset), run.config.generation, run.config.limits
    # missing prompt files fail before the tokenizer's seconds of loading; the tokenizer loads
    # before the prompts are read, so its transient peak (the stage's largest) is not stacked on
    # the reader's buffers and pyarrow's first-use pages (~50 MiB)
    date = prompt_date(run, store, dataset)  # a run without a logical date: the newest partition, or undated
    prompt_files(ds.prompts, dataset, date=date, client=store.client)
    fmt = output_format(run, store)
    shape = PromptShape(
        sampling=sampling(run),
        repeats=g.repeats,
        max_message_bytes=limits.max_message_bytes,
        regenerate=g.regenerate,
        history=g.history,
        call_id=fmt.call_id if g.call_ids == "format" else None,
    )
    loaded = load_prompts(
        ds.prompts,
        dataset,
        shape,
        date=date,
        client=store.client,
        # a dry run stores no image: it only counts their media tokens
        images=ImageSink(None if run.dry_run else store, limits.max_image_bytes),
    )
    limit = prompt_token_limit(tokenizer_for(run, store), limits.max_prompt_tokens, g.sampling.max_new_tokens)
    counted: dict[str, int] | None = {} if run.dry_run else None  # the plan's prompt tokens, rendered once
    limit_prompt_tokens(
        loaded,
        limit,
        lambda messages, tools, images=None: len(fmt.generation_prompt_ids(messages, tools, images)),
        counted,
        workers=min(4, os.cpu_count() or 1),  # a large load renders on forked workers (prompts.FORK_MIN_ROWS)
    )
    log.info("dataset %s: %s", dataset, format_load_rejects(loaded))
    ref = stage_ref(run, PROMPTS, dataset)

    def keep_rejects() -> str:
        """The rejects beside the stage's parts, to read; nothing is committed (a stage an earlier,
        more lenient run committed keeps its own file: rewriting it would break its sha256)."""
        if not store.is_complete(ref):
            store.put_bytes(ref, REJECTS_FILE, rejects_parquet(loaded.rejects))
        return store.uri(ref, REJECTS_FILE)

    require_reject_rate(
        loaded.rejects,
        loaded.counts["read"],
        ds.validation.max_rejected_prompt_rate,
        f"dataset {dataset}: prompts {ds.prompts}" + (f" (date {date})" if date else ""),
        "validation.max_rejected_prompt_rate",
        None if run.dry_run else keep_rejects,
    )
    rc = run.config.routing
    balance = None
    if rc.strategy == "balanced" and not run.dry_run:
        balance = recorded_balance(store, stage_ref(run, PROMPTS, dataset))
    if balance is None and (rc.strategy == "balanced" or run.dry_run):
        balance = rate_inputs(run, store, dataset)
    # the balance inputs are recorded only when they decide the routes (rows_sha256 covers the routes)
    routing = rc.model_dump(exclude=None if rc.strategy == "balanced" else set(BALANCE_FIELDS))
    if rc.strategy == "balanced":
        routing["balance_inputs"] = balance
        log.info(
            "dataset %s: balanced routing from local %s (%s), overflow %s (%s)",
            dataset,
            _side_text(balance["local"]),
            balance["local"]["source"],
            _side_text(balance["overflow"]),
            balance["overflow"]["source"],
        )
    # balanced: the local count that makes both sides finish together (balance)
    split_rates = None
    if rc.strategy == "balanced":  # balance is set: recorded, or measured above
        lo = balance["local"]
        split_rates = side_rates(
            local_endpoints=lo["endpoints"],
            in_flight_per_endpoint=lo["in_flight_per_endpoint"],
            local_latency_s=lo["latency_s"],
            overflow_concurrency=g.overflow.concurrency,
            overflow_latency_s=balance["overflow"]["latency_s"],
        )
    routes = assign_routes(
        [sid for b in loaded.rows.batches(["sample_id"]) for sid in b.column(0).to_pylist()], rc, split_rates
    )
    to_overflow = 0
    if not g.local.images:  # the local endpoints take no images: every image prompt goes to overflow
        routes, to_overflow = images_to_overflow(loaded.rows, routes)
    counts = {"prompts": len(routes), "rejects": len(loaded.rejects)}
    if to_overflow:
        counts["images_to_overflow"] = to_overflow
    if "user_turns" in loaded.counts:  # rows asked for turn by turn (conversations): sizes the timeouts
        counts["user_turns"] = loaded.counts["user_turns"]
    counts.update(
        {k: loaded.counts[k] for k in IMAGE_COUNTS if loaded.counts.get(k)}
    )  # image prompts: the report's figures
    if loaded.counts["answers_dropped"]:  # final_turn: rows whose own answer is regenerated (the provenance kept)
        counts["answers_dropped"] = loaded.counts["answers_dropped"]
    for route in routes:
        counts[route] = counts.get(route, 0) + 1
    if run.dry_run:
        plan = {
            "dataset": dataset,
            "source": ds.prompts,
            "date": date,
            "counts": counts,
            "estimate": _estimate(
                run,
                store,
                dataset,
                fmt,
                RoutedLoad(routed_batches(loaded.rows, routes), counts, balance, prompt_tokens=counted),
            ),
        }
        log.info(
            "dataset %s: plan rates from local %s, overflow %s",
            dataset,
            balance["local"]["source"],
            balance["overflow"]["source"],
        )
        for name, p in plan["estimate"]["strategies"].items():
            log.info(
                "dataset %s: plan %-8s%s local %d, overflow %d: local %s s, overflow %s s, wall %s s, overflow <= "
                "$%.4f",
                dataset,
                name,
                "*" if p["chosen"] else " ",
                p["local"],
                p["overflow"],
                seconds_text(p["local_s"]),
                seconds_text(p["overflow_s"]),
                seconds_text(p["wall_s"]),
                p["overflow_usd"],
            )
        uri = store.put_json(stage_ref(run, PLAN, dataset), PLAN_REPORT, plan) if write_plan else None
        return RouteResult(counts=counts, plan_uri=uri, plan=plan)
    params = {
        "source": ds.prompts,
        "date": date,
        "sampling": sampling(run),
        "repeats": g.repeats,
        "routing": routing,
        "rows_sha256": rows_sha256(routed_batches(loaded.rows, routes)),
    }
    if g.regenerate != "final_turn":  # recorded only away from the default, so earlier stages are still reused
        params["regenerate"] = g.regenerate
        params["history"] = g.history
    if g.regenerate == "trajectory":
        params["max_trajectory_steps"] = g.max_trajectory_steps
    if g.call_ids != "format":  # recorded only away from the default, as `regenerate`
        params["call_ids"] = g.call_ids
    if not routes:  # nothing to generate: refused before anything is written
        first = loaded.rejects[0]["reason"] if loaded.rejects else "the file holds no rows"
        where = f"{ds.prompts}" + (f" (date {date})" if date else "")
        raise UserError(
            f"dataset {dataset}: 0 usable prompt rows in {where}: {loaded.counts.get('read', 0)} read, "
            f"{len(loaded.rejects)} rejected; first: {first}"
            + (f"; rejects: {keep_rejects()}" if loaded.rejects else "")
        )
    if settle(run, store, ref, [], params, what=f"load_route {dataset}") is None:
        with StageWriter(store, ref, "prompts", rows_per_part=PROMPT_ROWS_PER_PART, params=params, fresh=True) as w:
            for batch in routed_batches(loaded.rows, routes):
                w.write(pa.Table.from_batches([batch]))
            store.put_bytes(ref, REJECTS_FILE, rejects_parquet(loaded.rejects))
            w.commit(extra={"counts": counts}, files=[REJECTS_FILE])
    return RouteResult(counts=counts, uri=store.uri(ref))


def images_to_overflow(rows: PromptRows, routes: list[str]) -> tuple[list[str], int]:
    """Image prompts go to the overflow path, whatever routing chose; returns the routes and how
    many it moved. Applied unless `generation.local.images` says the local endpoints serve the
    vision-language target with its image processor (docs/images.md): an endpoint serving a
    text-only model (the dev target, a `vllm serve` without `--enable-scale-out`) cannot take them."""
    with_images = [bool(v) for b in rows.batches(["images"]) for v in b.column(0).to_pylist()]
    moved = [r != "overflow" and img for r, img in zip(routes, with_images, strict=True)]
    return ["overflow" if m else r for r, m in zip(routes, moved)], sum(moved)


def routed_batches(rows: PromptRows, routes: list[str]) -> Iterator[pa.RecordBatch]:
    """The loaded rows (`prompts.PromptRows`, in load order) as prompts-stage batches, `route`
    filled from `routes` (one per row, same order), a batch at a time."""
    done = 0
    for batch in rows.batches():
        i = batch.schema.get_field_index("route")
        route = pa.array(routes[done : done + batch.num_rows], pa.string())
        done += batch.num_rows
        yield batch.set_column(i, batch.schema.field(i), route)


def rows_sha256(batches: Iterable[pa.RecordBatch]) -> str:
    """sha256 of the canonical JSON list of every row, hashed as it streams: the same digest as
    `canonical_json(rows, ascii_only=True)` of the whole list, whose ASCII-escaped spelling every
    existing prompts manifest recorded (see canonical.py), so their stages stay reusable."""
    digest, sep = hashlib.sha256(b"["), b""
    for batch in batches:
        for row in batch.to_pylist():
            row.pop(
                "source_id", None
            )  # provenance, not what is generated: a stage made before it existed stays reusable
            if row.get("images") is None:
                row.pop("images", None)  # text rows hash as before images existed
            digest.update(sep + canonical_json(row, ascii_only=True).encode())
            sep = b","
    digest.update(b"]")
    return digest.hexdigest()


def _side_text(side: dict) -> str:
    if "endpoints" in side:
        return f"{side['endpoints']} x {side['in_flight_per_endpoint']} in flight at {side['latency_s']:g} s"
    return f"{side['concurrency']} in flight at {side['latency_s']:g} s"


@dataclass(frozen=True)
class RoutedLoad:
    """One dataset's prompts as routed: what its plan is figured from (`_estimate`)."""

    batches: Iterable[pa.RecordBatch]  # the rows with their routes (`routed_batches`)
    counts: dict[str, int]  # the stage's counts: prompts, per route, ...
    balance: dict  # the routing rates' inputs (`rate_inputs`)
    prompt_tokens: dict[str, int] | None = None  # by sample_id, as the load rendered them


def _estimate(run: Run, store: ArtifactStore, dataset: str, fmt: OutputFormat, routed: RoutedLoad) -> dict:
    """One dataset's plan figures (plan): prompt tokens measured (`routed.prompt_tokens`: by
    sample_id, from the load's own rendering; a row without a count is rendered here), output
    tokens and overflow USD as an upper bound (every answer max_new_tokens long) and as expected,
    the cap check, the merged tokens the extraction reads, and every routing strategy."""
    from eagle3_data.plan import cost_check, earlier_stages, expected_output

    counts, counted = routed.counts, routed.prompt_tokens
    g = run.config.generation
    s, price = g.sampling, g.overflow.price_usd_per_mtok
    max_length = run.config.merge.max_length
    expected = expected_output(run, store, dataset)
    per_sample = expected["tokens_per_sample"]
    prompt_tokens, every_prompt = {"local": 0, "overflow": 0}, 0
    merged = {"expected": 0, "upper": 0}
    for batch in routed.batches:
        sids = batch.column(batch.schema.get_field_index("sample_id")).to_pylist()
        routes = batch.column(batch.schema.get_field_index("route")).to_pylist()
        for i, (sid, route) in enumerate(zip(sids, routes)):
            n = counted.get(sid) if counted else None
            if n is None:
                r = batch.slice(i, 1).to_pylist()[0]
                n = len(
                    fmt.generation_prompt_ids(
                        json.loads(r["messages"]),
                        json.loads(r["tools"]) if r["tools"] else None,
                        parse_refs(r.get("images")),
                    )
                )
            every_prompt += n
            merged["expected"] += min(n + per_sample, max_length)
            merged["upper"] += min(n + s.max_new_tokens, max_length)
            for side in ("local", "overflow"):
                if route in (side, "both"):
                    prompt_tokens[side] += n
    n_rows, n_both = counts["prompts"], counts.get("both", 0)
    samples = {side: counts.get(side, 0) + n_both for side in ("local", "overflow")}
    usd = {
        k: (prompt_tokens["overflow"] * price.prompt + samples["overflow"] * out * price.completion) / 1e6
        for k, out in (("expected", per_sample), ("upper", s.max_new_tokens))
    }
    cap, warnings = cost_check(dataset, usd, samples["overflow"], g.overflow.max_usd)
    strategies = _strategies(run, n_rows, every_prompt, routed.balance, per_sample)
    chosen = strategies[run.config.routing.strategy]
    if chosen["overflow"] == samples["overflow"]:
        # the routes taken: their own prompts' tokens, not the average the other strategies are priced
        # at, so the plan states one overflow bound for them (it said $0.0428 here, $0.0431 there)
        chosen["overflow_usd"] = round(usd["upper"], 6)
        chosen["overflow_usd_expected"] = round(usd["expected"], 6)
    skipped: list[str] = []
    for stage in (LOCAL, OVERFLOW):
        list(earlier_stages(store, run.run_key, stage, dataset, skipped))
    return {
        "prompt_tokens": sum(prompt_tokens.values()),
        "prompt_tokens_by_side": prompt_tokens,
        "samples": samples,
        "max_output_tokens": n_rows * s.max_new_tokens + n_both * s.max_new_tokens,
        "output_tokens": {
            "expected": (n_rows + n_both) * per_sample,
            "upper": (n_rows + n_both) * s.max_new_tokens,
            "per_sample": per_sample,
            "source": expected["source"],
        },
        "max_overflow_usd": round(min(usd["upper"], g.overflow.max_usd), 6),
        "usd": {k: round(v, 6) if isinstance(v, float) else v for k, v in cap.items()},
        "merged_tokens": merged,
        "strategies": strategies,
        # where each side's rate came from: the previous run's manifest (named) or "config"
        "rate_inputs": routed.balance,
        "rates_samples_per_s": {k: round(v, 6) for k, v in vars(rates(routed.balance)).items()},
        "stand_in_runs_skipped": len(skipped),
        "warnings": warnings,
    }


def _strategies(
    run: Run, n_rows: int, prompt_tokens: int, balance: dict[str, Any], expected_output: int | None = None
) -> dict[str, Any]:
    """Each routing strategy on this dataset's samples: counts per side, each side's finish time
    with both running at once, the wall time (the later side), and the overflow spend (upper
    bound: every answer max_new_tokens long, uncapped by max_usd). The rates come from the
    previous run's manifests or the routing config (`rate_inputs`); the chosen strategy is marked."""
    from eagle3_data.balance import compare_strategies

    r, s = run.config.routing, run.config.generation.sampling
    price = run.config.generation.overflow.price_usd_per_mtok
    per_sample = ((prompt_tokens / n_rows if n_rows else 0) * price.prompt + s.max_new_tokens * price.completion) / 1e6
    plans = compare_strategies(
        n_rows,
        overflow_fraction=r.overflow_fraction,
        local_capacity=r.local_capacity,
        calibration=r.calibration_samples,
        rates=rates(balance),
        usd_per_overflow_sample=per_sample,
    )
    avg_prompt = (prompt_tokens / n_rows if n_rows else 0) * price.prompt
    out = s.max_new_tokens if expected_output is None else expected_output
    for name, plan in plans.items():
        plan["chosen"] = name == r.strategy
        plan["overflow_usd"] = round(plan["overflow_usd"], 6)
        plan["overflow_usd_expected"] = round(plan["overflow"] * (avg_prompt + out * price.completion) / 1e6, 6)
    return plans


def seconds_text(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}"
