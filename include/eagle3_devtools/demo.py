"""`make demo`: the whole DAG on a laptop, from a fresh clone, then a run report.

Builds (or reuses from .cache/) the Kimi tokenizer and the tiny target model, starts SeaweedFS
and the dev inference server on free 127.0.0.1 ports, uploads the sample datasets as today's
prompt partition, runs `eagle3_datagen` with `dag.test()` on SQLite in demo-output/airflow, prints
what happened and where the artifacts are, and stops everything it started.

`--engine vllm` (`make demo ENGINE=vllm`) puts the real engine in the loop: a `vllm serve` of the
tiny model (from .venv-vllm, fp32 on CPU) is the local generation endpoint
(`generation.local.engine: vllm`), and hidden states are extracted by the `vllm` backend (its
engine runs in .venv-vllm too). Overflow still goes to the dev server (OpenRouter's stand-in).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import sys
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from eagle3_data.config import DAG_ID, deep_merge, load_config
from eagle3_devtools.stack import REPO, airflow_db_migrate, airflow_env, dev_stack, tiny_model_dir, tokenizer_dir, upload_prompts

DEFAULT_WORKDIR = REPO / "demo-output"
# Small enough for two CPU cores in a few minutes; the shape of a real run.
DEMO_OVERRIDES = {"generation": {"sampling": {"max_new_tokens": 512}}, "merge": {"max_length": 1024, "shard_tokens": 8192}}
# The real engine for local generation and extraction (`--engine vllm`). The tiny target is a
# random model: greedy (its sampled ids wander across the whole vocabulary, into split UTF-8
# bytes), shorter outputs, and the BPE-split gate opened (its ids are rarely the tokenizer's
# canonical split of their own text; a real model's almost always are: bpe_only is still counted).
VLLM_OVERRIDES = {
    "generation": {"local": {"engine": "vllm"}, "sampling": {"temperature": 0.0, "max_new_tokens": 128}},
    "validation": {"max_bpe_mismatch_rate": 1.0},
    "hidden_states": {"backend": "vllm"},
}
VLLM_SERVER_MAX_MODEL_LEN = 4096  # the longest sample prompt + max_new_tokens


def run_dag(logical_date: datetime, conf: dict | None = None):
    """One DAG run through `dag.test()` in this process (env must already point at the stack)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    if bag.import_errors:
        raise RuntimeError(f"DAG import errors: {bag.import_errors}")
    return bag.dags[DAG_ID].test(logical_date=logical_date, run_conf=conf or {})


def task_states(dag_run) -> list[tuple[str, str, str, float]]:
    from airflow.utils.session import create_session

    with create_session() as session:
        tis = dag_run.get_task_instances(session=session)
        return sorted((ti.task_id, ti.rendered_map_index or ("" if ti.map_index < 0 else str(ti.map_index)), str(ti.state),
                       float(ti.duration or 0.0)) for ti in tis)


def report(stack, config, run_key: str, dag_run) -> str:
    """The run report a person reads: task states, per-dataset gates, tokens, cost, bytes, URIs."""
    from eagle3_data.pipeline import RUN_DATASET, open_store
    from eagle3_data.storage import StageRef

    lines = [f"DAG run {dag_run.run_id}: {dag_run.state}", "", "Tasks:"]
    lines += [f"  {tid:32s} {name:12s} {state:8s} {secs:7.1f} s" for tid, name, state, secs in task_states(dag_run)]
    store = open_store(config, stack.client())
    ref = StageRef(run_key, "publish", RUN_DATASET)
    if not store.is_complete(ref):
        lines += ["", f"No run summary at {store.uri(ref)}: the run stopped before publish (see task states above)."]
        return "\n".join(lines)
    s = store.get_json(ref, "summary.json")
    lines += ["", f"Run key {s['run_key']}", "", "Datasets:"]
    for name, d in s["datasets"].items():
        gate = "PASSED" if d["gate"]["passed"] else "FAILED: " + "; ".join(d["gate"]["reasons"])
        lines.append(
            f"  {name:12s} prompts {d['prompts']}, local {d['local']['ok']} ok/{d['local']['failed']} failed "
            f"({d['local']['completion_tokens']} output tokens), overflow {d['overflow']['ok']} ok/{d['overflow']['failed']} failed "
            f"({d['overflow']['completion_tokens']} output tokens, ${d['overflow']['cost_usd']:.4f}); gate {gate}"
        )
        lines.append(f"  {'':12s} report {d['gate']['report_uri']}")
    if s.get("merged"):
        t = s["merged"]["totals"]
        lines += ["", f"Merged: {t.get('samples', 0)} samples, {t.get('tokens', 0)} tokens ({t.get('loss_tokens', 0)} trained), "
                  f"{s['merged']['shards']} shard(s) at {s['merged_uri']}"]
    if s.get("hidden_states"):
        h = s["hidden_states"]
        lines.append(f"Hidden states: {h['totals']['samples']} samples, {h['totals']['tokens']} tokens, {h['totals']['bytes']:,} bytes, "
                     f"layers {h['layer_ids']} ({h['convention']} convention, {h['dtype']}) at {s['hidden_states_uri']}")
    lines += engine_lines(store, run_key, list(s["datasets"]))
    lines += [f"Overflow cost: ${s['cost_usd']:.4f}", f"Run report (UI page index): {s['report_uri']}", f"Summary: {s['summary_uri']}"]
    return "\n".join(lines)


def engine_lines(store, run_key: str, datasets: list[str]) -> list[str]:
    """Which engine produced the local ids and the hidden states, from the stages' manifests."""
    from eagle3_data.pipeline import RUN_DATASET
    from eagle3_data.storage import StageRef

    lines = []
    for ds in datasets:
        ref = StageRef(run_key, "generate_local", ds)
        if store.is_complete(ref):
            m = store.read_manifest(ref)
            served = ", ".join(f"{url} ({name})" for url, name in (m["extra"].get("served_models") or {}).items())
            lines.append(f"Local generation {ds}: engine {m['params'].get('source')}" + (f" at {served}" if served else ""))
    ref = StageRef(run_key, "hidden_states", RUN_DATASET)
    if store.is_complete(ref):
        extra = store.read_manifest(ref)["extra"]
        lines.append(f"Hidden-state backend {extra.get('backend')}: {', '.join(extra.get('engines') or [])}")
    return lines


def prestart_extraction(config) -> None:
    """Start the DAG's extraction engine now: `dag.test()` runs the extract task in this process,
    where `shared_backend` hands it this very engine (same model, TP and max_model_len), by then
    loaded while generation ran."""
    from eagle3_data.config import resolve_source
    from eagle3_data.hidden_states.engines import shared_backend
    from eagle3_data.hidden_states.layers import default_layer_ids, hidden_state_indices
    from eagle3_data.hidden_states.vllm_backend import text_config

    h, model = config.hidden_states, resolve_source(config.model.source)
    layers = text_config(model)["num_hidden_layers"]
    backend = shared_backend("vllm", model, tensor_parallel_size=h.tensor_parallel_size, max_model_len=config.merge.max_length + 1)
    backend.prestart(hidden_state_indices(default_layer_ids(layers, h.convention), h.convention, layers), h.last_hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="services' data and the Airflow home (recreated)")
    parser.add_argument("--conf", default="{}", help="DAG run conf as JSON, e.g. '{\"dry_run\": true}'")
    parser.add_argument("--engine", choices=("dev", "vllm"), default="dev",
                        help="local generation + extraction: the dev server and transformers (dev), or a real vLLM engine (vllm)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    date = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)

    print(f"demo: building/reusing the Kimi tokenizer and tiny model in {REPO / '.cache'}, starting services in {work}", flush=True)
    overrides = copy.deepcopy(DEMO_OVERRIDES)
    with ExitStack() as engines:
        server = None
        if args.engine == "vllm":
            # started first: its three processes load while the stack and Airflow's DB come up
            from eagle3_data.hidden_states.vllm_backend import vllm_python
            from eagle3_devtools.vllm_serve import start_vllm_server

            deep_merge(overrides, VLLM_OVERRIDES)
            model = tiny_model_dir(tokenizer_dir())  # the stack's model.source
            work.mkdir(parents=True)
            print(f"demo: starting vllm serve ({vllm_python()}) on {model} ...", flush=True)
            server = start_vllm_server(vllm_python(), model, work / "vllm-server.log", max_model_len=VLLM_SERVER_MAX_MODEL_LEN)
            engines.callback(server.stop)
        stack = engines.enter_context(dev_stack(work, config_overrides=overrides))
        # Airflow's per-task INFO lines would bury the report; failures still print as warnings/errors.
        os.environ.update({**stack.env, **airflow_env(work / "airflow"), "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING"})
        print(f"demo: S3 (SeaweedFS) at {stack.s3_endpoint}, dev inference server at {stack.inference_url}", flush=True)
        config = load_config(stack.config_path)
        if server is not None:
            prestart_extraction(config)
        airflow_db_migrate(os.environ.copy())
        for uri in upload_prompts(stack.client(), config, f"{date:%Y-%m-%d}"):
            print(f"demo: uploaded {uri}", flush=True)
        if server is not None:
            server.wait_healthy(600)
            os.environ["AIRFLOW_CONN_SGLANG_DEFAULT"] = server.connection()  # the local engine's connection
            print(f"demo: vLLM OpenAI server at {server.url} (log {server.log_path}); extraction: vllm backend", flush=True)
        print(f"demo: running {DAG_ID} for {date:%Y-%m-%d} with dag.test() ...", flush=True)
        dag_run = run_dag(date, json.loads(args.conf))
        print("\n" + report(stack, config, f"date={date:%Y-%m-%d}", dag_run) + "\n")
    print(f"demo: services stopped. Artifacts stay in {work / 's3'}; browse them with\n"
          f"  .venv/bin/eagle3-data dev s3 start --dir {work / 's3'}   (then any S3 client), or run `make airflow`.")
    return 0 if str(dag_run.state) in ("success", "DagRunState.SUCCESS") else 1


if __name__ == "__main__":
    sys.exit(main())
