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
    p.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                   help="transformers forward, or a vLLM engine from .venv-vllm ($EAGLE3_VLLM_PYTHON) started once")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs of the engine (8 for Kimi-K2.5)")
    p.add_argument("--max-model-len", type=int, default=8192, help="vllm: longest sample + 1 (the engine's context)")
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
    from eagle3_data.hidden_states.engines import shared_backend
    from eagle3_data.hidden_states.extract import (
        ExtractOptions, commit_extraction, extract_rows, extract_shard, merged_sha256s, read_merged_rows,
    )
    from eagle3_data.merge import merged_shards

    if not (Path(args.model) / "config.json").exists():
        raise UserError(f"--model {args.model}: no config.json there")
    layers = _layers(args.layers)
    remote_in, remote_out = args.input.startswith("s3://"), args.out.startswith("s3://")
    if remote_in != remote_out:
        raise UserError("--input and --out must both be S3 stage URIs or both local paths")
    if not remote_in:
        src = Path(args.input)
        paths = sorted(src.glob("*.parquet")) if src.is_dir() else [src]
        if not paths or not all(p.exists() for p in paths):
            raise UserError(f"--input {args.input}: no merged parquet shards there")
        vocab = json.loads((Path(args.model) / "config.json").read_text()).get("vocab_size")
        for path in paths:
            check_merged_file(path, vocab)  # before the model loads: bad input costs no GPU time
    backend = shared_backend(args.backend, args.model, tensor_parallel_size=args.tensor_parallel_size,
                             max_model_len=args.max_model_len)
    if remote_in:
        bucket, prefix, merge_ref = parse_stage_uri(args.input)
        out_bucket, out_prefix, out_ref = parse_stage_uri(args.out)
        if (bucket, prefix) != (out_bucket, out_prefix):
            raise UserError("--input and --out must be in the same bucket and prefix")
        store = open_store(args, bucket, prefix)
        manifest = store.read_manifest(merge_ref)
        shas = merged_sha256s(manifest)
        for shard in merged_shards(store, merge_ref, manifest):
            summary = extract_shard(store, shard, args.model, out_ref, convention=args.convention, layers=layers,
                                    last_hidden=args.last_hidden, use_fp8=args.fp8, storage_dtype=args.storage_dtype,
                                    token_budget=args.token_budget, out_shard_tokens=args.shard_tokens, backend=backend,
                                    merged_sha256=shas.get(shard["name"]))
            print(f"{shard['name']}: {summary['samples']} samples, {summary['tokens']} tokens"
                  f"{' (already done)' if summary.get('skipped') else ''}")
        params = {"convention": args.convention, "layers": layers, "last_hidden": args.last_hidden, "fp8": args.fp8,
                  "storage_dtype": args.storage_dtype, "backend": args.backend}
        print(json.dumps(commit_extraction(store, merge_ref, out_ref, params=params), indent=1))
        return 0
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


MERGED_COLUMNS = ("sample_id", "input_ids", "loss_mask")


def check_merged_file(path, vocab_size: int | None) -> None:
    """A local merged shard, refused naming file, row and field: not Parquet, a missing or
    mistyped column (schemas.MERGED), ids outside the model's vocabulary, a loss_mask of
    another length than its input_ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from eagle3_data.errors import UserError

    if path.suffix != ".parquet":
        raise UserError(f"--input {path}: merged shards are .parquet files (from `eagle3-data merge`), not {path.suffix or 'no suffix'!r}")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"--input {path}: not a readable Parquet file ({str(exc).splitlines()[0][:120]})") from None
    actual = pf.schema_arrow
    for column, ok, want in (("sample_id", pa.types.is_string, "strings"),
                             ("input_ids", lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type), "lists of integers"),
                             ("loss_mask", lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type), "lists of 0/1 integers")):
        if column not in actual.names:
            raise UserError(f"--input {path}: column {column!r} is missing (a merged shard has {', '.join(MERGED_COLUMNS)})")
        if not ok(actual.field(column).type):
            raise UserError(f"--input {path}: column {column!r} is {actual.field(column).type}, expected {want}")
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=["sample_id", "input_ids", "loss_mask"]):
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        bad_len = pc.not_equal(pc.list_value_length(ids), pc.list_value_length(mask))
        flat = pc.list_flatten(ids)
        for i in range(batch.num_rows):
            if bad_len[i].as_py() or ids[i].as_py() is None:
                raise UserError(f"--input {path} row {row + i + 1} (sample {batch.column('sample_id')[i].as_py()!r}): "
                                f"field loss_mask has {len(mask[i].as_py() or [])} entries for "
                                f"{len(ids[i].as_py() or [])} input_ids")
        if vocab_size and len(flat) and (pc.max(flat).as_py() >= vocab_size or pc.min(flat).as_py() < 0):
            for i in range(batch.num_rows):
                out = [t for t in ids[i].as_py() if t < 0 or t >= vocab_size]
                if out:
                    raise UserError(f"--input {path} row {row + i + 1} (sample {batch.column('sample_id')[i].as_py()!r}): "
                                    f"field input_ids holds {out[0]}, outside the model's vocabulary of {vocab_size}")
        row += batch.num_rows
