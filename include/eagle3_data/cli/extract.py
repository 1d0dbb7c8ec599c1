"""`eagle3-data extract` (merged records -> packed hidden-state shards) and `export-specforge`."""

from __future__ import annotations

import argparse

from eagle3_data.cli.merge import add_store_args, open_store, parse_stage_uri


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("extract", help="run the target model and store EAGLE-3 aux hidden states")
    p.add_argument("--model", required=True, help="target model directory (AutoModelForCausalLM)")
    p.add_argument("--input", required=True,
                   help="merged parquet file or directory, or a merge stage s3://BUCKET/PREFIX/runs/RUN_KEY/merge/DATASET")
    p.add_argument("--out", required=True,
                   help="output directory, or a stage s3://BUCKET/PREFIX/runs/RUN_KEY/extract_hidden_states/DATASET")
    p.add_argument("--layers", default=None, help="comma-separated layer ids (default: EAGLE-3's for the convention)")
    p.add_argument("--convention", choices=["output", "input"], default="output",
                   help="'output of layer i' (SpecForge, Model-Optimizer) or 'input to layer i' (speculators, vLLM)")
    p.add_argument("--last-hidden", action="store_true", help="also store the final-norm hidden state (SpecForge needs it)")
    p.add_argument("--fp8", action="store_true", help="store aux states as fp8 e4m3 with a per-row scale (half the bytes)")
    p.add_argument("--storage-dtype", choices=["bf16", "fp32", "compute"], default="bf16",
                   help="dtype of the stored states whatever the forward ran in (compute: keep the forward's)")
    p.add_argument("--token-budget", type=int, default=16_384, help="padded tokens per forward")
    p.add_argument("--shard-tokens", type=int, default=65_536, help="tokens per output file")
    add_store_args(p)
    p.set_defaults(func=_run_extract)

    e = subparsers.add_parser("export-specforge", help="write packed shards as SpecForge offline .ckpt files")
    e.add_argument("--input", required=True, help="directory of shards, or an extraction stage s3://.../runs/R/S/D")
    e.add_argument("--out", required=True, help="directory for SpecForge's --train-hidden-states-path")
    add_store_args(e)
    e.set_defaults(func=_run_export)


def _layers(text: str | None) -> list[int] | None:
    from eagle3_data.errors import UserError

    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--layers {text!r}: expected comma-separated integers such as 1,29,57") from None


def _run_extract(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagle3_data.errors import UserError
    from eagle3_data.hidden_states.backends import TransformersBackend
    from eagle3_data.hidden_states.extract import (
        ExtractOptions, commit_extraction, extract_rows, extract_shard, read_merged_rows,
    )
    from eagle3_data.merge import merged_shards

    if not (Path(args.model) / "config.json").exists():
        raise UserError(f"--model {args.model}: no config.json there")
    layers = _layers(args.layers)
    remote_in, remote_out = args.input.startswith("s3://"), args.out.startswith("s3://")
    if remote_in != remote_out:
        raise UserError("--input and --out must both be S3 stage URIs or both local paths")
    backend = TransformersBackend(args.model)
    if remote_in:
        bucket, prefix, merge_ref = parse_stage_uri(args.input)
        out_bucket, out_prefix, out_ref = parse_stage_uri(args.out)
        if (bucket, prefix) != (out_bucket, out_prefix):
            raise UserError("--input and --out must be in the same bucket and prefix")
        store = open_store(args, bucket, prefix)
        shards = merged_shards(store, merge_ref)
        for shard in shards:
            summary = extract_shard(store, shard, args.model, out_ref, convention=args.convention, layers=layers,
                                    last_hidden=args.last_hidden, use_fp8=args.fp8, storage_dtype=args.storage_dtype,
                                    token_budget=args.token_budget, out_shard_tokens=args.shard_tokens, backend=backend)
            print(f"{shard['name']}: {summary['samples']} samples, {summary['tokens']} tokens"
                  f"{' (already done)' if summary.get('skipped') else ''}")
        params = {"convention": args.convention, "layers": layers, "last_hidden": args.last_hidden, "fp8": args.fp8,
                  "storage_dtype": args.storage_dtype}
        print(json.dumps(commit_extraction(store, merge_ref, out_ref, params=params), indent=1))
        return 0
    src = Path(args.input)
    paths = sorted(src.glob("*.parquet")) if src.is_dir() else [src]
    if not paths or not all(p.exists() for p in paths):
        raise UserError(f"--input {args.input}: no merged parquet shards there")
    options = ExtractOptions(convention=args.convention, layer_ids=layers, last_hidden=args.last_hidden,
                             token_budget=args.token_budget, out_shard_tokens=args.shard_tokens, use_fp8=args.fp8,
                             storage_dtype=args.storage_dtype)
    for path in paths:
        summary = extract_rows(backend, read_merged_rows([path]), args.out, path.stem, options)
        print(json.dumps({k: v for k, v in summary.items() if k != "norms"}))
    return 0


def _run_export(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from eagle3_data.errors import UserError
    from eagle3_data.hidden_states.export import export_specforge

    if not args.input.startswith("s3://"):
        paths = sorted(Path(args.input).glob("*.safetensors"))
        if not paths:
            raise UserError(f"--input {args.input}: no .safetensors shards there")
        print(f"{export_specforge(paths, args.out)} samples written to {args.out}")
        return 0
    bucket, prefix, ref = parse_stage_uri(args.input)
    store = open_store(args, bucket, prefix)
    names = [f["name"] for f in store.read_manifest(ref)["files"] if f["name"].endswith(".safetensors")]
    with tempfile.TemporaryDirectory(prefix="eagle3-export-") as tmp:
        def one_at_a_time():  # local disk holds one shard, not the whole stage
            for name in names:
                path = store.get_file(ref, name, Path(tmp) / name)
                yield path
                path.unlink()

        print(f"{export_specforge(one_at_a_time(), args.out)} samples written to {args.out}")
    return 0
