"""eagle3_datagen: prompt datasets -> EAGLE-3 drafter training data (see docs/dag.md).

Wiring only: every task calls one function of `eagle3_data.pipeline` and passes S3 URIs and
counts, never data. Nothing heavy is imported at module level (the dag-processor re-parses this
file constantly): the library is imported inside the tasks.

Failure policy: a failed validation gate fails that dataset's `validate` instance (message: the
report URI); the other datasets continue, `merge` runs on the datasets whose gate passed, and
`publish` writes the run report and then fails, so the run ends failed and no Asset event tells a
training DAG to consume it. Fix the dataset, clear its mapped instance + downstream (or trigger
with `datasets=[it]` and the same run key), and `publish` emits the Asset once every selected
dataset passed.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Asset, Param, TriggerRule, dag, get_current_context, task, task_group

from eagle3_data.config import (
    AWS_CONN_ID,
    DAG_ID,
    GPU_QUEUE,
    LAYER_CONVENTIONS,
    OPENROUTER_CONN_ID,
    OPENROUTER_POOL,
    ROUTING_STRATEGIES,
    SGLANG_CONN_ID,
    load_config,
)

CONFIG = load_config()
TRAINING_DATA = Asset(
    name="eagle3_training_data",
    uri=f"s3://{CONFIG.storage.bucket}/{CONFIG.storage.prefix}/runs/",
    group="eagle3",
)

NETWORK_RETRIES = {
    "retries": 4,
    "retry_delay": timedelta(seconds=10),
    "retry_exponential_backoff": 2.0,
    "max_retry_delay": timedelta(minutes=10),
}


def _rate(description: str) -> Param:
    return Param(None, type=["null", "number"], minimum=0, maximum=1, description=description)


PARAMS = {
    "datasets": Param(
        CONFIG.dataset_names,
        type="array",
        items={"type": "string", "enum": CONFIG.dataset_names},
        minItems=1,
        uniqueItems=True,
        description="Datasets to process. Others keep their committed artifacts of this run key.",
    ),
    "run_name": Param(
        None,
        type=["null", "string"],
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}$",
        description="Run key for a manual run (artifacts under runs/{run_name}/). Empty: "
        "date=YYYY-MM-DD of the logical date. Reuse a name to resume or rerun datasets.",
    ),
    "overflow_strategy": Param(
        CONFIG.routing.strategy,
        type="string",
        enum=list(ROUTING_STRATEGIES),
        description="fraction: overflow_fraction of samples go to OpenRouter; capacity: the local "
        "endpoints take routing.local_capacity samples and the rest overflows.",
    ),
    "overflow_fraction": Param(
        CONFIG.routing.overflow_fraction,
        type="number",
        minimum=0,
        maximum=1,
        description="Share of samples generated on OpenRouter (strategy=fraction).",
    ),
    "max_usd": Param(
        CONFIG.generation.overflow.max_usd,
        type="number",
        minimum=0,
        description="Hard OpenRouter spend cap per dataset in this run (USD).",
    ),
    "max_bpe_mismatch_rate": _rate(
        "Gate: max share of local samples whose ids differ from re-encoding only by BPE merges. "
        "Empty: the config's value, per-dataset overrides included."
    ),
    "max_billing_deviation": _rate(
        "Gate: max |billed - reconstructed| / billed completion tokens on overflow rows. "
        "Empty: the config's value, per-dataset overrides included."
    ),
    "max_length": Param(
        CONFIG.merge.max_length,
        type="integer",
        minimum=16,
        description="Max tokens per training sample (prompt + output); longer ones follow merge.length_policy.",
    ),
    "layer_convention": Param(
        CONFIG.hidden_states.convention,
        type="string",
        enum=list(LAYER_CONVENTIONS),
        description="Aux hidden-state layers: output (output of layers 1, L/2-1, L-4: SpecForge) or "
        "input (input to layers 2, L/2, L-3 + last: vLLM/speculators).",
    ),
    "skip_hidden_states": Param(False, type="boolean", description="Stop after merge (no GPU stage)."),
    "dry_run": Param(
        False,
        type="boolean",
        description="Plan only: prompt counts, routing, token and cost estimates. No generation, no spend.",
    ),
}


def _run():
    """This task's resolved run (config + params + run key) and an ArtifactStore on aws_default."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from eagle3_data import pipeline

    ctx = get_current_context()
    run = _gate(pipeline.resolve_run, dict(ctx["params"]), ctx.get("logical_date"))
    store = pipeline.open_store(run.config, S3Hook(aws_conn_id=AWS_CONN_ID).get_conn())
    return pipeline, run, store


def _gate(fn, *args):
    """Call a stage; a failed gate or bad input/config (UserError) becomes AirflowFailException:
    no retries, since retrying cannot fix data. An unreachable S3 stays retryable."""
    from airflow.sdk.exceptions import AirflowFailException

    from eagle3_data.errors import UserError
    from eagle3_data.storage import StorageUnavailable

    try:
        return fn(*args)
    except StorageUnavailable:
        raise
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None


@dag(
    dag_id=DAG_ID,
    schedule=CONFIG.schedule,
    catchup=False,
    max_active_runs=1,
    params=PARAMS,
    tags=["eagle3", "training-data"],
    doc_md=__doc__,
    default_args={"retries": 0},
)
def eagle3_datagen():
    @task(**NETWORK_RETRIES)
    def audit_tokenizer() -> list[str]:
        """Fails before any spend when a special id is wrong; returns the datasets to map over."""
        pipeline, run, store = _run()
        _gate(pipeline.audit_tokenizer, run, store)
        return run.datasets

    @task_group(group_id="dataset")
    def per_dataset(dataset: str):
        @task(map_index_template="{{ dataset }}", **NETWORK_RETRIES)
        def load_route(dataset: str) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            return _gate(pipeline.load_route, run, store, dataset)

        @task(map_index_template="{{ dataset }}", queue=GPU_QUEUE, **NETWORK_RETRIES)
        def generate_local(dataset: str, routed: dict) -> dict:
            from airflow.sdk import Connection

            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            endpoints = pipeline.sglang_endpoints(_conn(Connection, SGLANG_CONN_ID))
            return _gate(pipeline.generate_local, run, store, dataset, endpoints)

        @task(map_index_template="{{ dataset }}", pool=OPENROUTER_POOL, **NETWORK_RETRIES)
        def generate_overflow(dataset: str, local: dict) -> dict:
            from airflow.sdk import Connection

            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.generate_overflow, run, store, dataset, _conn(Connection, OPENROUTER_CONN_ID))

        @task(map_index_template="{{ dataset }}", **NETWORK_RETRIES)
        def reconstruct(dataset: str, overflow: dict) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.reconstruct, run, store, dataset)

        @task(map_index_template="{{ dataset }}")
        def validate(dataset: str, reconstructed: dict) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.validate, run, store, dataset)

        routed = load_route(dataset)
        return validate(dataset, reconstruct(dataset, generate_overflow(dataset, generate_local(dataset, routed))))

    @task(trigger_rule=TriggerRule.ALL_DONE, **NETWORK_RETRIES)
    def merge() -> list[dict]:
        pipeline, run, store = _run()
        if run.dry_run:
            return []
        result = _gate(pipeline.merge, run, store)
        return [] if run.skip_hidden_states else result["shards"]

    @task(map_index_template="{{ shard_name }}", queue=GPU_QUEUE, **NETWORK_RETRIES)
    def extract_hidden_states(shard: dict) -> dict:
        _set_map_name(shard["name"], key="shard_name")
        pipeline, run, store = _run()
        return _gate(pipeline.extract_hidden_states, run, store, shard)

    @task(trigger_rule=TriggerRule.NONE_FAILED, outlets=[TRAINING_DATA])
    def publish() -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        pipeline, run, store = _run()
        report = _gate(pipeline.publish, run, store)
        if run.dry_run:
            raise AirflowSkipException(f"dry run: plan written to {report['report_uri']}; nothing published")
        get_current_context()["outlet_events"][TRAINING_DATA].extra = {
            k: report[k] for k in ("run_key", "report_uri", "merged_uri", "hidden_states_uri", "datasets")
        }
        return report

    audit = audit_tokenizer()
    validated = per_dataset.expand(dataset=audit)
    shards = merge()
    validated >> shards
    extract_hidden_states.expand(shard=shards) >> publish()


def _set_map_name(value: str, key: str = "dataset") -> None:
    """Expose the mapped value to `map_index_template` (rendered from the task's context)."""
    get_current_context()[key] = value  # type: ignore[literal-required]


def _conn(connection_cls, conn_id: str):
    try:
        return connection_cls.get(conn_id)
    except Exception as exc:  # the SDK raises its own not-found type; the message is what matters
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"Airflow connection {conn_id!r} is not usable: {exc}") from None


eagle3_datagen()
