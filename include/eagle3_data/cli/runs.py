"""What the stage commands share: a `Run` made from the same config models the DAG resolves, an
ArtifactStore opened the way the pipeline opens it, and stage URIs parsed into both.

A stage the CLI commits is the one the DAG would commit for the same config, run key and inputs
(same params, same input manifests), so either reuses what the other did.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from eagle3_data.errors import UserError

STAGE_URI = "s3://BUCKET/[PREFIX/]runs/RUN_KEY/STAGE/DATASET"


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)")
    p.add_argument("--region", default=None)


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="pipeline YAML (default: $EAGLE3_CONFIG, else the packaged default)")


def add_fresh_arg(p: argparse.ArgumentParser) -> None:
    from eagle3_data.stages import FRESH_STAGES

    p.add_argument(
        "--fresh",
        action="append",
        default=[],
        choices=FRESH_STAGES,
        metavar="STAGE",
        help="replace this committed stage of the run key when it was made from other inputs, params or "
        "tokenizer (otherwise the command refuses and changes nothing); repeat for the stages built on it, "
        f"which must be named too. Paid answers are archived and reused where they still match. STAGE: "
        f"{', '.join(FRESH_STAGES)}",
    )


def parse_stage_uri(uri: str):
    """`s3://bucket/[prefix/]runs/{run_key}/{stage}/{dataset}[/]` -> (bucket, prefix, StageRef)."""
    from eagle3_data.storage import StageRef

    parts = uri.removeprefix("s3://").strip("/").split("/") if uri.startswith("s3://") else []
    if len(parts) < 5 or parts[-4] != "runs":
        raise UserError(f"{uri!r}: expected {STAGE_URI}")
    return parts[0], "/".join(parts[1:-4]), StageRef(parts[-3], parts[-2], parts[-1])


def open_store(args: argparse.Namespace, bucket: str, prefix: str, stand_ins=()):
    from eagle3_data.storage import ArtifactStore, s3_client

    return ArtifactStore(
        s3_client(getattr(args, "endpoint_url", None), getattr(args, "region", None)),
        bucket=bucket,
        prefix=prefix,
        stand_ins=stand_ins,
    )


def cli_run(
    args: argparse.Namespace,
    run_key: str,
    datasets: list[str],
    overrides: dict[str, Any] | None = None,
    *,
    bucket: str | None = None,
    prefix: str | None = None,
):
    """(Run, store) for a stage command: the config (`--config`) with `overrides` merged as trigger
    params are (validated again; `overrides["datasets"]`: per-dataset fields by name), datasets the
    config lacks added with the global thresholds, the store on `bucket`/`prefix` when given."""
    from eagle3_data.config import deep_merge, load_config
    from eagle3_data.pipeline import Run
    from eagle3_data.pipeline import open_store as pipeline_store
    from eagle3_data.storage import check_name, s3_client

    check_name(run_key, "run key")
    config = load_config(getattr(args, "config", None))
    raw_datasets = config.raw["datasets"] + [{"name": d} for d in datasets if d not in config.dataset_names]
    overrides = dict(overrides or {})
    for item in overrides.pop("datasets", []):
        deep_merge(next(d for d in raw_datasets if d["name"] == item["name"]), item)
    storage = {k: v for k, v in (("bucket", bucket), ("prefix", prefix)) if v is not None}
    config = config.with_overrides(
        {**overrides, "datasets": raw_datasets, **({"storage": storage} if storage else {})}, where="command line"
    )
    client = s3_client(getattr(args, "endpoint_url", None), getattr(args, "region", None))
    run = Run(
        config=config,
        run_key=run_key,
        date=None,
        datasets=list(datasets),
        dry_run=False,
        skip_hidden_states=False,
        fresh=frozenset(getattr(args, "fresh", None) or ()),
    )
    return run, pipeline_store(config, client)


def run_of_stage(
    args: argparse.Namespace, uri: str, expected_stages: tuple[str, ...], overrides: dict[str, Any] | None = None
):
    """(Run, store, ref) for a command that takes the previous stage's URI: its run key, dataset,
    bucket and prefix are the URI's."""
    bucket, prefix, ref = parse_stage_uri(uri)
    if ref.stage not in expected_stages:
        raise UserError(
            f"--input {uri}: a {ref.stage!r} stage; this command takes {' or '.join(expected_stages)} "
            f"(the previous stage's URI, printed by the command that wrote it)"
        )
    from eagle3_data.stages import RUN_DATASET

    datasets = [] if ref.dataset == RUN_DATASET else [ref.dataset]  # a run-level stage (merge/all) names none
    run, store = cli_run(args, ref.run_key, datasets, overrides, bucket=bucket, prefix=prefix)
    return run, store, ref


# `--json` anywhere on the command line (cli.main sets it per call): a stage's full record as JSON
JSON_OUTPUT = False
SUMMARY_LINES = 20


def printed(result) -> str:
    """A stage result as the commands print it: a summary of at most SUMMARY_LINES lines on a
    terminal (what was committed, where, counts, spend, the gate); its fields as indented JSON with
    `--json`, and whenever stdout is not a terminal (piped, captured), so scripts keep parsing it."""
    import json

    record = result.as_dict() if hasattr(result, "as_dict") else result
    if JSON_OUTPUT or not sys.stdout.isatty() or not isinstance(record, dict):
        return json.dumps(record, indent=1, default=str)
    return summary(record)


def summary(record: dict[str, Any]) -> str:
    """`printed`'s terminal form: a headline (committed / reused / unchanged, and where), then one
    line per field: numbers as they are, small mappings inline, the gate as its verdict and reasons,
    anything long as its count; cut at SUMMARY_LINES with a pointer to `--json`."""
    where = record.get("uri") or record.get("summary_uri") or record.get("report_uri")
    state = "reused (already committed)" if record.get("reused") else "committed"
    if record.get("changed") is False:
        state = "unchanged (nothing new written)"
    lines = [f"{state}: {where}" if where else state]
    for key, value in record.items():
        if key in ("uri", "reused", "changed", "summary") or (key == "summary_uri" and where == value):
            continue
        lines.append(_summary_line(key, value))
    if len(lines) > SUMMARY_LINES - 1:
        lines = lines[: SUMMARY_LINES - 2] + [f"... {len(lines) - SUMMARY_LINES + 2} more fields"]
    return "\n".join([*lines, "(--json: the full record)"])


def _summary_line(key: str, value: Any) -> str:
    def scalar(v: Any) -> str:
        return (
            f"{v:,.6g}"
            if isinstance(v, float)
            else f"{v:,}"
            if isinstance(v, int) and not isinstance(v, bool)
            else str(v)
        )

    if key == "gate" and isinstance(value, dict) and "passed" in value:
        reasons = "; ".join(str(r) for r in value.get("reasons") or [])[:200]
        return f"gate: {'passed' if value['passed'] else 'FAILED'}" + (f": {reasons}" if reasons else "")
    if key.endswith("usd") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{key}: ${value:,.4f}"
    if isinstance(value, dict):
        if value and all(v is None or isinstance(v, (str, int, float, bool)) for v in value.values()):
            text = ", ".join(f"{k} {scalar(v)}" for k, v in value.items())
            return f"{key}: {text if len(text) <= 160 else text[:157] + '...'}"
        return f"{key}: {len(value)} entries"
    if isinstance(value, (list, tuple)):
        if len(value) <= 8 and all(isinstance(v, (str, int, float)) for v in value):
            return f"{key}: {', '.join(scalar(v) for v in value) or '(none)'}"
        return f"{key}: {len(value)} entries"
    return f"{key}: {scalar(value)}"


def dev_stand_in(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """Overrides naming `role` (local_engine, overflow_provider) a stand-in, beside the ones the
    config declares: every manifest the command writes then says the dev server answered."""
    from eagle3_data.config import load_config

    declared = load_config(getattr(args, "config", None)).stand_ins
    return {"stand_ins": list(dict.fromkeys([*declared, role]))}


def dev_server(stack: contextlib.ExitStack, run, dev_config: str | None = None) -> str:
    """Start the dev inference server on the run's tokenizer for the command's duration; its URL.
    Commands start it themselves (`--dev`) so that nobody has to find the dev tokenizer's folder
    under the cache to start one by hand."""
    from eagle3_data.config import resolve_source
    from eagle3_data.dev.inference_server import DevServerProcess

    server = DevServerProcess(resolve_source(run.config.tokenizer.source), dev_config)
    stack.callback(server.stop)
    print(f"dev inference server (a stand-in) on {server.url}", file=sys.stderr)
    return server.url


def mode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """--tokenizer / --thinking as config overrides (the stage's params follow from the config)."""
    out: dict[str, Any] = {}
    if args.tokenizer:
        out["tokenizer"] = {"source": args.tokenizer}
    if args.thinking is not None:
        out["generation"] = {"sampling": {"thinking": args.thinking}}
    return out
