"""Peak RSS of the prompt-handling stages (load_route, generate_local, generate_overflow) against N.

    nice -n 19 .venv/bin/python benchmarks/prompt_memory.py --sizes 1000 8000
    nice -n 19 .venv/bin/python benchmarks/prompt_memory.py --sizes 1000 8000 --code /tmp/old/include

The same stack, prompts and stage calls as benchmarks/scale.py (a ~5 KB tool schema per prompt,
half local, half overflow, the dev server at zero latency), but only the stages that hold prompts,
so a before/after comparison takes minutes, not an hour. Each stage runs in a fresh `nice -n 19`
process (benchmarks/_harness.measure); its peak RSS is that process's own high-water mark (VmHWM). `--code DIR`
puts DIR (a copy of an older `include/`) first on the stage processes' PYTHONPATH, so the same
run can measure the code before a change.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import REPO, measure, table
from scale import SETUP, STAGES, prompts_jsonl, quiet_server, rss_ratio

MEASURED = ("audit_tokenizer", "load_route", "generate_local", "generate_overflow")


def run(sizes: list[int], workdir: Path, code: Path | None, quiet: bool = False) -> list[dict]:
    from eagle3_devtools.stack import dev_stack

    datasets = [{"name": f"mem{n}", "prompts": f"s3://eagle3/bench-prompts/mem{n}.jsonl"} for n in sizes]
    overrides = {
        "datasets": datasets,
        "routing": {"strategy": "fraction", "overflow_fraction": 0.5},
        "generation": {"sampling": {"max_new_tokens": 2048}, "overflow": {"max_usd": 1e6}},
    }
    results = []
    with dev_stack(workdir, config_overrides=overrides) as stack:
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
        if code is not None:
            env["PYTHONPATH"] = str(code)
        client = stack.client()
        if quiet:
            quiet_server(stack.inference_url)
        for n in sizes:
            client.put_object(Bucket="eagle3", Key=f"bench-prompts/mem{n}.jsonl", Body=prompts_jsonl(n))
            run_key, ds = f"mem-{n}", f"mem{n}"
            env_n = {
                **env,
                "BENCH_DATASET": ds,
                "BENCH_PARAMS": json.dumps({"run_name": run_key, "datasets": [ds], "skip_hidden_states": True}),
            }
            for stage in MEASURED:
                m = measure(SETUP, STAGES[stage], env_n)
                row = {
                    "stage": stage,
                    "n": n,
                    "work_s": m["work_s"],
                    "cpu_s": m["cpu_s"],
                    "peak_rss_mib": m["peak_rss_mib"],
                    "result": m["result"],
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 8000])
    p.add_argument(
        "--code", type=Path, default=None, help="an include/ folder to run the stages from (default: this checkout)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="make test's size (N = 10, 20), every stage in this process: seconds, checks the script runs; not figures",
    )
    args = p.parse_args()
    if args.smoke:
        import _harness

        _harness.IN_PROCESS = True
        args.sizes = [10, 20]
    with tempfile.TemporaryDirectory(
        prefix="bench-mem-", dir=REPO / ".cache" if (REPO / ".cache").exists() else None
    ) as tmp:
        results = run(args.sizes, Path(tmp), args.code.resolve() if args.code else None, quiet=args.smoke)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print()
    print(
        table(
            results,
            [
                ("stage", "stage"),
                ("n", "N"),
                ("work_s", "work s"),
                ("cpu_s", "CPU s"),
                ("peak_rss_mib", "peak RSS MiB"),
            ],
        )
    )
    rss_ratio(results, "prompt_memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
