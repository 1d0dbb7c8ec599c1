"""The embedded services a laptop run needs, started together and stopped by PID.

`make demo`, `make airflow` and the end-to-end tests all run the real DAG against the same
stack: the real Kimi tokenizer and the packaged default config's target, a tiny random Kimi-K2.5
(the `dev:` builds, in their one home $EAGLE3_DATA_CACHE/dev, which the CLI's `dev:` sources use
too), SeaweedFS as S3, and the dev inference server
standing in for SGLang and
OpenRouter, all on free 127.0.0.1 ports. What the DAG reads comes from the environment the stack
returns: Airflow connections as AIRFLOW_CONN_* and the pipeline config as EAGLE3_CONFIG.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_data.config import deep_merge, default_config_raw
from eagle3_data.errors import UserError

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]  # include/eagle3_devtools/stack.py -> the checkout
SAMPLE_DATA = REPO / "include" / "sample_data"


def tokenizer_dir(builds: Path | None = None, base: dict | None = None) -> Path:
    """The packaged default config's `tokenizer.source` (`dev:kimi-tokenizer`), under `builds`
    (default $EAGLE3_DATA_CACHE/dev, where the CLI's dev: sources live: one copy, not one per
    launcher)."""
    return _default_dev_build("tokenizer", builds, base)


def target_model_dir(builds: Path | None = None, base: dict | None = None) -> Path:
    """The packaged default config's `model.source` (`dev:tiny-kimi-k25`, Kimi-K2.5's own class),
    built beside the tokenizer."""
    return _default_dev_build("model", builds, base)


def _default_dev_build(section: str, builds: Path | None, base: dict | None = None) -> Path:
    """The dev: build the packaged default config's `{section}.source` names: read from the config,
    so the stack runs on what a default install runs on and a change of the default (another
    family's builds) needs no second edit here."""
    from eagle3_data.builds.sources import resolve_dev_source
    from eagle3_data.config import DEV_SOURCE_SCHEME

    source = (base or default_config_raw())[section]["source"]
    if not source.startswith(DEV_SOURCE_SCHEME):
        raise UserError(f"the packaged config's {section}.source {source!r} is no dev: build; the dev stack needs one")
    return resolve_dev_source(source[len(DEV_SOURCE_SCHEME) :], builds)


def airflow_env(home: Path) -> dict[str, str]:
    """An isolated, loopback-only Airflow on SQLite under `home` (see ../shared/ENVIRONMENT.md)."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
    }


def airflow_db_migrate(env: dict[str, str]) -> None:
    airflow = Path(sys.executable).parent / "airflow"
    out = subprocess.run(
        [str(airflow), "db", "migrate"], capture_output=True, text=True, env={**os.environ, **env}, timeout=600
    )
    if out.returncode:
        raise UserError(f"airflow db migrate failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


@dataclass
class DevStack:
    workdir: Path
    config_path: Path
    s3_endpoint: str
    inference_url: str
    env: dict[str, str] = field(repr=False)  # holds the S3 secret: never print it
    s3: Any = field(repr=False, default=None)

    def client(self):
        return self.s3.client()

    def server_stats(self) -> dict:
        from eagle3_data.dev.processes import local_http

        return local_http().get(f"{self.inference_url}/dev/stats", timeout=10).json()


# The dev stack's stand-ins: the rebuilt tokenizer, the tiny model, and the dev inference server as
# both engines (a stack that runs a real engine, like `make demo ENGINE=vllm`, overrides the list).
DEV_STACK_STAND_INS = ("tokenizer", "model", "local_engine", "overflow_provider")


def write_config(
    path: Path, *, bucket: str, tokenizer: Path, model: Path, overrides: dict | None = None, base: dict | None = None
) -> Path:
    """The packaged default config pointed at the stack's bucket, tokenizer and model, plus overrides
    (merged by the config's own rule, the one params use)."""
    import yaml

    raw = copy.deepcopy(base) if base else default_config_raw()
    deep_merge(
        raw,
        {
            "storage": {"bucket": bucket},
            "tokenizer": {"source": str(tokenizer)},
            "model": {"source": str(model)},
            "stand_ins": list(DEV_STACK_STAND_INS),
            # the probe at the tiny target's size: seconds on CPU, not the GPU default's minutes
            "probe": {"samples": 32, "eval_samples": 8, "steps": 4, "eval_every": 2, "max_len": 256},
        },
    )
    deep_merge(raw, overrides or {})
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def upload_prompts(client, config, date: str, datasets: dict[str, Path] | None = None) -> list[str]:
    """Put each dataset's JSONL under {prompts root}/{dataset}/date=YYYY-MM-DD/ (the scheduled-run layout)."""
    uris = []
    for ds in config.datasets:
        src = (datasets or {}).get(ds.name, SAMPLE_DATA / f"{ds.name}.jsonl")
        bucket, _, prefix = ds.prompts.removeprefix("s3://").partition("/")
        key = f"{prefix.rstrip('/')}/{ds.name}/date={date}/{ds.name}.jsonl"
        client.put_object(Bucket=bucket, Key=key, Body=src.read_bytes())
        uris.append(f"s3://{bucket}/{key}")
    return uris


@contextmanager
def dev_stack(
    workdir: str | os.PathLike,
    *,
    config_overrides: dict | None = None,
    bucket: str = "eagle3",
    builds: Path | None = None,
    base: dict | None = None,
) -> Iterator[DevStack]:
    """Start SeaweedFS and the dev inference server, write the pipeline config, and yield the
    stack; everything started here is stopped on exit, by PID. `builds`: where the dev builds
    are (default $EAGLE3_DATA_CACHE/dev; the tests pass their fixtures' folder). `base`: the config
    the stack starts from and takes its dev: builds from (default the packaged one; the demo's
    MODEL=qwen3 passes defaults/qwen3.yaml)."""
    from eagle3_data.config import load_config
    from eagle3_data.dev.inference_server import DevServerProcess
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs

    work = Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(builds, base)
    model = target_model_dir(builds, base)
    config_path = write_config(
        work / "pipeline.yaml", bucket=bucket, tokenizer=tok, model=model, overrides=config_overrides, base=base
    )
    config = load_config(config_path)

    with ExitStack() as stack:
        access, secret = "dev-" + secrets.token_hex(4), secrets.token_hex(16)
        s3 = start_seaweedfs(work / "s3", access_key=access, secret_key=secret)
        stack.callback(stop_seaweedfs, work / "s3", 0.5)
        from eagle3_data.storage import ArtifactStore

        ArtifactStore(s3.client(), config.storage.bucket, config.storage.prefix).init_bucket()  # `eagle3-data s3 init`

        server = DevServerProcess(tok, log_path=work / "inference-server.log", pipeline_config=config_path)
        stack.callback(server.stop)
        port, url = server.port, server.url

        env = stack_env(
            work,
            config_path,
            s3_endpoint=s3.endpoint_url,
            access_key=access,
            secret_key=secret,
            inference_port=port,
            inference_url=url,
        )
        yield DevStack(work, config_path, s3.endpoint_url, url, env, s3)


def stack_env(
    work: Path,
    config_path: Path,
    *,
    s3_endpoint: str,
    access_key: str,
    secret_key: str,
    inference_port: int,
    inference_url: str,
) -> dict[str, str]:
    """What the DAG reads: the connections (same ids and types as docker-compose.yaml) and the config."""
    aws = {
        "conn_type": "aws",
        "login": access_key,
        "password": secret_key,
        "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }
    return {
        "EAGLE3_CONFIG": str(config_path),
        "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(aws),
        "AIRFLOW_CONN_SGLANG_DEFAULT": json.dumps(
            {"conn_type": "http", "host": "127.0.0.1", "port": inference_port, "schema": "http"}
        ),
        "AIRFLOW_CONN_OPENROUTER_DEFAULT": json.dumps(
            {"conn_type": "http", "host": f"{inference_url}/v1", "password": "dev-key-not-a-secret"}
        ),
        "EAGLE3_JOURNAL_DIR": str(work / "journal"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
