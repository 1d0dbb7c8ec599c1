"""Every stage's library call at N = 1k, 4k, 16k samples (83k with --full): work seconds, tokens/s,
peak RSS, and the per-row slope that extrapolates to the real workload (issue 14, deliverable 7).

    nice -n 19 .venv/bin/python benchmarks/scale.py                     # N = 1000 4000 16000
    nice -n 19 .venv/bin/python benchmarks/scale.py --sizes 200 800     # what `make bench` runs
    nice -n 19 .venv/bin/python benchmarks/scale.py --full              # + N = 83000 (~10^8 tokens)

The real pipeline on the demo stack (SeaweedFS + the dev inference server at zero latency, the
real Kimi tokenizer, the tiny DeepSeek-V3 target): for each N one dataset of N prompts, routed
half local, half overflow, then audit -> load_route -> generate_local -> generate_overflow ->
reconstruct -> validate -> merge -> extract (ONE shard, at the first N only: its cost does not
depend on N; `--shard-tokens` sizes it) ->
publish, each stage's `eagle3_data.pipeline` call in its own fresh process, as the DAG's tasks
run. Outputs are long: the prompts declare a tool with many parameters, so the 70% of answers
that call it carry ~1k tokens of arguments (the dev server's text answers are short).

Columns: `work s` is the stage call alone (after imports), `process s` the whole process
(interpreter start and imports included: what a task pays), `CPU s` the process's own CPU (the
dev server's is not in it), peak RSS its own high-water mark (VmHWM). `tokens` is prompt + output ids of what the
stage produced (generation/reconstruct), read (validate), or wrote (merge, extract).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import REPO, measure, slope, table

TOOL_PARAMS = 110  # string parameters of the benchmark tool: ~1k tokens of arguments per call
SETUP = """
from eagle3_data import pipeline as P
from eagle3_data.config import load_config
from eagle3_data.storage import s3_client
run = P.resolve_run(json.loads(os.environ["BENCH_PARAMS"]), None, load_config(os.environ["EAGLE3_CONFIG"]))
store = P.open_store(run.config, s3_client())
ds = os.environ["BENCH_DATASET"]
"""
STAGES = {
    "audit_tokenizer": "RESULT = P.audit_tokenizer(run, store).as_dict()",
    "load_route": "RESULT = P.load_route(run, store, ds).as_dict()",
    "generate_local": "RESULT = P.generate_local(run, store, ds, [os.environ['BENCH_SGLANG']]).as_dict()",
    "generate_overflow": (
        "RESULT = P.generate_overflow(run, store, ds, os.environ['BENCH_OPENROUTER'], 'dev-key').as_dict()"
    ),
    "reconstruct": "RESULT = P.reconstruct(run, store, ds).as_dict()",
    "validate": (
        "r = P.validate(run, store, ds)\n"
        "RESULT = {'passed': r.gate.passed, 'reasons': r.gate.reasons, 'counts': r.counts}"
    ),
    "merge": "r = P.merge(run, store)\nRESULT = {'shards': r.shards, 'totals': r.totals}",
    # one GPU worker's share, as the DAG maps it (pipeline.plan_hidden_states): here one shard
    "extract_hidden_states": (
        "r = P.extract_hidden_states(run, store, {'worker': 0, 'shards': [json.loads(os.environ['BENCH_SHARD'])]})\n"
        "RESULT = {'samples': sum(s.samples for s in r.shards), 'tokens': sum(s.tokens for s in r.shards), "
        "'backend_loads': r.backend_loads}"
    ),
    "publish": "RESULT = {'changed': P.publish(run, store).changed}",
}


def prompts_jsonl(n: int) -> bytes:
    """n distinct prompts that declare one tool with TOOL_PARAMS string parameters."""
    tool = {
        "type": "function",
        "function": {
            "name": "fill_form",
            "description": "Fill in a long form; every field is required.",
            "parameters": {
                "type": "object",
                "properties": {f"field_{k:03d}": {"type": "string"} for k in range(TOOL_PARAMS)},
            },
        },
    }
    lines = [
        json.dumps(
            {
                "messages": [{"role": "user", "content": f"Please fill in form {i} for me, every field."}],
                "tools": [tool],
            }
        )
        for i in range(n)
    ]
    return ("\n".join(lines) + "\n").encode()


def stage_tokens(store, ref) -> tuple[int, int]:
    """(rows, prompt + output ids) of a generations stage, streamed."""
    import pyarrow.compute as pc

    rows = tokens = 0
    for batch in store.iter_batches(ref, columns=["prompt_ids", "output_ids"]):
        rows += batch.num_rows
        for col in ("prompt_ids", "output_ids"):
            tokens += pc.sum(pc.list_value_length(batch.column(col))).as_py() or 0
    return rows, tokens


QUIET = {
    "latency": {"dist": "fixed", "mean": 0.0},
    "rate_limit": 0.0,
    "server_error": 0.0,
    "timeout": 0.0,
    "malformed_json": 0.0,
    "empty_content": 0.0,
}


def quiet_server(url: str) -> None:
    """--smoke: the dev server without latency or error faults (no retries and backoff to wait for)."""
    import httpx

    r = httpx.post(f"{url}/dev/config", json={"endpoints": {"chat": QUIET, "generate": QUIET}}, timeout=30)
    r.raise_for_status()


def run(sizes: list[int], workdir: Path, extract: bool, shard_tokens: int, quiet: bool = False) -> list[dict]:
    from eagle3_data.storage import StageRef
    from eagle3_devtools.stack import dev_stack

    datasets = [{"name": f"scale{n}", "prompts": f"s3://eagle3/bench-prompts/scale{n}.jsonl"} for n in sizes]
    overrides = {
        "datasets": datasets,
        "routing": {"strategy": "fraction", "overflow_fraction": 0.5},
        "generation": {
            "sampling": {"max_new_tokens": 2048},
            # the dev server bills: no cap at 83k
            "overflow": {"max_usd": 1e6},
        },
        "merge": {"shard_tokens": shard_tokens},
    }
    results = []
    with dev_stack(workdir, config_overrides=overrides) as stack:
        from eagle3_data.config import load_config
        from eagle3_data.pipeline import open_store

        client = stack.client()
        store = open_store(load_config(stack.config_path), client)
        if quiet:
            quiet_server(stack.inference_url)
        s3 = stack.s3
        env = {
            **stack.env,
            "AWS_ENDPOINT_URL_S3": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_REGION": "us-east-1",
            "BENCH_SGLANG": stack.inference_url,
            "BENCH_OPENROUTER": stack.inference_url + "/v1",
        }
        for n in sizes:
            client.put_object(Bucket="eagle3", Key=f"bench-prompts/scale{n}.jsonl", Body=prompts_jsonl(n))
            run_key, ds = f"scale-{n}", f"scale{n}"
            env_n = {
                **env,
                "BENCH_DATASET": ds,
                "BENCH_PARAMS": json.dumps({"run_name": run_key, "datasets": [ds], "skip_hidden_states": True}),
            }
            merged: dict = {}
            for stage, work in STAGES.items():
                if stage == "extract_hidden_states":
                    if not extract or not merged.get("shards") or n != sizes[0]:  # its cost does not depend on N
                        continue
                    env_n["BENCH_SHARD"] = json.dumps(merged["shards"][0])
                t = time.perf_counter()
                m = measure(SETUP, work, env_n)
                process_s = time.perf_counter() - t
                row = {
                    "stage": stage,
                    "n": n,
                    "work_s": m["work_s"],
                    "process_s": process_s,
                    "cpu_s": m["cpu_s"],
                    "peak_rss_mib": m["peak_rss_mib"],
                }
                res = m["result"] or {}
                if stage == "merge":
                    merged = res
                    row.update(
                        rows=res["totals"].get("samples"),
                        tokens=res["totals"].get("tokens"),
                        note=f"{len(res['shards'])} shards",
                    )
                elif stage == "extract_hidden_states":
                    row.update(
                        rows=res.get("samples"), tokens=res.get("tokens"), note=f"1 of {len(merged['shards'])} shards"
                    )
                elif stage == "validate":
                    row["note"] = "gate passed" if res.get("passed") else f"gate FAILED: {res.get('reasons')}"
                results.append(row)
                print(json.dumps(row), flush=True)
            # tokens the per-dataset stages handled (read back once, after the run)
            local = stage_tokens(store, StageRef(run_key, "generate_local", ds))
            recon = stage_tokens(store, StageRef(run_key, "reconstruct", ds))
            for row in results:
                if row["n"] != n:
                    continue
                got = {
                    "generate_local": local,
                    "generate_overflow": recon,
                    "reconstruct": recon,
                    "validate": (local[0] + recon[0], local[1] + recon[1]),
                    "load_route": (n, None),
                    "publish": (None, None),
                    "audit_tokenizer": (None, None),
                }.get(row["stage"])
                if got:
                    row["rows"], row["tokens"] = got
    for row in results:
        if row.get("tokens"):
            row["tok_per_s"] = row["tokens"] / row["work_s"]
    return results


def slopes(results: list[dict]) -> list[dict]:
    """Per stage: least-squares seconds per row over the N measured, of work (wall) and of the
    process's CPU (the load-independent one on a shared machine), the fixed CPU cost (intercept)
    and what the CPU fit projects at 83k samples (half of them for the one-route stages)."""
    out = []
    for stage in STAGES:
        mine = [r for r in results if r["stage"] == stage and r.get("rows")]
        if len({r["rows"] for r in mine}) < 2 or stage == "extract_hidden_states":
            continue
        work = slope([(r["rows"], r["work_s"]) for r in mine])
        cpu = slope([(r["rows"], r["cpu_s"]) for r in mine])
        fixed = sum(r["cpu_s"] for r in mine) / len(mine) - cpu * sum(r["rows"] for r in mine) / len(mine)
        rows_at_full = {"generate_local": 41_500, "generate_overflow": 41_500, "reconstruct": 41_500}.get(stage, 83_000)
        rss = [r["peak_rss_mib"] for r in results if r["stage"] == stage]
        out.append(
            {
                "stage": stage,
                "work_ms_per_row": work * 1e3,
                "cpu_ms_per_row": cpu * 1e3,
                "fixed_cpu_s": fixed,
                "cpu_at_83k_s": fixed + cpu * rows_at_full,
                "rss_min": min(rss),
                "rss_max": max(rss),
            }
        )
    return out


def rss_ratio(results: list[dict], name: str) -> None:
    """The RATIO line: per stage, peak RSS at the largest N over the smallest (flat: 1.00); the largest."""
    by: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        by.setdefault(r["stage"], []).append((r["n"], r["peak_rss_mib"]))
    growth = {s: max(v)[1] / min(v)[1] for s, v in by.items() if len({n for n, _ in v}) > 1}
    if growth:
        worst = max(growth, key=growth.get)
        print(f"RATIO {name} peak RSS largest/smallest N = {growth[worst]:.2f} (the most: {worst})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 4000, 16000])
    p.add_argument("--full", action="store_true", help="also N = 83000")
    p.add_argument("--no-extract", action="store_true", help="skip the one-shard hidden-state extraction")
    p.add_argument(
        "--shard-tokens", type=int, default=1_000_000, help="merge.shard_tokens (the extracted shard's size)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="make test's size (N = 10, 20, no extraction), every stage in this process: "
        "seconds, checks the script runs; not figures",
    )
    args = p.parse_args()
    if args.smoke:
        import _harness

        _harness.IN_PROCESS = True
        args.sizes, args.shard_tokens, args.no_extract = (
            [10, 20],
            8192,
            True,
        )  # extraction: extract_throughput, vllm_extract
    sizes = args.sizes + ([83_000] if args.full else [])
    with tempfile.TemporaryDirectory(
        prefix="bench-scale-", dir=REPO / ".cache" if (REPO / ".cache").exists() else None
    ) as tmp:
        results = run(sizes, Path(tmp), extract=not args.no_extract, shard_tokens=args.shard_tokens, quiet=args.smoke)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print()
    print(
        table(
            results,
            [
                ("stage", "stage"),
                ("n", "N"),
                ("rows", "rows"),
                ("tokens", "tokens"),
                ("work_s", "work s"),
                ("process_s", "process s"),
                ("cpu_s", "CPU s"),
                ("tok_per_s", "tok/s"),
                ("peak_rss_mib", "peak RSS MiB"),
                ("note", ""),
            ],
        )
    )
    print()
    print(
        table(
            slopes(results),
            [
                ("stage", "stage"),
                ("work_ms_per_row", "work ms/row"),
                ("cpu_ms_per_row", "CPU ms/row"),
                ("fixed_cpu_s", "fixed CPU s"),
                ("cpu_at_83k_s", "projected CPU s at 83k"),
                ("rss_min", "RSS min MiB"),
                ("rss_max", "RSS max MiB"),
            ],
        )
    )
    rss_ratio([r for r in results if r["stage"] != "extract_hidden_states"], "scale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
