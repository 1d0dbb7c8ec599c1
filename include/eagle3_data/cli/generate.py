"""`eagle3-data generate local|overflow`: one dataset, end to end, into S3.

Without `--endpoint` / `--base-url` it starts the dev inference server for the duration of the
command, so the whole stage runs on a laptop. The OpenRouter key is read from the environment
(`OPENROUTER_API_KEY`), never from a flag: flags end up in `ps` output and shell history.

Before anything is requested: the bucket must exist (`eagle3-data s3 init`), the stage's lease
must be free (one writer per stage), and the prompt file is loaded with every malformed row
rejected loudly (printed per reason, `rejects.parquet` beside the parts); 0 usable rows stop the
command with nothing committed. The prompt file's URI, size and sha256 go into the manifest.
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
        q.add_argument("--config", help="pipeline YAML (default: $EAGLE3_CONFIG, else the packaged default)")
        q.add_argument("--bucket", help="S3 bucket (default: the config's storage.bucket)")
        q.add_argument("--prefix", help="S3 key prefix (default: the config's storage.prefix)")
        q.add_argument("--s3-endpoint", default=os.environ.get("AWS_ENDPOINT_URL"), help="S3 endpoint URL (SeaweedFS, MinIO, ...)")
        q.add_argument("--tokenizer", help="tokenizer dir or s3:// prefix (default: the config's tokenizer.source)")
        q.add_argument("--dev-config", help="fault/rate YAML for the embedded dev server (when no endpoint is given)")
        q.add_argument("--journal-dir", help="local journal of answers not yet committed (default ~/.cache/eagle3-data/journal)")
        q.add_argument("--rows-per-part", type=int)
        q.add_argument("--rerun", action="store_true",
                       help="reopen a complete stage: re-verify its parts, keep the sound ones, replay the local "
                            "journal, and request only what is missing or corrupt")
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
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.generation.progress import TqdmProgress
    from eagle3_data.prompts import (
        format_load_rejects,
        limit_prompt_tokens,
        load_prompts,
        prompt_token_limit,
        require_rows,
    )
    from eagle3_data.rejects import REJECTS_FILE, rejects_parquet
    from eagle3_data.storage import ArtifactStore, StageRef, s3_client
    from eagle3_data.storage.lease import refuse_if_busy
    from eagle3_data.tokenizer import load_tokenizer

    cfg = load_config(args.config)
    g = cfg.generation
    sampling = {"temperature": g.sampling.temperature, "top_p": g.sampling.top_p,
                "max_new_tokens": g.sampling.max_new_tokens, "thinking": g.sampling.thinking}
    client = s3_client(endpoint_url=args.s3_endpoint)
    store = ArtifactStore(client=client, bucket=args.bucket or cfg.storage.bucket,
                          prefix=cfg.storage.prefix if args.prefix is None else args.prefix)
    stage = "generate_local" if args.engine == "local" else "generate_overflow"
    ref = StageRef(run_key=args.run_key, stage=stage, dataset=args.dataset)
    store.check_bucket()
    load = load_prompts(args.prompts, args.dataset, date=None, sampling=sampling, repeats=g.repeats, client=client,
                        max_message_bytes=cfg.limits.max_message_bytes)
    if not load.rows:  # fail before the tokenizer loads
        print(format_load_rejects(load, where=f" of {args.prompts}"), file=sys.stderr)
        require_rows(load, f"--prompts {args.prompts}")
    refuse_if_busy(store, ref)  # a second writer exits here, before the tokenizer's seconds of loading
    if store.is_complete(ref):
        _check_same_prompts(store, ref, load.sources)
        if not args.rerun:
            from eagle3_data.generation.checkpoint import reused_summary

            print(f"{store.uri(ref)} is complete: reused, nothing requested (--rerun re-verifies its parts and "
                  f"redoes only what is missing or corrupt)", file=sys.stderr)
            print(json.dumps(reused_summary(store, ref), indent=1))
            return 0
    tokenizer = load_tokenizer(resolve_source(args.tokenizer or cfg.tokenizer.source), s3_client=client)
    fmt = get_output_format(tokenizer, thinking=g.sampling.thinking)
    limit_prompt_tokens(load, prompt_token_limit(tokenizer, cfg.limits.max_prompt_tokens, g.sampling.max_new_tokens),
                        lambda messages, tools: len(fmt.generation_prompt_ids(messages, tools)))
    print(format_load_rejects(load, where=f" of {args.prompts} (rejects.parquet beside the stage's parts)"), file=sys.stderr)
    require_rows(load, f"--prompts {args.prompts}")
    rows = load.rows
    given = args.endpoint if args.engine == "local" else args.base_url
    with contextlib.ExitStack() as stack:
        if not given:
            from eagle3_data.dev.inference_server import DevServerProcess

            server = DevServerProcess(tokenizer.name_or_path, args.dev_config)
            stack.callback(server.stop)
            print(f"dev inference server on {server.url}", file=sys.stderr)
        common = dict(inputs=load.sources, progress=TqdmProgress(), journal_dir=args.journal_dir, routes=None,
                      rerun=args.rerun, side_files={REJECTS_FILE: rejects_parquet(load.rejects)})
        if args.engine == "local":
            if cfg.generation.local.engine == "vllm":  # vLLM OpenAI servers instead of SGLang
                from eagle3_data.generation.vllm import generate_local
            else:
                from eagle3_data.generation.sglang import generate_local

            summary = generate_local(
                store, ref, rows, tokenizer, args.endpoint or [server.url], sampling,
                in_flight_per_endpoint=args.in_flight or g.local.in_flight_per_endpoint,
                rows_per_part=args.rows_per_part or g.local.rows_per_part, model=cfg.model.name,
                warmup_timeout_s=g.local.warmup_timeout_s, unreachable_timeout_s=g.local.unreachable_timeout_s,
                connect_timeout_s=g.local.connect_timeout_s, **common)
        else:
            from eagle3_data.generation.openrouter import generate_overflow

            key = os.environ.get(KEY_ENV) or ("dev-key-unused" if not given else "")
            summary = generate_overflow(
                store, ref, rows, tokenizer, args.base_url or server.url + "/v1", key, args.model or g.overflow.model,
                g.overflow.provider, g.overflow.max_usd if args.budget_usd is None else args.budget_usd,
                sampling=sampling, concurrency=args.concurrency or g.overflow.concurrency,
                price_usd_per_mtok=g.overflow.price_usd_per_mtok.model_dump(),
                rows_per_part=args.rows_per_part or g.overflow.rows_per_part,
                unreachable_timeout_s=g.overflow.unreachable_timeout_s, connect_timeout_s=g.overflow.connect_timeout_s,
                **common)
    print(json.dumps(summary, indent=1))
    return 0 if summary.get("complete") else 3


def _check_same_prompts(store, ref, sources: list[dict]) -> None:
    """A complete stage is reused only for the prompt files it was made from (URI and sha256)."""
    from eagle3_data.errors import UserError

    recorded = {(i.get("uri"), i.get("sha256")) for i in store.read_manifest(ref).get("inputs", [])}
    given = {(s["uri"], s["sha256"]) for s in sources}
    if recorded != given:
        was = ", ".join(f"{u} sha256 {(h or '?')[:12]}" for u, h in sorted(recorded, key=str)) or "no recorded inputs"
        now = ", ".join(f"{u} sha256 {h[:12]}" for u, h in sorted(given))
        raise UserError(f"{store.uri(ref)} is complete but was made from {was}, not {now}: use another --run-key, "
                        f"or `eagle3-data stage discard {store.uri(ref)}` first")
