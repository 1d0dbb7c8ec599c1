"""`[celery] celery_config_options` of `make cluster`'s workers: Airflow's own Celery config,
imported once per worker together with what every task of the DAG needs.

Why: an Airflow 3 task runs in a process forked from its Celery worker (pool child, then the
task supervisor), so whatever the worker process has imported or loaded, each task starts
with, copy-on-write. Without this each task imports the pipeline, transformers and boto3 and
loads the configured tokenizer again: the Kimi tokenizer's HF load alone costs about 7 s of CPU,
paid by audit, load_route and both generation stages of every dataset of every run, which on a
two-core machine is most of a run's wall time. The tokenizers are loaded through the pipeline's
own per-source caches (`runs.run`), so a task gets the very object it would have built,
from the same files; a worker started after the config changed loads the new source.

Importing Airflow's `DEFAULT_CELERY_CONFIG` unchanged keeps broker, result backend and every
other Celery setting as Airflow derives them from the environment. A warm-up that fails (no
config, a tokenizer not built yet) is logged and skipped: the tasks then load what they need
themselves and fail with their own messages if it is missing.
"""

from __future__ import annotations

import logging
import time

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

log = logging.getLogger(__name__)

CELERY_CONFIG = DEFAULT_CELERY_CONFIG


# What the tasks import inside their functions (the DAG file keeps its module level light for
# the dag-processor). Not torch: only extract_hidden_states needs it, once per run, and a worker
# restarted after a crash should be back quickly.
TASK_MODULES = (
    "airflow.sdk",
    "airflow.providers.amazon.aws.hooks.s3",
    "eagle3_data.pipeline",
    "eagle3_data.storage",
    "eagle3_data.stages.prompts.load",
    "eagle3_data.stages.prompts.routing",
    "eagle3_data.engines.sglang",
    "eagle3_data.stages.generate.openrouter",
    "eagle3_data.reconstruction",
    "eagle3_data.stages.validate",
    "eagle3_data.stages.merge.datasets",
    "eagle3_data.report",
    "pyarrow.compute",
    "transformers",
)


def warm() -> float:
    """Import the task-side modules and load the config's tokenizers; returns the seconds spent."""
    import importlib

    from eagle3_data.config import load_config

    start = time.monotonic()
    for name in TASK_MODULES:
        importlib.import_module(name)
    from eagle3_data.runs import run as run_module

    source = load_config().tokenizer.source
    if not source.startswith("s3://"):  # an s3:// source is cached per client: one per task
        run_module._load_tokenizer(source, None)  # audit, load_route, generation (chat template)
        run_module._load_bulk_tokenizer(source, None)  # reconstruct, validate, merge
    return time.monotonic() - start


try:
    log.warning("eagle3 worker warm-up: %.1f s", warm())
except Exception as exc:
    log.warning("eagle3 worker warm-up skipped: %s: %s", type(exc).__name__, exc)
