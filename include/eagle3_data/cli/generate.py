"""`eagle3-data generate local|overflow`: one dataset, end to end, into S3.

Without `--endpoint` / `--base-url` it starts the dev inference server for the duration of the
command, so the whole stage runs on a laptop. The OpenRouter key is read from the environment
(`OPENROUTER_API_KEY`), never from a flag: flags end up in `ps` output and shell history.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

KEY_ENV = "OPENROUTER_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="run a generation stage for one dataset (SGLang or OpenRouter)")
    sub = p.add_subparsers(dest="engine", required=True)
    for engine, help_ in (("local", "SGLang /generate endpoints: exact output ids"),
                          ("overflow", "OpenRouter chat completions: text, reconstructed later")):
        q = sub.add_parser(engine, help=help_)
        q.add_argument("--dataset", required=True)
        q.add_argument("--prompts", required=True, help="prompt JSONL file or s3:// URI (OpenAI messages + tools)")
        q.add_argument("--run-key", required=True, help="e.g. date=2026-11-29 or a run name")
        q.add_argument("--config", help="pipeline YAML (default: $EAGLE3_CONFIG or include/config/pipeline.yaml)")
        q.add_argument("--bucket", help="S3 bucket (default: the config's storage.bucket)")
        q.add_argument("--prefix", help="S3 key prefix (default: the config's storage.prefix)")
        q.add_argument("--s3-endpoint", default=os.environ.get("AWS_ENDPOINT_URL"), help="S3 endpoint URL (SeaweedFS, MinIO, ...)")
        q.add_argument("--tokenizer", help="tokenizer dir or s3:// prefix (default: the config's tokenizer.source)")
        q.add_argument("--dev-config", help="fault/rate YAML for the embedded dev server (when no endpoint is given)")
        q.add_argument("--journal-dir", help="local journal of answers not yet committed (default ~/.cache/eagle3-data/journal)")
        q.add_argument("--rows-per-part", type=int)
        if engine == "local":
            q.add_argument("--endpoint", action="append", default=[], help="SGLang base URL; repeat for data parallel")
            q.add_argument("--in-flight", type=int, help="requests in flight per endpoint")
        else:
            q.add_argument("--base-url", help="OpenAI-compatible base URL, e.g. https://openrouter.ai/api/v1")
            q.add_argument("--model", help="model slug (default: the config's generation.overflow.model)")
            q.add_argument("--budget-usd", type=float, help="stop dispatching at this spend (default: config max_usd)")
            q.add_argument("--concurrency", type=int)
        q.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data.config import load_config
    from eagle3_data.generation.progress import TqdmProgress
    from eagle3_data.prompts import load_prompts
    from eagle3_data.storage import ArtifactStore, StageRef, s3_client
    from eagle3_data.tokenizer import load_tokenizer

    cfg = load_config(args.config)
    g = cfg.generation
    sampling = {"temperature": g.sampling.temperature, "top_p": g.sampling.top_p,
                "max_new_tokens": g.sampling.max_new_tokens, "thinking": g.sampling.thinking}
    client = s3_client(endpoint_url=args.s3_endpoint)
    store = ArtifactStore(client=client, bucket=args.bucket or cfg.storage.bucket,
                          prefix=cfg.storage.prefix if args.prefix is None else args.prefix)
    tokenizer_source = args.tokenizer or cfg.tokenizer.source
    tokenizer = load_tokenizer(tokenizer_source)
    rows = load_prompts(args.prompts, args.dataset, date=None, sampling=sampling, repeats=g.repeats, client=client).rows
    stage = "generate_local" if args.engine == "local" else "generate_overflow"
    ref = StageRef(run_key=args.run_key, stage=stage, dataset=args.dataset)
    given = args.endpoint if args.engine == "local" else args.base_url
    with contextlib.ExitStack() as stack:
        if not given:
            from eagle3_data.dev.inference_server import DevServerProcess

            server = DevServerProcess(tokenizer.name_or_path, args.dev_config)
            stack.callback(server.stop)
            print(f"dev inference server on {server.url}", file=sys.stderr)
        common = dict(inputs=None, progress=TqdmProgress(), journal_dir=args.journal_dir, routes=None)
        if args.engine == "local":
            from eagle3_data.generation.sglang import generate_local

            summary = generate_local(
                store, ref, rows, tokenizer, args.endpoint or [server.url], sampling,
                in_flight_per_endpoint=args.in_flight or g.local.in_flight_per_endpoint,
                rows_per_part=args.rows_per_part or g.local.rows_per_part, model=cfg.model.name, **common)
        else:
            from eagle3_data.generation.openrouter import generate_overflow

            key = os.environ.get(KEY_ENV) or ("dev-key-unused" if not given else "")
            summary = generate_overflow(
                store, ref, rows, tokenizer, args.base_url or server.url + "/v1", key, args.model or g.overflow.model,
                g.overflow.provider, g.overflow.max_usd if args.budget_usd is None else args.budget_usd,
                sampling=sampling, concurrency=args.concurrency or g.overflow.concurrency,
                rows_per_part=args.rows_per_part or g.overflow.rows_per_part, **common)
    print(json.dumps(summary, indent=1))
    return 0 if summary.get("complete") else 3
