"""Merge peak RSS and work time against N samples and sample length (issue 14, deliverable 3).

    nice -n 19 .venv/bin/python benchmarks/merge_memory.py                  # N = 1k, 4k, 16k x ~1.2k tokens
    nice -n 19 .venv/bin/python benchmarks/merge_memory.py --full           # + 83k x 1.2k and 16k x 6k tokens
    nice -n 19 .venv/bin/python benchmarks/merge_memory.py --sizes 1000x1195 --merge-kwargs '{"seed": 3}'

Each merge runs in its own process (as the DAG's merge task does) on inputs written to a real
SeaweedFS beforehand; peak RSS is that process's own high-water mark (VmHWM), imports included (~130 MiB of it is
pyarrow + boto3 + numpy before any row is read). The input is one local dataset plus an overflow
stage that repeats 10% of its sample ids (the dedupe path) and adds 10% new ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import measure, seaweedfs, slope, store_for, table, write_generations

DEFAULT = ["1000x1195", "4000x1195", "16000x1195"]
FULL = ["83000x1195", "16000x6000"]

SETUP = """
from eagle3_data.stages.merge.datasets import merge_datasets
if os.environ.get("BENCH_IMPL"):  # another merge module (an older commit's datasets.py) measured alike
    import importlib.util
    spec = importlib.util.spec_from_file_location("merge_impl", os.environ["BENCH_IMPL"])
    impl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(impl)
    merge_datasets = impl.merge_datasets
from eagle3_data.storage import ArtifactStore, StageRef, s3_client
store = ArtifactStore(s3_client(), bucket=os.environ["BENCH_BUCKET"], prefix="eagle3-datagen")
inputs = [StageRef(*r) for r in json.loads(os.environ["BENCH_INPUTS"])]
kwargs = json.loads(os.environ["BENCH_KWARGS"])
import inspect
if "config" in inspect.signature(merge_datasets).parameters:  # this tree's merge: its settings as the config's model
    from eagle3_data.config import MergeConfig
    section = {k: kwargs.pop(k) for k in list(kwargs) if k in MergeConfig.model_fields}
    kwargs = {"config": MergeConfig(**{"max_length": 4096, "shard_tokens": 1 << 20, **section}), **kwargs}
if "context" in inspect.signature(merge_datasets).parameters:  # this tree's: tokens_per_bucket, work_dir in it
    import dataclasses
    context_type = merge_datasets.__globals__["MergeContext"]  # the measured module's own
    fields = {f.name for f in dataclasses.fields(context_type)}
    kwargs["context"] = context_type(**{k: kwargs.pop(k) for k in list(kwargs) if k in fields})
"""
WORK = """
if "vocab_size" in inspect.signature(merge_datasets).parameters:  # required since 2026-12-03: Kimi's
    kwargs.setdefault("vocab_size", 163_840)
s = merge_datasets(store, inputs, os.environ["BENCH_OUT"], **kwargs)
RESULT = {"shards": len(s["shards"]), "tokens": s["totals"]["tokens"], "samples": s["totals"]["samples"]}
"""


def run(sizes: list[str], impls: dict[str, tuple[str, dict]]) -> list[dict]:
    """impls: label -> (merge module path or "" for the installed one, merge kwargs); measured interleaved."""
    from eagle3_data.storage import StageRef

    rows = []
    with seaweedfs() as (handle, env):
        for size in sizes:
            n, length = (int(v) for v in size.split("x"))
            bucket = f"merge-{n}x{length}"
            store = store_for(handle, bucket)
            run_key = f"bench-{n}x{length}"
            local = StageRef(run_key, "generate_local", "chat")
            overflow = StageRef(run_key, "reconstruct", "chat")
            tokens = write_generations(store, local, n, length, seed=n)
            tokens += write_generations(
                store, overflow, n // 10, length, source="openrouter", seed=n + 1, id_prefix="s"
            )
            tokens += write_generations(
                store,
                StageRef(run_key, "reconstruct", "extra"),
                n // 10,
                length,
                source="openrouter",
                seed=n + 2,
                id_prefix="x",
            )
            inputs = [local, overflow, StageRef(run_key, "reconstruct", "extra")]
            for label, (impl, merge_kwargs) in impls.items():
                child_env = {
                    **env,
                    "BENCH_BUCKET": bucket,
                    "BENCH_OUT": f"{run_key}-{label}",
                    "BENCH_IMPL": impl,
                    "BENCH_INPUTS": json.dumps([[r.run_key, r.stage, r.dataset] for r in inputs]),
                    "BENCH_KWARGS": json.dumps({"max_length": 1 << 20, **merge_kwargs}),
                }
                m = measure(SETUP, WORK, child_env)
                row = {
                    "impl": label,
                    "n": n,
                    "tokens_per_sample": length,
                    "input_tokens": tokens,
                    **m["result"],
                    "work_s": m["work_s"],
                    "cpu_s": m["cpu_s"],
                    "peak_rss_mib": m["peak_rss_mib"],
                    "tok_per_s": m["result"]["tokens"] / m["work_s"],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="*", default=None, help="NxTOKENS per sample (default 1k, 4k, 16k x 1195)")
    p.add_argument("--full", action="store_true", help="also 83k x 1195 and 16k x 6000 tokens")
    p.add_argument("--merge-kwargs", default="{}", help="JSON keyword arguments for merge_datasets")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="MERGE_PY",
        help="also measure this merge module ( `git show REV:include/eagle3_data/stages/merge/datasets.py > old.py`), "
        "interleaved with the installed one, with --baseline-kwargs",
    )
    p.add_argument("--baseline-kwargs", default="{}")
    p.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.sizes = ["100x200", "200x200"]
    sizes = args.sizes or (DEFAULT + (FULL if args.full else []))
    impls = {"installed": ("", json.loads(args.merge_kwargs))}
    if args.baseline:
        impls["baseline"] = (str(Path(args.baseline).resolve()), json.loads(args.baseline_kwargs))
    rows = run(sizes, impls)
    print(
        table(
            rows,
            [
                ("impl", "merge"),
                ("n", "N"),
                ("tokens_per_sample", "tokens/sample"),
                ("tokens", "merged tokens"),
                ("shards", "shards"),
                ("work_s", "work s"),
                ("cpu_s", "CPU s"),
                ("tok_per_s", "tok/s"),
                ("peak_rss_mib", "peak RSS MiB"),
            ],
        )
    )
    for impl in impls:
        pts = [(r["n"] / 1000, r["peak_rss_mib"]) for r in rows if r["impl"] == impl]
        if len(pts) >= 2:
            print(
                f"RATIO merge_memory {impl} peak RSS largest/smallest N = {pts[-1][1] / pts[0][1]:.2f} "
                f"(slope {slope(pts):.1f} MiB per 1k samples)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
