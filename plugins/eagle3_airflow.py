"""What the pipeline is called in Airflow: the DAG's id, the GPU workers' queue, the OpenRouter
pool, the connections the hooks read, and the DAG's trigger form (`run_param_schemas`).

One place for the DAG file, the hooks and report view beside this module, the cluster setup
(docker/init.sh) and the checkout's launchers. Airflow puts this folder on `sys.path` when it is
imported (its plugins folder); the launchers add it themselves (`eagle3_devtools`). The library
(`eagle3_data`) never needs these names: it runs without Airflow and takes clients and endpoints
from its callers.
"""

from __future__ import annotations

from typing import Any

from eagle3_data.config import (
    CONFIG_PARAMS,
    PACKAGED_CONFIGS,
    THRESHOLD_PARAMS,
    PipelineConfig,
    config_field,
    config_field_schema,
    config_value,
)
from eagle3_data.stages import FRESH_STAGES

DAG_ID = "eagle3_datagen"
GPU_QUEUE = "gpu"  # the GPU workers' Celery queue: local generation, policy scoring, extraction, probe
OPENROUTER_POOL = "openrouter"  # bounds the overflow generation tasks calling OpenRouter at once
AWS_CONN_ID = "aws_default"
OPENROUTER_CONN_ID = "openrouter_default"
SGLANG_CONN_ID = "sglang_default"  # the local engine's endpoints, SGLang or vLLM (the id kept from SGLang-only days)

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._=+-]{0,127}$"


def run_param_schemas(config: PipelineConfig) -> dict[str, dict[str, Any]]:
    """Every trigger param (`eagle3_data.config.TRIGGER_PARAMS`, in that order) as
    `{name: {"default": ..., "description": ..., **json_schema}}`, ready for
    `airflow.sdk.Param(**spec)`. Config-backed params take the field's schema and description, so
    the form and the file cannot drift; their default is the config's value (thresholds: empty)."""
    out: dict[str, dict[str, Any]] = {
        "datasets": {
            "default": config.dataset_names,
            "type": "array",
            "items": {"type": "string", "enum": config.dataset_names},
            "minItems": 1,
            "uniqueItems": True,
            "description": "Datasets to process. Others keep their committed artifacts of this run key.",
        },
        "run_name": {
            "default": None,
            "type": ["null", "string"],
            "pattern": RUN_NAME_PATTERN,
            "description": "Run key for a manual run (artifacts under runs/{run_name}/). Empty: "
            "date=YYYY-MM-DD of the logical date. Reuse a name to resume or rerun datasets.",
        },
    }
    out["config"] = {
        "default": None,
        "type": ["null", "string"],
        "enum": [None, *PACKAGED_CONFIGS],
        "description": "Packaged config to run instead of the DAG's own, by its target's family (e.g. qwen3: "
        "the Qwen3 dev target). Empty: the DAG's config ($EAGLE3_CONFIG, else the packaged default). The "
        "params below apply on top of either.",
    }
    for name, path in CONFIG_PARAMS.items():
        info = config_field(path)
        nullable = name in THRESHOLD_PARAMS
        description = info.description or path
        if nullable:
            description += " Empty: the config's value, per-dataset overrides included."
        out[name] = {
            "default": None if nullable else config_value(config, path),
            "description": f"{description} (config: {path})",
            **config_field_schema(path, nullable=nullable),
        }
    out["fresh_stages"] = {
        "default": [],
        "type": "array",
        "items": {"type": "string", "enum": list(FRESH_STAGES)},
        "uniqueItems": True,
        "description": "Stages of this run key to replace when they were committed from other inputs, params or "
        "tokenizer (otherwise such a run is refused and nothing is touched). The stages built on a replaced one "
        "must be named too. Paid answers are archived and reused where they still match.",
    }
    out["skip_hidden_states"] = {"default": False, "type": "boolean", "description": "Stop after merge (no GPU stage)."}
    out["dry_run"] = {
        "default": False,
        "type": "boolean",
        "description": "Plan only: prompt counts, routing, token and cost estimates. No generation, no spend.",
    }
    return out
