"""The plan a user reads before spending: `eagle3-data plan` and the DAG's `dry_run` build it with
the same functions (per dataset in `route.load_route`, the run in `run_plan`), print it with
`format_plan` and store it as JSON (`runs/{run_key}/plan/run/plan.json`, shown by the report tab).

What each figure comes from, and the plan says so beside it:
- samples per side and strategy: the routing config over the loaded prompts (`route._strategies`);
- prompt tokens: measured, every prompt rendered by the chat template and encoded once;
- output tokens: an upper bound (`max_new_tokens` each) and an expected figure: the mean completion
  tokens of the dataset's newest earlier run on a real engine, else `plan.expected_output_tokens`,
  else half of `max_new_tokens` (an assumption, labelled so);
- USD: expected and upper bound at `price_usd_per_mtok`, against `generation.overflow.max_usd`, with
  how many overflow samples fit the cap when the bound is over it;
- wall time: each side's rate from the newest earlier run's manifests or the routing config,
  labelled by source; an earlier run on a stand-in (its manifest's `stand_ins` name the engine,
  or the model for the local side) is never used;
- hidden-state storage per dtype (bf16, fp8, ids-only) at the target's width and the layers kept
  (`storage_estimate`), the width of `model.source` unless it is a stand-in
  (then `plan.target_hidden_size`);
- extraction GPU hours at `plan.prefill_tokens_per_s_per_gpu`; the probe's time.
"""

from __future__ import annotations

import math
from typing import Any

from eagle3_data.stages import LOCAL, OVERFLOW

# the probe's measured cost at Kimi-K2.5's width on one H200 (docs/hidden_states.md, benchmarks/gpu_probe.py
# via benchmarks/gpu_probe.sh --samples 40 --steps 100)
PROBE_S_PER_1000_TRAINED = 357.5
DTYPES = ("bf16", "fp8", "ids-only")


# what answered a generation stage, by stage: a manifest whose `stand_ins` name one of these was made on a
# stand-in (the dev inference server, a tiny random model), and its timings and lengths say nothing of the real one
STAND_IN_ENGINES = {LOCAL: ("local_engine", "model"), OVERFLOW: ("overflow_provider",)}


def earlier_stages(store, run_key: str, stage: str, dataset: str, skipped: list[str] | None = None):
    """(ref, manifest) of each committed `stage` of `dataset` in runs other than `run_key`, newest
    first, leaving out those made on a stand-in engine (their URIs appended to `skipped`)."""
    from eagle3_data.storage import StageRef

    found = []
    for other in store.run_keys():
        ref = StageRef(other, stage, dataset)
        if other != run_key and (committed := store.committed_at(ref)) is not None:
            found.append((committed, ref))
    for _, ref in sorted(found, key=lambda f: f[0], reverse=True):
        manifest = store.read_manifest(ref)
        if set(manifest.get("stand_ins") or ()) & set(STAND_IN_ENGINES.get(stage, ())):
            if skipped is not None:
                skipped.append(store.uri(ref))
            continue
        yield ref, manifest


def expected_output(run, store, dataset: str) -> dict[str, Any]:
    """{tokens_per_sample, source}: the expected answer length of `dataset` (see the module doc)."""
    for stage in (LOCAL, OVERFLOW):
        for ref, _ in earlier_stages(store, run.run_key, stage, dataset):
            mean = _mean_completion_tokens(store, ref)
            if mean is not None:
                return {"tokens_per_sample": round(mean), "source": f"mean of {store.uri(ref)}"}
    configured = run.config.plan.expected_output_tokens
    max_new = run.config.generation.sampling.max_new_tokens
    if configured is not None:
        return {"tokens_per_sample": min(configured, max_new), "source": "config plan.expected_output_tokens"}
    return {
        "tokens_per_sample": max(1, max_new // 2),
        "source": "assumed: half of max_new_tokens (set plan.expected_output_tokens, or run once on the real engine)",
    }


def _mean_completion_tokens(store, ref) -> float | None:
    """Mean completion tokens of a committed generation stage's ok rows; None without any."""
    n = total = 0
    for batch in store.iter_batches(ref, columns=["status", "usage"]):
        for status, usage in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            tokens = (usage or {}).get("completion_tokens")
            if status == "ok" and isinstance(tokens, int) and tokens > 0:
                n, total = n + 1, total + tokens
    return total / n if n else None


def cost_check(
    dataset: str, usd: dict[str, float], overflow_samples: int, max_usd: float
) -> tuple[dict[str, Any], list[str]]:
    """`usd` ({expected, upper}) against the cap: how many overflow samples fit it at each, and the
    warning when the upper bound is over it."""
    out: dict[str, Any] = {**usd, "max_usd": max_usd, "over_cap": usd["upper"] > max_usd + 1e-9}
    warnings = []
    if overflow_samples and out["over_cap"]:
        fit = {
            k: min(overflow_samples, math.floor(max_usd / (usd[k] / overflow_samples))) for k in ("expected", "upper")
        }
        out["fit_samples"] = fit
        warnings.append(
            f"dataset {dataset}: overflow USD upper bound {usd['upper']:,.2f} (expected {usd['expected']:,.2f}) is "
            f"over generation.overflow.max_usd {max_usd:,.2f}: {fit['upper']:,} of {overflow_samples:,} overflow "
            f"samples fit the cap at the upper bound, {fit['expected']:,} at the expected length; spending stops at "
            f"the cap (raise max_usd, or route fewer samples to overflow)"
        )
    return out, warnings


def run_plan(run, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The whole run's plan from each dataset's (`load_route` in a dry run): totals, every routing
    strategy over the run, storage, extraction, probe and warnings. The CLI and the DAG's publish
    both call this, so they print and store the same plan."""
    from eagle3_data.balance import run_totals

    est = {name: p["estimate"] for name, p in plans.items()}

    def total(*path: str) -> float:
        out = 0.0
        for e in est.values():
            v: Any = e
            for k in path:
                v = (v or {}).get(k, 0)
            out += v or 0
        return out

    totals = {
        k: round(sum(e[k] for e in est.values()), 6) for k in ("prompt_tokens", "max_output_tokens", "max_overflow_usd")
    }
    totals.update(
        {
            "samples": {side: int(total("samples", side)) for side in ("local", "overflow")},
            "output_tokens": {k: int(total("output_tokens", k)) for k in ("expected", "upper")},
            "usd": {k: round(total("usd", k), 6) for k in ("expected", "upper")},
            "merged_tokens": {k: int(total("merged_tokens", k)) for k in ("expected", "upper")},
        }
    )
    strategies = run_totals([e.get("strategies", {}) for e in est.values()])
    for name, s in strategies.items():
        s["overflow_usd_expected"] = round(
            sum(
                e["strategies"][name].get("overflow_usd_expected", 0.0) for e in est.values() if name in e["strategies"]
            ),
            6,
        )
        s["chosen"] = name == run.config.routing.strategy
    return {
        "format": "eagle3-plan/1",
        "run_key": run.run_key,
        "stand_ins": list(run.config.stand_ins),
        "datasets": plans,
        "totals": totals,
        "strategies": strategies,
        "storage": storage(run, totals["merged_tokens"]),
        "extraction": extraction(run, totals["merged_tokens"]),
        "probe": probe_time(run),
        "warnings": [w for e in est.values() for w in e.get("warnings", [])],
    }


def target_width(run) -> tuple[int, str]:
    """(hidden size, where it came from) for the storage figures."""
    from eagle3_data.storage_estimate import storage_estimate

    configured = run.config.plan.target_hidden_size
    if "model" in run.config.stand_ins:
        return configured, f"config plan.target_hidden_size (model.source {run.config.model.source} is a stand-in)"
    est = storage_estimate(run, 0)
    if est is None:
        return configured, f"config plan.target_hidden_size ({run.config.model.source}/config.json not readable here)"
    return est["hidden_size"], f"{run.config.model.source}/config.json"


def storage(run, merged_tokens: dict[str, int]) -> dict[str, Any]:
    """Hidden-state bytes per dtype (bf16, fp8 aux states, ids-only: the merged ids and loss masks
    alone) for the expected and upper-bound merged tokens."""
    from eagle3_data.storage_estimate import ID_BYTES, bytes_per_token

    h = run.config.hidden_states
    width, source = target_width(run)
    aux = len(h.layer_ids) if h.layer_ids else 3
    per = bytes_per_token(width, aux_layers=aux, last=h.last_hidden, logprobs=h.logprobs)
    per_dtype = {"bf16": per["shards_bf16"], "fp8": per["shards_fp8"], "ids-only": ID_BYTES}
    return {
        "hidden_size": width,
        "hidden_size_source": source,
        "aux_layers": aux,
        "last_hidden": h.last_hidden,
        "configured_dtype": h.storage_dtype,
        "tokens": dict(merged_tokens),
        "dtypes": {
            d: {
                "bytes_per_token": b,
                **{k: int(b * merged_tokens[k]) for k in ("expected", "upper")},
            }
            for d, b in per_dtype.items()
        },
        "note": "the extraction's shards; a trainer export (export-speculators / export-specforge) is a second "
        "copy of about the same size",
    }


def extraction(run, merged_tokens: dict[str, int]) -> dict[str, Any]:
    """GPU hours of the extraction (a prefill of every merged token) at the configured rate."""
    rate = run.config.plan.prefill_tokens_per_s_per_gpu
    h = run.config.hidden_states
    gpus = h.tensor_parallel_size * h.workers
    hours = {k: merged_tokens[k] / rate / 3600 for k in ("expected", "upper")}
    default = type(run.config.plan).model_fields["prefill_tokens_per_s_per_gpu"].default
    return {
        "tokens_per_s_per_gpu": rate,
        "rate_source": "config plan.prefill_tokens_per_s_per_gpu"
        + (
            " (default: DeepSeek's published DeepSeek-V3/R1 prefill, 73.7k tokens/s per 8xH800 node less its 56.3% "
            "cache hits; unmeasured on Kimi-K2.5 here)"
            if rate == default
            else ""
        ),
        "gpu_hours": {k: round(v, 6) for k, v in hours.items()},
        "gpus": gpus,
        "wall_hours": {k: round(v / gpus, 6) for k, v in hours.items()},
        "recipe": "vLLM backend, tensor_parallel_size 8 on one 8xH200 node holds Kimi-K2.5 (~595 GB INT4 weights); "
        "unverified on the real checkpoint (docs/hidden_states.md)",
    }


def probe_time(run) -> dict[str, Any]:
    """The probe's expected seconds at the measured rate (one GPU, Kimi-K2.5's width), capped by its budget."""
    p = run.config.probe
    if p.when == "never":
        return {"when": "never", "seconds": 0, "source": "probe.when never"}
    seeds = getattr(p, "seeds", 1)
    seconds = PROBE_S_PER_1000_TRAINED * p.steps * p.batch_size / 1000 * seeds
    return {
        "when": p.when,
        "seconds": round(min(seconds, p.budget_s), 1),
        "budget_s": p.budget_s,
        "source": f"{PROBE_S_PER_1000_TRAINED} s per 1,000 trained samples, measured on one H200 at H=7168 "
        f"(benchmarks/gpu_probe.py on an H200); {p.steps} steps x {p.batch_size}"
        + (f" x {seeds} seeds" if seeds != 1 else "")
        + (", skipped on a worker without a GPU" if p.when == "auto" else ""),
    }


# -- text ----------------------------------------------------------------------------------------
def _n(v: float) -> str:
    return f"{v:,.0f}"


def _tok(v: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= size:
            return f"{v / size:.3g}{unit}"
    return f"{v:.0f}"


def _hours(seconds: float | None) -> str:
    if seconds is None or seconds == math.inf:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _rate_source(side: dict[str, Any]) -> str:
    src = side.get("source", "config")
    return "config" if src == "config" else f"observed: {src}"


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a terminal table (what `eagle3-data plan` prints and the dry run logs)."""
    from eagle3_data.storage_estimate import human_bytes

    t = plan["totals"]
    lines = [f"Plan for run {plan['run_key']}: nothing is generated, paid or extracted (a dry run)"]
    lines.append(
        f"{'dataset':<14}{'samples':>9}{'local':>9}{'overflow':>10}{'prompt tok':>12}"
        f"{'output tok exp/max':>22}{'USD exp / max (cap)':>26}"
    )
    for name, p in plan["datasets"].items():
        e = p["estimate"]
        usd, out = e.get("usd", {}), e.get("output_tokens", {})
        lines.append(
            f"{name:<14}{_n(p['counts']['prompts']):>9}{_n(e.get('samples', {}).get('local', 0)):>9}"
            f"{_n(e.get('samples', {}).get('overflow', 0)):>10}{_tok(e['prompt_tokens']):>12}"
            f"{_tok(out.get('expected', 0)) + ' / ' + _tok(out.get('upper', 0)):>22}"
            f"{'%.2f / %.2f (%.2f)' % (usd.get('expected', 0), usd.get('upper', 0), usd.get('max_usd', 0)):>26}"
        )
    lines.append(
        f"{'total':<14}{_n(sum(p['counts']['prompts'] for p in plan['datasets'].values())):>9}"
        f"{_n(t['samples']['local']):>9}{_n(t['samples']['overflow']):>10}{_tok(t['prompt_tokens']):>12}"
        f"{_tok(t['output_tokens']['expected']) + ' / ' + _tok(t['output_tokens']['upper']):>22}"
        f"{'%.2f / %.2f' % (t['usd']['expected'], t['usd']['upper']):>26}"
    )
    for name, p in plan["datasets"].items():
        e = p["estimate"]
        out = e.get("output_tokens", {})
        lines.append(
            f"  {name}: output {_n(out.get('per_sample', 0))} tokens/sample expected ({out.get('source', '?')}); "
            f"rates: local {_rate_source(e['rate_inputs']['local'])}, overflow "
            f"{_rate_source(e['rate_inputs']['overflow'])}"
            + (
                f"; {e['stand_in_runs_skipped']} earlier stand-in runs not used"
                if e.get("stand_in_runs_skipped")
                else ""
            )
        )
    lines.append(
        f"{'routing (run)':<16}{'local':>9}{'overflow':>10}{'local time':>12}{'overflow time':>15}{'wall':>10}"
    )
    for name, s in plan["strategies"].items():
        lines.append(
            f"{name + (' *' if s.get('chosen') else ''):<16}{_n(s['local']):>9}{_n(s['overflow']):>10}"
            f"{_hours(s['local_s']):>12}{_hours(s['overflow_s']):>15}{_hours(s['wall_s']):>10}"
            f"   USD {s.get('overflow_usd_expected', 0):,.2f} exp / {s['overflow_usd']:,.2f} max"
        )
    st = plan["storage"]
    lines.append(
        f"hidden states at H={st['hidden_size']} ({st['hidden_size_source']}), {st['aux_layers']} aux layers"
        + (" + last" if st["last_hidden"] else "")
        + f", {_tok(st['tokens']['expected'])} tokens expected / {_tok(st['tokens']['upper'])} max:"
    )
    lines.append(
        "  "
        + "; ".join(
            f"{d} {human_bytes(v['expected'])} / {human_bytes(v['upper'])} ({human_bytes(v['bytes_per_token'])}/token)"
            for d, v in st["dtypes"].items()
        )
    )
    x = plan["extraction"]
    lines.append(
        f"extraction: {x['gpu_hours']['expected']:,.1f} GPU-hours expected / {x['gpu_hours']['upper']:,.1f} max at "
        f"{x['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({x['rate_source']}); {x['gpus']} GPUs: "
        f"{x['wall_hours']['expected']:,.1f} h / {x['wall_hours']['upper']:,.1f} h"
    )
    pr = plan["probe"]
    lines.append(f"probe ({pr['when']}): ~{_hours(pr['seconds'])} ({pr['source']})")
    lines += [f"WARNING: {w}" for w in plan["warnings"]]
    return "\n".join(lines)
