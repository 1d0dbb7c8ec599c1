"""`eagle3-data dev serve`: the dev inference server (SGLang /generate + OpenRouter-shaped chat)."""

from __future__ import annotations

import argparse


def register(dev_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = dev_sub.add_parser(
        "serve", help="run the dev inference server on 127.0.0.1 (stand-in for SGLang and OpenRouter)"
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokenizer", required=True, help="Kimi tokenizer directory (see `dev build-tokenizer`)")
    p.add_argument("--config", help="dev server YAML: fault injection, prices, per-dataset BPE split rates")
    p.add_argument("--pipeline-config", help="pipeline YAML: take per-dataset BPE split rates from datasets[].dev")
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every route but /health, as SGLang's --api-key does",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data.dev.faults import load_config
    from eagle3_data.dev.inference_server import serve

    config = load_config(args.config)
    if args.pipeline_config:
        from eagle3_data.config import load_config as load_pipeline

        for ds in load_pipeline(args.pipeline_config).datasets:
            config.datasets.setdefault(ds.name, {"noncanonical_rate": ds.dev_bpe_split_rate})
    serve(args.tokenizer, args.port, config, api_key=args.api_key)
    return 0
