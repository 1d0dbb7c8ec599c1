"""eagle3_datagen: prompt datasets -> EAGLE-3 drafter training data (see docs/dag.md).

Wiring only: every task calls one function of `eagle3_data.pipeline` and passes S3 URIs and
counts, never data. Nothing heavy is imported at module level (the dag-processor re-parses this
file constantly): the library is imported inside the tasks. The trigger form's params are
generated from the config's pydantic fields (`plugins/eagle3_airflow.py`: `run_param_schemas`), so their
types, enums, bounds and descriptions are the config's own.

Per dataset, local and overflow generation run side by side (both read only the routed prompts);
reconstruct waits for both.

Failure policy: a failed validation gate fails that dataset's `validate` instance (message: the
report URI); the other datasets continue, `merge` runs on the datasets whose gate passed, and
`publish` (trigger rule all_done) writes the run report and then fails, so the run ends failed
and no Asset event tells a training DAG to consume it. Fix the dataset, clear its mapped instance + downstream
(or trigger
with `datasets=[it]` and the same run key), and `publish` emits the Asset once every selected
dataset passed. A rerun that changes nothing skips `publish`: the same result is announced once.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypedDict

from airflow.sdk import Asset, Param, TriggerRule, dag, get_current_context, task, task_group
from eagle3_airflow import AWS_CONN_ID, DAG_ID, GPU_QUEUE, OPENROUTER_POOL, run_param_schemas

from eagle3_data.config import load_config

CONFIG = load_config()
TRAINING_DATA = Asset(
    name="eagle3_training_data",
    uri=f"s3://{CONFIG.storage.bucket}/{CONFIG.storage.prefix}/runs/",
    group="eagle3",
)
ASSET_EXTRA = ("run_key", "report_uri", "merged_uri", "hidden_states_uri", "datasets", "stand_ins")


class _Retries(TypedDict):
    """A task's retry arguments (typed, so that `@task(**...)` checks them against its keywords)."""

    retries: int
    retry_delay: timedelta
    retry_exponential_backoff: float
    max_retry_delay: timedelta


class _Timeout(TypedDict, total=False):
    """A task's `execution_timeout`, and the hook that sizes it when it depends on the data."""

    execution_timeout: timedelta
    pre_execute: Callable[[Any], None]


NETWORK_RETRIES: _Retries = {
    "retries": 4,
    "retry_delay": timedelta(seconds=10),
    "retry_exponential_backoff": 2.0,
    "max_retry_delay": timedelta(minutes=10),
}

PARAMS = {name: Param(**spec) for name, spec in run_param_schemas(CONFIG).items()}


def _timeout(name: str) -> _Timeout:
    """The task's `execution_timeout` from the config (`timeouts.{name}_s`): a hung task is
    killed, and retried where it has retries; the retry resumes from the stage's checkpoints."""
    return {"execution_timeout": timedelta(seconds=getattr(CONFIG.timeouts, f"{name}_s"))}


def _size_generation_timeout(context) -> None:
    """`pre_execute` of a generation task: its execution_timeout from its samples and the measured
    rates (`pipeline.generation_timeout`, floor and cap from the config). The static value the task
    is declared with is the cap, so a failure here still leaves it bounded. Its dataset and routed
    counts are the upstream XComs of its map index (arguments are resolved only after this hook)."""
    from eagle3_data.stages import LOCAL, OVERFLOW

    pipeline, run, store = _run()
    task, ti = context["task"], context["ti"]
    dataset = ti.xcom_pull(task_ids="audit_tokenizer")[ti.map_index]
    routed = ti.xcom_pull(task_ids="dataset.load_route", map_indexes=ti.map_index) or {}
    stage = LOCAL if task.task_id.endswith(LOCAL) else OVERFLOW
    seconds, how = pipeline.generation_timeout(run, store, dataset, stage, routed.get("counts") or {})
    task.execution_timeout = timedelta(seconds=seconds)
    task.log.info("execution_timeout %.0f s: %s", seconds, how)


GENERATION_TIMEOUT: _Timeout = {
    "execution_timeout": timedelta(seconds=CONFIG.timeouts.generation_cap_s),
    "pre_execute": _size_generation_timeout,
}


def _run():
    """This task's resolved run (config + params + run key) and an ArtifactStore on aws_default.
    Every task resolves it, so an unknown or invalid param fails the first task, naming it."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    from eagle3_data import pipeline

    ctx = get_current_context()
    run = _gate(lambda: pipeline.resolve_run(dict(ctx["params"]), ctx.get("logical_date"), run_id=ctx["run_id"]))
    store = pipeline.open_store(run.config, S3Hook(aws_conn_id=AWS_CONN_ID).get_conn())
    return pipeline, run, store


def _gate(fn, *args):
    """Call a stage; a failed gate or bad input/config (UserError) becomes AirflowFailException:
    no retries, since retrying cannot fix data. An unreachable S3 or endpoint, or a stage still
    leased by another attempt, stays retryable. The task process dies with its supervisor
    (plugins/supervisor_guard.py says why)."""
    from airflow.sdk.exceptions import AirflowFailException
    from supervisor_guard import stop_with_supervisor

    from eagle3_data.errors import Retryable, UserError
    from eagle3_data.storage import StageBusy

    try:
        with stop_with_supervisor():
            return fn(*args)
    except (Retryable, StageBusy):  # weather: S3 or an endpoint down, a stage stopped early, a zombie's lease
        raise
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None


def _connection(read, conn_id: str):
    """A hook's reading of its connection; a missing or malformed one fails without retries."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return read()
    except Exception as exc:  # the SDK raises its own not-found type; the message is what matters
        raise AirflowFailException(f"Airflow connection {conn_id!r} is not usable: {exc}") from None


def _local_engine() -> tuple[list[str], str | None]:
    """The local engine's endpoints and API key (None: none), from its connection (generation and
    the policy check's scoring). The key stays inside the task: passed to the library, never returned."""
    from hooks.local_engine import LocalEngineHook

    hook = LocalEngineHook()
    return _connection(lambda: (hook.get_endpoints(), hook.get_api_key()), hook.local_engine_conn_id)


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
    @task(**NETWORK_RETRIES, **_timeout("audit_tokenizer"))
    def audit_tokenizer() -> list[str]:
        """Fails before any spend when a param, the bucket, a prompt source or a special id is wrong;
        returns the datasets to map over."""
        pipeline, run, store = _run()
        _gate(pipeline.preflight, run, store)
        _gate(pipeline.audit_tokenizer, run, store)
        return run.datasets

    @task_group(group_id="dataset")
    def per_dataset(dataset: str):
        @task(map_index_template="{{ dataset }}", **NETWORK_RETRIES, **_timeout("load_route"))
        def load_route(dataset: str) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            return _gate(pipeline.load_route, run, store, dataset).as_dict()

        @task(map_index_template="{{ dataset }}", queue=GPU_QUEUE, **NETWORK_RETRIES, **GENERATION_TIMEOUT)
        def generate_local(dataset: str, routed: dict) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.generate_local, run, store, dataset, *_local_engine()).as_dict()

        @task(map_index_template="{{ dataset }}", pool=OPENROUTER_POOL, **NETWORK_RETRIES, **GENERATION_TIMEOUT)
        def generate_overflow(dataset: str, routed: dict) -> dict:
            from hooks.openrouter import OpenRouterHook

            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            hook = OpenRouterHook()
            base_url, api_key = _connection(hook.get_base_url_and_key, hook.openrouter_conn_id)
            return _gate(pipeline.generate_overflow, run, store, dataset, base_url, api_key).as_dict()

        @task(map_index_template="{{ dataset }}", **NETWORK_RETRIES, **_timeout("reconstruct"))
        def reconstruct(dataset: str, local: dict, overflow: dict) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.reconstruct, run, store, dataset).as_dict()

        @task(map_index_template="{{ dataset }}", queue=GPU_QUEUE, **NETWORK_RETRIES, **_timeout("score_policy"))
        def score_policy(dataset: str, reconstructed: dict) -> dict:
            """The policy check's scoring: a sample of overflow and local answers on the local engine."""
            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.score_policy, run, store, dataset, *_local_engine()).as_dict()

        # retried only when it did not decide: a failed gate is AirflowFailException (no retries)
        @task(map_index_template="{{ dataset }}", **NETWORK_RETRIES, **_timeout("validate"))
        def validate(dataset: str, scored: dict) -> dict:
            _set_map_name(dataset)
            pipeline, run, store = _run()
            if run.dry_run:
                return {"dry_run": True}
            return _gate(pipeline.validate, run, store, dataset).as_dict()

        # Airflow's Task types a call with the function's own parameters; at DAG definition each
        # argument is the upstream task's XComArg (resolved to the dict when the task runs)
        routed = load_route(dataset)
        generated = (
            generate_local(dataset, routed),  # type: ignore[arg-type]
            generate_overflow(dataset, routed),  # type: ignore[arg-type]
        )
        return validate(dataset, score_policy(dataset, reconstruct(dataset, *generated)))  # type: ignore[arg-type]

    @task(trigger_rule=TriggerRule.ALL_DONE, **NETWORK_RETRIES, **_timeout("merge"))
    def merge() -> dict:
        pipeline, run, store = _run()
        if run.dry_run:
            return {"dry_run": True}
        return _gate(pipeline.merge, run, store, _failed_datasets()).as_dict()

    @task(**NETWORK_RETRIES, **_timeout("plan_hidden_states"))
    def plan_hidden_states(merged: dict) -> list[dict]:
        """Which shards each GPU worker extracts (one entry per worker, balanced by tokens); the
        run's stale states (other params, an earlier merge) are discarded here, before any worker."""
        pipeline, run, store = _run()
        return _gate(pipeline.plan_hidden_states, run, store)

    @task(
        map_index_template="{{ extract_worker }}",
        queue=GPU_QUEUE,
        **NETWORK_RETRIES,
        **_timeout("extract_hidden_states"),
    )
    def extract_hidden_states(work: dict) -> dict:
        """One GPU worker: loads the model once and extracts its shards in turn; a retry skips
        the shards an earlier attempt committed."""
        _set_map_name(f"worker {work['worker']}: {len(work['shards'])} shards", key="extract_worker")
        pipeline, run, store = _run()
        return _gate(pipeline.extract_hidden_states, run, store, work).as_dict()

    @task(**NETWORK_RETRIES, **_timeout("commit_hidden_states"))
    def commit_hidden_states() -> dict | None:
        """The hidden-states stage's manifest, once every worker's shards are in (skipped with the
        workers when there are none: no merge, or hidden states skipped)."""
        pipeline, run, store = _run()
        return _gate(pipeline.commit_hidden_states, run, store)

    @task(queue=GPU_QUEUE, execution_timeout=timedelta(seconds=CONFIG.probe.budget_s))
    def probe() -> dict:
        """The drafter's verdict (config `probe`, param `probe`): a small EAGLE-3 head trained with
        speculators on the extraction, its held-out acceptance written for the report. Skipped,
        saying why, when off, when nothing was extracted, or under `auto` on a worker without a
        GPU; a failure here fails the run's probe, not its data (publish runs all_done)."""
        from airflow.sdk.exceptions import AirflowSkipException

        pipeline, run, store = _run()
        result = _gate(pipeline.probe, run, store)
        if isinstance(result, pipeline.ProbeSkipped):
            raise AirflowSkipException(result.reason)
        return result.as_dict()

    @task(trigger_rule=TriggerRule.ALL_DONE, outlets=[TRAINING_DATA], **_timeout("publish"))
    def publish() -> dict:
        """Runs whatever failed upstream: the run report is written for a failed run too (the one
        a person most wants to read), then the task fails unless everything needed for training
        is there. Emits the Asset event when the published result is new; a skipped task emits no
        outlet event (Airflow 3.3), so a dry run and a rerun that changes nothing end skipped."""
        from airflow.sdk.exceptions import AirflowSkipException

        pipeline, run, store = _run()
        result = _gate(pipeline.publish, run, store, _failed_datasets())
        if run.dry_run:
            raise AirflowSkipException(f"dry run: plan written to {result.report_uri}; nothing published")
        if not result.changed:
            raise AirflowSkipException(f"already published: {result.summary_uri} is unchanged; no new Asset event")
        report = result.as_dict()
        get_current_context()["outlet_events"][TRAINING_DATA].extra = {k: report[k] for k in ASSET_EXTRA}
        return {k: v for k, v in report.items() if k != "summary"}

    audit = audit_tokenizer()
    validated = per_dataset.expand(dataset=audit)
    merged = merge()
    validated >> merged
    # merge's XComArg, resolved when the task runs (as per_dataset's arguments above)
    plan = plan_hidden_states(merged)  # type: ignore[arg-type]
    extract_hidden_states.expand(work=plan) >> commit_hidden_states() >> probe() >> publish()


def _failed_datasets() -> dict[str, str]:
    """This run's datasets whose own tasks failed (a refusal, a stage stopped past its retries),
    each by its failed task: merge and publish (all_done) must not take the stages an earlier run
    committed for them as this run's."""
    ctx = get_current_context()
    ti, run_id = ctx["ti"], ctx["run_id"]
    names = ti.xcom_pull(task_ids="audit_tokenizer") or []
    states = ti.get_task_states(dag_id=DAG_ID, task_group_id="dataset", run_ids=[run_id]).get(run_id, {})
    failed: dict[str, str] = {}
    for key, state in sorted(states.items()):
        task, _, index = key.rpartition("_")
        if state == "failed" and index.isdigit() and int(index) < len(names):
            failed.setdefault(names[int(index)], task)
    return failed


def _set_map_name(value: str, key: str = "dataset") -> None:
    """Expose the mapped value to `map_index_template` (rendered from the task's context)."""
    get_current_context()[key] = value  # type: ignore[literal-required]


eagle3_datagen()
