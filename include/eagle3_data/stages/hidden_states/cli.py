"""`eagle3-data extract` (merged records -> packed hidden-state shards), `export-specforge` and
`export-speculators` (the shards in each trainer's layout, with the merge's draft vocabulary)."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from eagle3_data.cli.runs import (
    add_config_arg,
    add_fresh_arg,
    add_store_args,
    open_store,
    parse_stage_uri,
    printed,
    run_of_stage,
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("extract", help="run the target model and store EAGLE-3 aux hidden states")
    p.add_argument(
        "--input",
        required=True,
        help="a merge stage s3://BUCKET/[PREFIX/]runs/RUN_KEY/merge/all (writes runs/RUN_KEY/hidden_states/all, "
        "the DAG's stage), or merged parquet file(s) / a directory of them (with --out)",
    )
    p.add_argument("--out", help="file mode: output directory")
    p.add_argument("--model", help="target model directory (default: the config's model.source)")
    p.add_argument("--layers", default=None, help="comma-separated layer ids (default: EAGLE-3's for the convention)")
    p.add_argument(
        "--convention",
        choices=["output", "input"],
        help="'output of layer i' (SpecForge, Model-Optimizer) or 'input to layer i' (speculators, vLLM)",
    )
    p.add_argument(
        "--last-hidden",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also store the last layer's state (every trainer needs it; default: the config's, on)",
    )
    p.add_argument(
        "--last-hidden-norm",
        choices=["pre", "post"],
        help="the last state before the final norm (speculators; export-specforge normalises it) or after",
    )
    p.add_argument(
        "--fp8",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store aux states as fp8 e4m3 with a per-row scale (half the bytes)",
    )
    p.add_argument(
        "--storage-dtype",
        choices=["bf16", "fp32", "compute"],
        help="dtype of the stored states whatever the forward ran in (compute: keep the forward's)",
    )
    p.add_argument("--token-budget", type=int, help="padded tokens per forward (default: the config's batch_tokens)")
    p.add_argument("--shard-tokens", type=int, help="tokens per output file")
    p.add_argument(
        "--backend",
        choices=["transformers", "vllm"],
        help="transformers forward, or a vLLM engine from .venv-vllm ($EAGLE3_VLLM_PYTHON) started once",
    )
    p.add_argument("--tensor-parallel-size", type=int, help="vllm: GPUs of the engine (8 for Kimi-K2.5)")
    add_config_arg(p)
    add_fresh_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run_extract)

    e = subparsers.add_parser("export-specforge", help="write packed shards as SpecForge offline .ckpt files")
    e.add_argument("--input", required=True, help="directory of shards, or an extraction stage s3://.../runs/R/S/D")
    e.add_argument("--out", required=True, help="directory for SpecForge's --train-hidden-states-path")
    e.add_argument(
        "--draft-vocab",
        help="a folder holding the merge's vocab_mapping-N.pt (default: beside the shards; "
        "an s3:// stage: its merge's)",
    )
    e.add_argument(
        "--ids-only",
        action="store_true",
        help="pre-tokenized JSONL (input_ids, loss_mask) of a merge stage "
        "for online training: --input s3://.../merge/all or a folder of merged .parquet shards",
    )
    _add_check_args(e)
    add_store_args(e)
    e.set_defaults(func=_run_export)

    v = subparsers.add_parser("export-speculators", help="write packed shards in vLLM speculators' offline layout")
    v.add_argument("--input", required=True, help="directory of shards, or an extraction stage s3://.../runs/R/S/D")
    v.add_argument(
        "--out",
        required=True,
        help="directory for speculators' --data-path (a save_to_disk dataset + hidden_states/hs_{i}.safetensors)",
    )
    v.add_argument(
        "--fp8", action="store_true", help="states as float8_e4m3fn + per-token scales (speculators' fp8 backend)"
    )
    v.add_argument(
        "--ids-only",
        action="store_true",
        help="speculators' pretokenized rows (input_ids, loss_mask) of a "
        "merge stage for online training, no states: --input s3://.../merge/all or a folder of merged .parquet",
    )
    v.add_argument(
        "--draft-vocab",
        help="a folder holding the merge's token_freq.pt, d2t-N.npy, t2d-N.npy (default: "
        "beside the shards; an s3:// stage: its merge's)",
    )
    _add_check_args(v)
    add_store_args(v)
    v.set_defaults(func=_run_export_speculators)


def _add_check_args(p: argparse.ArgumentParser) -> None:
    """The export's own check (exports/check.py), run before it reports success."""
    p.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check the export through its trainer's own reader before reporting success (default; "
        "--no-check skips it)",
    )
    p.add_argument("--check-samples", type=int, help="rows checked (default: the config's export.check_samples)")
    p.add_argument("--all", action="store_true", help="check every row")
    p.add_argument("--model", help="the target, for the check's final norm and LM head (default: the config's)")
    add_config_arg(p)


def _layers(text: str | None) -> list[int] | None:
    from eagle3_data.errors import UserError

    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--layers {text!r}: expected comma-separated integers such as 1,29,57") from None


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as `hidden_states` / `model` config overrides: the stage's params follow from the config."""
    h = {
        k: v
        for k, v in (
            ("convention", args.convention),
            ("layer_ids", _layers(args.layers)),
            ("last_hidden", args.last_hidden),
            ("last_hidden_norm", args.last_hidden_norm),
            ("fp8", args.fp8),
            ("storage_dtype", args.storage_dtype),
            ("batch_tokens", args.token_budget),
            ("shard_tokens", args.shard_tokens),
            ("backend", args.backend),
            ("tensor_parallel_size", args.tensor_parallel_size),
        )
        if v is not None
    }
    out: dict[str, Any] = {
        "hidden_states": {**h, "workers": 1}
    }  # this process extracts every shard, the model loaded once
    if args.model:
        out["model"] = {"source": str(args.model)}
    return out


def _run_extract(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from eagle3_data.errors import UserError

    if args.input.startswith("s3://"):
        from eagle3_data import pipeline

        if args.out:
            raise UserError("--out is for local files: a merge stage's states go to runs/RUN_KEY/hidden_states/all")
        run, store, _ = run_of_stage(args, args.input, ("merge",), overrides_of(args))
        for work in pipeline.plan_hidden_states(run, store):  # hidden_states.workers = 1: this process
            for shard in pipeline.extract_hidden_states(run, store, work).shards:
                print(
                    f"{shard.shard}: {shard.samples} samples, {shard.tokens} "
                    f"tokens{' (already done)' if shard.skipped else ''}"
                )
        print(printed(pipeline.commit_hidden_states(run, store)))
        return 0
    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.images import MERGED_IMAGES_FILE, image_index
    from eagle3_data.stages.hidden_states.engines import shared_backend
    from eagle3_data.stages.hidden_states.extract import extract_rows, read_merged_rows

    if not args.out:
        raise UserError("--out is required with local merged files")
    config = load_config(args.config).with_overrides(overrides_of(args), where="command line")
    model = Path(resolve_source(config.model.source))
    if not (model / "config.json").exists():
        raise UserError(f"--model {model}: no config.json there")
    src = Path(args.input)
    paths = sorted(src.glob("*.parquet")) if src.is_dir() else [src]
    if not paths or not all(p.exists() for p in paths):
        raise UserError(f"--input {args.input}: no merged parquet shards there")
    from eagle3_data.stages.hidden_states.vllm_backend import text_config

    vocab = text_config(model).get("vocab_size")  # Kimi-K2.5's is under text_config, not at the top
    for path in paths:
        check_merged_file(path, vocab)  # before the model loads: bad input costs no GPU time
    h = config.hidden_states
    backend = shared_backend(
        h.backend,
        model,
        tensor_parallel_size=h.tensor_parallel_size,
        max_model_len=config.merge.max_length + 1,
        max_images=h.max_images,
    )
    # local shards have no store to read their images from: image samples are left out, never
    # extracted over their ids alone (extract them from the run in S3 with hidden_states.max_images)
    sidecar = (src if src.is_dir() else src.parent) / MERGED_IMAGES_FILE
    image_samples = set(image_index(sidecar)) if sidecar.is_file() else set()
    for path in paths:
        rows = read_merged_rows([path])
        kept = [r for r in rows if r["sample_id"] not in image_samples]
        summary = extract_rows(backend, kept, args.out, path.stem, h)
        if len(kept) < len(rows):
            summary["left_out"] = {
                "image_samples": len(rows) - len(kept),
                "reason": "local shards: images need the run's store",
            }
        print(json.dumps({k: v for k, v in summary.items() if k != "norms"}))
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from eagle3_data.exports.ids import export_specforge_ids
    from eagle3_data.stages.hidden_states.export import export_specforge

    return _export(
        args,
        "specforge",
        lambda paths, out, images: export_specforge(paths, out, images, source=_source(args)),
        export_specforge_ids,
    )


def _run_export_speculators(args: argparse.Namespace) -> int:
    from eagle3_data.exports.ids import export_speculators_ids
    from eagle3_data.exports.speculators_export import export_speculators

    return _export(
        args,
        "speculators",
        lambda paths, out, images: export_speculators(paths, out, fp8=args.fp8, images=images, source=_source(args)),
        export_speculators_ids,
    )


def _export(args: argparse.Namespace, trainer: str, states, ids_only) -> int:
    """One export: the extraction's shards through `states`, or with --ids-only the merged rows
    through `ids_only`; the trainer's draft-vocabulary files copied beside them, the image
    samples' references (the merge's images.jsonl) handed to both."""
    from pathlib import Path

    from eagle3_data.images import LEFT_OUT_FILE
    from eagle3_data.stages.hidden_states.extract import read_merged_rows

    with _export_input(args, trainer) as (paths, vocab, images):
        if args.ids_only:
            n = ids_only((row for path in paths for row in read_merged_rows([path])), args.out, images)
        else:
            n = states(paths, args.out, images)
        _copy_vocab(vocab, args.out)
    checked = None if args.ids_only else _self_check(args)
    left = Path(args.out) / LEFT_OUT_FILE
    left_out = len(left.read_text().splitlines()) if left.exists() else 0
    print(
        f"{n} samples written to {args.out}"
        + (" (ids only)" if args.ids_only else "")
        + _vocab_note(vocab)
        + (f"; {left_out} image samples left out ({trainer}'s format holds no images): {left}" if left_out else "")
        + (f"; {checked}" if checked else "")
    )
    return 0


def _source(args: argparse.Namespace) -> str:
    """The extraction an export came from, as export_info.json records it (check-export's default)."""
    from pathlib import Path

    return args.input if args.input.startswith("s3://") else str(Path(args.input).resolve())


def _self_check(args: argparse.Namespace) -> str | None:
    """The export's own check on a sample of rows (config export.check_samples, --check-samples,
    --all); a failure moves the folder to OUT.check-failed, so nothing that looks complete is left
    at OUT, and raises ExportCheckFailed (exit 1). Returns the line the export prints."""
    import shutil
    import tempfile
    from pathlib import Path

    from eagle3_data.cli.check_export import shard_source
    from eagle3_data.config import load_config, resolve_source
    from eagle3_data.exports.check import ExportCheckFailed, check_export

    config = load_config(args.config)
    samples = (
        None if args.all else (args.check_samples if args.check_samples is not None else config.export.check_samples)
    )
    if not args.check or samples == 0:
        return "not checked (--no-check)"
    model = Path(args.model or resolve_source(config.model.source))
    try:
        with tempfile.TemporaryDirectory(prefix="eagle3-check-shards-") as work:
            result = check_export(args.out, model, shard_source(args, _source(args), work), samples=samples)
    except ExportCheckFailed as exc:
        failed = Path(f"{str(args.out).rstrip('/')}.check-failed")
        shutil.rmtree(failed, ignore_errors=True)
        Path(args.out).rename(failed)
        raise ExportCheckFailed(f"{exc} (the export is moved to {failed})") from None
    lp = result["logprob"]
    return (
        f"checked {result['rows_checked']} of {result['rows']} rows through {result['layout']}'s reader: "
        f"{result['trained_positions']} trained positions, max |log p diff| {lp['max_abs_diff']:.2g} nats "
        f"(tolerance {lp['tolerance']})"
    )


def _copy_vocab(vocab: list[Any], out: str) -> None:
    import shutil

    for path in vocab:  # where the trainer looks: speculators in its data path, SpecForge's --vocab-mapping-path
        shutil.copyfile(path, f"{out}/{path.name}")


def _vocab_note(vocab: list[Any]) -> str:
    return f"; draft vocabulary: {', '.join(p.name for p in vocab)}" if vocab else "; no draft vocabulary found"


@contextlib.contextmanager
def _export_input(args: argparse.Namespace, trainer: str):
    """(the input's files as local paths, the trainer's draft-vocabulary files). The files: the
    extraction's .safetensors shards, or with --ids-only the merge stage's .parquet shards; from a
    folder (the vocabulary beside them, or in --draft-vocab), or from a stage, fetched one at a
    time (local disk holds one shard, not the whole stage), with the vocabulary of the merge: the
    stage itself, or the one the extraction came from."""
    import tempfile
    from pathlib import Path

    from eagle3_data.draft_vocab import is_file_of
    from eagle3_data.errors import UserError
    from eagle3_data.images import MERGED_IMAGES_FILE, image_index

    suffix = ".parquet" if args.ids_only else ".safetensors"
    if not args.input.startswith("s3://"):
        paths = sorted(Path(args.input).glob(f"*{suffix}"))
        if not paths:
            raise UserError(
                f"--input {args.input}: "
                + (
                    "no merged .parquet shards there (--ids-only exports the merge stage)"
                    if args.ids_only
                    else "no .safetensors shards there"
                )
            )
        where = Path(args.draft_vocab or args.input)
        found = [p / MERGED_IMAGES_FILE for p in (where, Path(args.input)) if (p / MERGED_IMAGES_FILE).is_file()]
        yield (
            paths,
            (sorted(p for p in where.iterdir() if is_file_of(trainer, p.name)) if where.is_dir() else []),
            image_index(found[0]) if found else {},
        )
        return
    bucket, prefix, ref = parse_stage_uri(args.input)
    if args.ids_only and ref.stage != "merge":
        raise UserError(
            f"--input {args.input}: a {ref.stage!r} stage; --ids-only exports the merge stage "
            "(s3://.../runs/R/merge/all)"
        )
    store = open_store(args, bucket, prefix)
    manifest = store.read_manifest(ref)
    merges = [ref] if args.ids_only else [parse_stage_uri(r["uri"])[2] for r in manifest.get("inputs", [])]
    with tempfile.TemporaryDirectory(prefix="eagle3-export-") as tmp:
        vocab = [
            store.get_file(m, f["name"], Path(tmp) / f["name"], sha256=f["sha256"])
            for m in merges
            for f in store.read_manifest(m)["files"]
            if is_file_of(trainer, f["name"])
        ]
        images = {
            sid: refs
            for m in merges
            for f in store.read_manifest(m)["files"]
            if f["name"] == MERGED_IMAGES_FILE
            for sid, refs in image_index(
                store.get_file(m, f["name"], Path(tmp) / f["name"], sha256=f["sha256"])
            ).items()
        }

        def one_at_a_time():
            for f in manifest["files"]:
                if f["name"].endswith(suffix):
                    path = store.get_file(ref, f["name"], Path(tmp) / f["name"], sha256=f["sha256"])
                    yield path
                    path.unlink()

        yield one_at_a_time(), vocab, images


def check_merged_file(path, vocab_size: int | None) -> None:
    """A local merged shard, refused naming file, row and field: not Parquet, a missing or
    mistyped column (schemas.MERGED), ids outside the model's vocabulary, a loss_mask of
    another length than its input_ids."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from eagle3_data.errors import UserError
    from eagle3_data.stages.hidden_states.extract import check_merged_columns

    if path.suffix != ".parquet":
        raise UserError(
            f"--input {path}: merged shards are .parquet files (from `eagle3-data merge`), not "
            f"{path.suffix or 'no suffix'!r}"
        )
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"--input {path}: not a readable Parquet file ({str(exc).splitlines()[0][:120]})") from None
    actual = pf.schema_arrow
    for column, ok, want in (
        ("sample_id", pa.types.is_string, "strings"),
        ("input_ids", lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type), "lists of integers"),
        ("loss_mask", lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type), "lists of 0/1 integers"),
    ):
        if column in actual.names and not ok(actual.field(column).type):
            raise UserError(f"--input {path}: column {column!r} is {actual.field(column).type}, expected {want}")
    check_merged_columns(f"--input {path}", actual.names)
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=["sample_id", "input_ids", "loss_mask"]):
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        bad_len = pc.not_equal(pc.list_value_length(ids), pc.list_value_length(mask))
        flat = pc.list_flatten(ids)
        for i in range(batch.num_rows):
            if bad_len[i].as_py() or ids[i].as_py() is None:
                raise UserError(
                    f"--input {path} row {row + i + 1} (sample {batch.column('sample_id')[i].as_py()!r}): "
                    f"field loss_mask has {len(mask[i].as_py() or [])} entries for "
                    f"{len(ids[i].as_py() or [])} input_ids"
                )
        if vocab_size and len(flat) and (pc.max(flat).as_py() >= vocab_size or pc.min(flat).as_py() < 0):
            for i in range(batch.num_rows):
                out = [t for t in ids[i].as_py() if t < 0 or t >= vocab_size]
                if out:
                    raise UserError(
                        f"--input {path} row {row + i + 1} (sample {batch.column('sample_id')[i].as_py()!r}): "
                        f"field input_ids holds {out[0]}, outside the model's vocabulary of {vocab_size}"
                    )
        row += batch.num_rows
