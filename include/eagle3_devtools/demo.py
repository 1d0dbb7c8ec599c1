"""`make demo`: the whole DAG on a laptop, from a fresh clone, then a run report.

Builds (or reuses from $EAGLE3_DATA_CACHE/dev, where the CLI's dev: sources live too) the Kimi
tokenizer and the tiny target model, starts SeaweedFS and the dev inference server on free 127.0.0.1
ports, uploads the sample datasets as today's prompt partition, runs `eagle3_datagen` with
`dag.test()` on SQLite in demo-output/airflow, prints what happened, what was a stand-in and where
the artifacts are, and stops everything it started.

Two runs, each under its own run key (`demo-{engine}`, `demo-{engine}-gate`): the sample datasets,
which pass their gates and are published; then `broken`, the chat prompts answered by an engine
that splits 90% of its BPE tokens the non-canonical way, which fails its gate, so the report shows
what a failure looks like and that nothing is published (Airflow's log of that run, its
tracebacks, goes to demo-output/airflow/<run key>.log; the demo says in one paragraph why it
failed). Piped, a line names the phase under way every 8 s. The S3 data of earlier demos stays: a
second `make demo` reuses every stage, `make demo ENGINE=vllm` writes beside the first.

`--engine vllm` (`make demo ENGINE=vllm`) puts the real engine in the loop: a `vllm serve` of the
tiny model (from .venv-vllm, fp32 on CPU) is the local generation endpoint
(`generation.local.engine: vllm`) and the overflow provider (its OpenAI chat route in OpenRouter's
place, so the policy check compares two paths of one model), and hidden states are extracted by
the `vllm` backend (its engine runs in .venv-vllm too). `tool_calls` is left out there
(VLLM_LEFT_OUT says why).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import sys
import warnings
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from eagle3_airflow import DAG_ID

from eagle3_data.builds.sources import dev_cache_root
from eagle3_data.config import deep_merge, load_config
from eagle3_devtools.demo_output import Heartbeat, captured_output, expected_failure
from eagle3_devtools.stack import (
    REPO,
    SAMPLE_DATA,
    airflow_db_migrate,
    airflow_env,
    dev_stack,
    target_model_dir,
    upload_prompts,
)
from eagle3_devtools.vllm_serve import SERVED_MODEL_NAME

DEFAULT_WORKDIR = REPO / "demo-output"
SAMPLE_DATASETS = ("tool_calls", "code", "chat", "images")  # images: image prompts in every layout (sample_images.py)
BROKEN = "broken"  # the chat prompts through an engine that splits BPE tokens: fails its gate on purpose
BROKEN_PROMPTS = 6
# Small enough for two CPU cores in a few minutes; the shape of a real run.
DEMO_MAX_IMAGES = 2  # the most images one sample prompt has (images.jsonl)
DEMO_OVERRIDES = {
    # image prompts on both paths (the dev server takes `image_data` as SGLang does; `--engine vllm`
    # starts `vllm serve` for images), scored with their images and extracted with their pixels
    "generation": {"sampling": {"max_new_tokens": 512}, "local": {"images": True}},
    "hidden_states": {"max_images": DEMO_MAX_IMAGES},
    "merge": {"max_length": 1024, "shard_tokens": 8192},
    "datasets": [
        *({"name": n} for n in SAMPLE_DATASETS),
        {"name": BROKEN, "dev": {"bpe_split_rate": 0.9}, "validation": {"max_bpe_mismatch_rate": 0.10}},
    ],
}
# What each role is in the demo, for the lines that say so.
STAND_IN_NAMES = {
    "tokenizer": "the Kimi-K2.5 tokenizer rebuilt offline (byte-identical vocabulary)",
    "model": "a tiny random Kimi-K2.5 (its own class, KimiK25ForConditionalGeneration) with Kimi's vocabulary "
    "(hidden states)",
    "local_engine": "the dev inference server as SGLang (generated text, not Kimi-K2.5's)",
    "overflow_provider": "the dev inference server as OpenRouter (its costs are a price list, nothing is paid)",
}
# The real engine for local generation and extraction (`--engine vllm`). The tiny target is a
# random model: greedy (its sampled ids wander across the whole vocabulary, into split UTF-8
# bytes), shorter outputs, and the BPE-split gate opened (its ids are rarely the tokenizer's
# canonical split of their own text; a real model's almost always are: bpe_only is still counted).
# The overflow provider is the same `vllm serve` behind its OpenAI chat route (OpenRouter's shape,
# as in the policy trial): the policy check compares each path's answers under the target, and the
# dev server's text is not the target's (it rightly failed every dataset's gate here). vLLM reports
# no usage.cost and names no provider: priced from the config, any provider; its billed counts move
# with the random model's re-splits (measured elsewhere), so the billing gate is opened like the BPE one.
VLLM_OVERRIDES = {
    "generation": {
        "local": {"engine": "vllm"},
        "sampling": {"temperature": 0.0, "max_new_tokens": 128},
        "overflow": {"model": SERVED_MODEL_NAME, "provider": {"allow_fallbacks": True}},
    },
    "validation": {"max_bpe_mismatch_rate": 1.0, "max_billing_deviation": 1.0},
    "hidden_states": {"backend": "vllm"},
    "stand_ins": ["tokenizer", "model", "overflow_provider"],  # the local engine is real here
}
# The random tiny target never ends an answer (every one is cut at max_new_tokens), and an answer
# cut with tools offered cannot be reconstructed from a provider's text (its tool parser drops a cut
# tool-call section: reconstruct rejects it), so with the tiny target as the provider too the tool
# dataset would have no overflow rows at all. A trained target ends its answers.
VLLM_LEFT_OUT = {
    "tool_calls": "the random tiny target's answers are all cut, and a cut answer with tools offered "
    "is not reconstructable from the provider's text"
}
VLLM_STAND_IN_NAMES = {
    **STAND_IN_NAMES,
    "overflow_provider": "the same vllm serve behind its OpenAI chat route, as OpenRouter (its costs are the "
    "config's price list, nothing is paid)",
}
VLLM_SERVER_MAX_MODEL_LEN = 4096  # the longest sample prompt + max_new_tokens
# `--model qwen3` (`make demo MODEL=qwen3`): the Qwen3 family's packaged config (model.family qwen3,
# dev:qwen3-tokenizer, dev:tiny-qwen3-moe), the same datasets. The dev server's stand-in writes Qwen3
# generations from its tokenizer; as OpenRouter it is told to serve the config's Qwen3 slug (its
# default is Kimi's) and keeps the broken dataset's split rate. Qwen3 is a text model: the image
# prompts are refused by its format, so `images` is left out.
QWEN3_CONFIG = Path(__file__).resolve().parents[1] / "eagle3_data" / "defaults" / "qwen3.yaml"
QWEN3_LEFT_OUT = {"images": "Qwen3 is a text model: its chat template has no image placeholder"}
QWEN3_STAND_IN_NAMES = {
    "tokenizer": "the Qwen3 tokenizer rebuilt offline (dev:qwen3-tokenizer)",
    "model": "a tiny random Qwen3-MoE (Qwen3MoeForCausalLM) with Qwen3's vocabulary (hidden states)",
    "local_engine": "the dev inference server as SGLang (generated text in Qwen3's format, not Qwen3's)",
    "overflow_provider": "the dev inference server as OpenRouter (its costs are a price list, nothing is paid)",
}


def run_dag(logical_date: datetime, conf: dict | None = None):
    """One DAG run through `dag.test()` in this process (env must already point at the stack)."""
    from airflow.dag_processing.dagbag import DagBag

    # Airflow's own deprecation (its DAG-file discovery on pathspec), printed once per parse: no
    # user of the demo can act on it. Set after Airflow's import, which sets its warning filters.
    warnings.filterwarnings("ignore", message=r"GitWildMatchPattern .* is deprecated", category=DeprecationWarning)
    bag = DagBag(dag_folder=str(REPO / "dags"))
    if bag.import_errors:
        raise RuntimeError(f"DAG import errors: {bag.import_errors}")
    return bag.dags[DAG_ID].test(logical_date=logical_date, run_conf=conf or {})


def task_states(dag_run) -> list[tuple[str, str, str, float]]:
    from airflow.utils.session import create_session

    with create_session() as session:
        tis = dag_run.get_task_instances(session=session)
        return sorted(
            (
                ti.task_id,
                ti.rendered_map_index or ("" if ti.map_index < 0 else str(ti.map_index)),
                str(ti.state),
                float(ti.duration or 0.0),
            )
            for ti in tis
        )


def report(stack, config, run_key: str, dag_run, names: dict[str, str] = STAND_IN_NAMES) -> str:
    """The run report a person reads: task states, per-dataset gates, tokens, cost, bytes, URIs."""
    from eagle3_data.pipeline import RUN_DATASET, open_store
    from eagle3_data.storage import StageRef

    lines = [f"DAG run {dag_run.run_id}: {dag_run.state}", "", "Tasks:"]
    lines += [f"  {tid:32s} {name:12s} {state:8s} {secs:7.1f} s" for tid, name, state, secs in task_states(dag_run)]
    store = open_store(config, stack.client())
    plan = StageRef(run_key, "plan", RUN_DATASET)
    if store.read_object(plan, "plan.json") is not None:  # a dry run: the plan, not a summary
        return "\n".join(lines + [""] + plan_lines(store.get_json(plan, "plan.json"), store.uri(plan, "plan.json")))
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
            f"({d['local']['completion_tokens']} output tokens), overflow {d['overflow']['ok']} "
            f"ok/{d['overflow']['failed']} failed "
            f"({d['overflow']['completion_tokens']} output tokens, ${d['overflow']['cost_usd']:.4f}); gate {gate}"
        )
        if im := d.get("images"):
            lines.append(
                f"  {'':12s} images: {im.get('image_rows', 0)} prompts with {im.get('images', 0)} images, "
                f"{im.get('media_tokens', 0)} media tokens (mask 0), {im.get('image_rejects', 0)} rows refused for "
                "an image"
            )
        lines.append(f"  {'':12s} report {d['gate']['report_uri']}")
    if s.get("merged"):
        t = s["merged"]["totals"]
        lines += [
            "",
            f"Merged: {t.get('samples', 0)} samples, {t.get('tokens', 0)} tokens ({t.get('loss_tokens', 0)} trained), "
            f"{s['merged']['shards']} shard(s) at {s['merged_uri']}",
        ]
    if s.get("hidden_states"):
        h = s["hidden_states"]
        lines.append(
            f"Hidden states: {h['totals']['samples']} samples, {h['totals']['tokens']} tokens, "
            f"{h['totals']['bytes']:,} bytes, "
            f"layers {h['layer_ids']} ({h['convention']} convention, {h['dtype']}) at {s['hidden_states_uri']}"
        )
        if left := h["totals"].get("left_out_image_samples"):
            lines.append(f"  {left} image samples left out (hidden_states.max_images: 0, or a text-only target)")
    lines += probe_lines(s)
    lines += engine_lines(store, run_key, list(s["datasets"]), s.get("stand_ins") or [])
    priced = " (a stand-in's price list: nothing was paid)" if "overflow_provider" in (s.get("stand_ins") or []) else ""
    lines += [
        f"Overflow cost: ${s['cost_usd']:.4f}{priced}",
        f"Run report (UI page index): {s['report_uri']}",
        f"Summary: {s['summary_uri']}",
    ]
    if s.get("stand_ins"):
        lines += ["", "Simulated in this run (every manifest and the report say so):"]
        lines += [f"  {role}: {names.get(role, role)}" for role in s["stand_ins"]]
    return "\n".join(lines)


def probe_lines(summary: dict) -> list[str]:
    """The drafter's verdict when the probe ran; why not when it did not (publish's
    `training.probe_not_run`: under the default `auto`, a machine without a GPU, the demo's)."""
    training = summary.get("training") or {}
    if probe := training.get("probe"):
        acc = ", ".join(f"{a:.2f}" for a in probe["acc"])
        return [
            f"Probe: simulated acceptance {probe['simulated_acceptance']:.2f} tokens per step (acc {acc}) "
            f"after {probe['steps']} steps, at {probe['uri']}"
        ]
    if not_run := training.get("probe_not_run"):
        return [f"Probe: {not_run}"]
    return []


def plan_lines(plan: dict, uri: str) -> list[str]:
    """A dry run's plan as a person reads it: per dataset and strategy, samples per side, times, cost."""
    from eagle3_data.stages.prompts.stage import seconds_text

    t = plan["totals"]
    lines = [
        f"Dry run plan ({uri}): nothing generated, nothing spent.",
        f"  {t['prompt_tokens']:,} prompt tokens, at most {t['max_output_tokens']:,} output tokens, "
        f"overflow at most ${t['max_overflow_usd']:.4f}",
    ]
    for name, p in plan["strategies"].items():
        lines.append(
            f"  routing {name:9s}: local {p['local']} samples ({seconds_text(p['local_s'])} s), overflow "
            f"{p['overflow']} ({seconds_text(p['overflow_s'])} s), wall {seconds_text(p['wall_s'])} s, "
            f"overflow <= ${p['overflow_usd']:.4f}"
        )
    for name, d in plan["datasets"].items():
        lines.append(f"  {name:12s} {', '.join(f'{k} {v}' for k, v in d['counts'].items())}")
    return lines


def engine_lines(store, run_key: str, datasets: list[str], stand_ins: list[str]) -> list[str]:
    """Which engine produced the local ids and the hidden states, from the stages' manifests."""
    from eagle3_data.pipeline import RUN_DATASET
    from eagle3_data.storage import StageRef

    lines = []
    for ds in datasets:
        ref = StageRef(run_key, "generate_local", ds)
        if store.is_complete(ref):
            m = store.read_manifest(ref)
            served = ", ".join(f"{url} ({name})" for url, name in (m["extra"].get("served_models") or {}).items())
            simulated = (
                " (the dev inference server speaking its protocol: a stand-in)" if "local_engine" in stand_ins else ""
            )
            lines.append(
                f"Local generation {ds}: engine {m['params'].get('source')}{simulated}"
                + (f" at {served}" if served else "")
            )
    ref = StageRef(run_key, "hidden_states", RUN_DATASET)
    if store.is_complete(ref):
        extra = store.read_manifest(ref)["extra"]
        lines.append(f"Hidden-state backend {extra.get('backend')}: {', '.join(extra.get('engines') or [])}")
    return lines


def model_line(model_dir: str) -> str:
    """The target as the demo names it: its folder and the class its config.json declares (the
    packaged default is `dev:tiny-kimi-k25`, Kimi-K2.5's own `KimiK25ForConditionalGeneration`)."""
    architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or ["?"]
    return f"{model_dir} ({', '.join(architectures)})"


def prestart_extraction(config) -> None:
    """Start the DAG's extraction engine now: `dag.test()` runs the extract task in this process,
    where `shared_backend` hands it this very engine (same model, TP and max_model_len), by then
    loaded while generation ran."""
    from eagle3_data.config import resolve_source
    from eagle3_data.stages.hidden_states.engines import shared_backend
    from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices
    from eagle3_data.stages.hidden_states.vllm_backend import text_config

    h, model = config.hidden_states, resolve_source(config.model.source)
    layers = text_config(model)["num_hidden_layers"]
    backend = shared_backend(
        "vllm",
        model,
        tensor_parallel_size=h.tensor_parallel_size,
        max_model_len=config.merge.max_length + 1,
        max_images=h.max_images,  # the DAG's extract asks for the same key (engines.shared_backend)
    )
    backend.prestart(hidden_state_indices(default_layer_ids(layers, h.convention), h.convention, layers), h.last_hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help="services' data and the Airflow home (recreated)"
    )
    parser.add_argument("--conf", default="{}", help="DAG run conf as JSON, e.g. '{\"dry_run\": true}'")
    parser.add_argument(
        "--engine",
        choices=("dev", "vllm"),
        default="dev",
        help="local generation + extraction: the dev server and transformers (dev), or a real vLLM engine (vllm)",
    )
    parser.add_argument(
        "--model",
        choices=("kimi", "qwen3"),
        default="kimi",
        help="the target family: Kimi-K2.5 (the packaged pipeline.yaml) or Qwen3 (defaults/qwen3.yaml)",
    )
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # piped, its lines keep their order among Airflow's
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = args.workdir.resolve()
    for old in work.iterdir() if work.exists() else ():  # the S3 data of earlier demos stays
        if old.name != "s3":
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    date = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    # Dated: another day's demo reads other prompts (that day's partition), and under an undated
    # key it would find an interrupted earlier demo's parts and refuse to mix them with its own.
    family = "" if args.model == "kimi" else f"{args.model}-"
    run_key = f"demo-{family}{args.engine}-{date:%Y-%m-%d}"
    base = None
    if args.model == "qwen3":
        import yaml

        base = yaml.safe_load(QWEN3_CONFIG.read_text(encoding="utf-8"))

    print(
        f"demo: building/reusing the {args.model} tokenizer and tiny model in {dev_cache_root()}, starting services "
        f"in {work}",
        flush=True,
    )
    overrides = copy.deepcopy(DEMO_OVERRIDES)
    left_out = dict(QWEN3_LEFT_OUT) if base else {}
    if base:
        overrides["datasets"] = [d for d in overrides["datasets"] if d["name"] not in left_out]
        overrides["generation"]["local"]["images"] = False
    with ExitStack() as engines, Heartbeat.for_stdout() as beat:
        beat.enter("building/reusing the dev builds and starting S3 and the dev inference server")
        server = None
        if args.engine == "vllm":
            # started first: its three processes load while the stack and Airflow's DB come up
            from eagle3_data.stages.hidden_states.vllm_backend import vllm_python
            from eagle3_devtools.vllm_serve import start_vllm_server

            deep_merge(overrides, VLLM_OVERRIDES)
            model = target_model_dir(base=base)  # the stack's model.source
            work.mkdir(parents=True, exist_ok=True)
            print(f"demo: starting vllm serve ({vllm_python()}) on {model} ...", flush=True)
            server = start_vllm_server(
                vllm_python(),
                model,
                work / "vllm-server.log",
                max_model_len=VLLM_SERVER_MAX_MODEL_LEN,
                max_images=DEMO_MAX_IMAGES,
            )
            engines.callback(server.stop)
        stack = engines.enter_context(dev_stack(work, config_overrides=overrides, base=base))
        # Airflow's per-task INFO lines would bury the report; failures still print as warnings/errors.
        os.environ.update({**stack.env, **airflow_env(work / "airflow"), "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING"})
        print(f"demo: S3 (SeaweedFS) at {stack.s3_endpoint}, dev inference server at {stack.inference_url}", flush=True)
        config = load_config(stack.config_path)
        if base and server is None:
            serve_overflow_model(stack.inference_url, config)
        print(f"demo: target model {model_line(config.model.source)}", flush=True)
        if server is not None:
            beat.enter("starting the vLLM extraction engine")
            prestart_extraction(config)
        beat.enter("preparing Airflow's metadata database (airflow db migrate)")
        airflow_db_migrate(os.environ.copy())
        beat.enter("uploading the prompts")
        broken = work / f"{BROKEN}.jsonl"
        broken.write_text("\n".join((SAMPLE_DATA / "chat.jsonl").read_text().splitlines()[:BROKEN_PROMPTS]) + "\n")
        for uri in upload_prompts(stack.client(), config, f"{date:%Y-%m-%d}", {BROKEN: broken}):
            print(f"demo: uploaded {uri}", flush=True)
        if server is not None:
            beat.enter("waiting for vllm serve to load the model")
            server.wait_healthy(600)
            os.environ["AIRFLOW_CONN_SGLANG_DEFAULT"] = server.connection()  # the local engine's connection
            os.environ["AIRFLOW_CONN_OPENROUTER_DEFAULT"] = json.dumps(  # the provider: the same server
                {"conn_type": "http", "host": f"{server.url}/v1", "password": "key-unused-by-vllm"}
            )
            print(
                f"demo: vLLM OpenAI server at {server.url} (log {server.log_path}); extraction: vllm backend",
                flush=True,
            )
        conf = json.loads(args.conf)
        print(f"demo: running {DAG_ID} for {date:%Y-%m-%d} with dag.test(), run key {run_key} ...", flush=True)
        beat.enter(f"running {DAG_ID}, run key {run_key}")
        if server is not None:
            left_out.update(VLLM_LEFT_OUT)
        datasets = [d for d in SAMPLE_DATASETS if d not in left_out]
        for name, why in left_out.items():
            print(f"demo: dataset {name} is left out ({args.model}, --engine {args.engine}): {why}", flush=True)
        dag_run = run_dag(date, {"run_name": run_key, "datasets": datasets, **conf})
        beat.enter(None)
        names = VLLM_STAND_IN_NAMES if server is not None else STAND_IN_NAMES
        if base:
            names = {**names, **{k: v for k, v in QWEN3_STAND_IN_NAMES.items() if k != "local_engine" or not server}}
        print("\n" + report(stack, config, run_key, dag_run, names) + "\n")
        ok = str(dag_run.state).endswith("success")
        if not conf.get("dry_run"):
            gate_key = f"{run_key}-gate"
            print(
                f"demo: running {DAG_ID} again, run key {gate_key}: dataset {BROKEN!r}, whose engine splits 90% of "
                "its BPE tokens, must fail its gate ...",
                flush=True,
            )
            beat.enter(f"running {DAG_ID}, run key {gate_key}")
            with captured_output(work / "airflow" / f"{gate_key}.log") as log:  # its failure is meant: said below
                gate_run = run_dag(date, {"run_name": gate_key, "datasets": [BROKEN]})
            beat.enter(None)
            print("\n" + report(stack, config, gate_key, gate_run, names) + "\n")
            log_text = log.read_text(errors="replace")
            paragraph = expected_failure(BROKEN, task_states(gate_run), gates(stack, config, gate_key), log, log_text)
            print(
                paragraph
                or f"{log_text}\ndemo: {BROKEN} should have failed its gate, and only that, and did not: "
                f"Airflow's log of the run above ({os.path.relpath(log)})",
                flush=True,
            )
            ok = ok and paragraph is not None
    print(reading_lines(work, [run_key] + ([] if conf.get("dry_run") else [f"{run_key}-gate"])), flush=True)
    return 0 if ok else 1


def serve_overflow_model(inference_url: str, config) -> None:
    """Tell the dev server (as OpenRouter) to serve the config's overflow model (its default is
    Kimi's slug, and another is a 400 as on OpenRouter), keeping each dataset's BPE split rate."""
    import httpx

    body = {
        "model": config.generation.overflow.model,
        "canonical_slug": config.generation.overflow.model,
        "datasets": {ds.name: {"noncanonical_rate": ds.dev_bpe_split_rate} for ds in config.datasets},
    }
    httpx.post(f"{inference_url}/dev/config", json=body, timeout=30).raise_for_status()


def reading_lines(work: Path, run_keys: list[str]) -> str:
    """The demo's last lines: how to read its runs' reports once its services are stopped. Its S3
    folder is served again by the CLI's dev S3 (the data outlives the keys it was written with)
    and the report command renders each run key's Validation report tab as HTML; `make airflow`
    is another Airflow with its own S3 and runs, so it is not where the demo's runs are."""
    s3, rel = work / "s3", lambda p: os.path.relpath(p)
    lines = [
        f"demo: services stopped. Artifacts stay in {rel(s3)}. To read the runs' reports (the Airflow tab's page):",
        f'  eval "$(.venv/bin/eagle3-data dev s3 start --dir {rel(s3)})"',
    ]
    lines += [
        f"  .venv/bin/eagle3-data report --config {rel(work / 'pipeline.yaml')} --run-key {key} "
        f"--out {rel(work / f'report-{key}.html')}"
        for key in run_keys
    ]
    lines += [
        f"  .venv/bin/eagle3-data dev s3 stop --dir {rel(s3)}",
        "(`make airflow` starts an Airflow of its own, with its own S3 and runs: not the demo's.)",
    ]
    return "\n".join(lines)


def gates(stack, config, run_key: str) -> dict[str, dict]:
    """Each dataset's gate in the run, from its validate manifest, with its report's URI."""
    from eagle3_data.pipeline import open_store
    from eagle3_data.storage import StageRef

    store = open_store(config, stack.client())
    refs = {name: StageRef(run_key, "validate", name) for name in store.datasets(run_key, "validate")}
    return {
        name: {**store.read_manifest(ref)["extra"]["gate"], "report_uri": store.uri(ref, "report.json")}
        for name, ref in refs.items()
    }


if __name__ == "__main__":
    sys.exit(main())
