"""`LocalEngineHook`: the local inference endpoints (SGLang or vLLM servers, per the config's
`generation.local.engine`) of connection `sglang_default` (its id kept from when SGLang was the
only engine: deployments already define it), and their API key, for servers started with
`--api-key`."""

from __future__ import annotations

from typing import Any

from airflow.sdk.bases.hook import BaseHook
from eagle3_airflow import SGLANG_CONN_ID


class LocalEngineHook(BaseHook):
    """Endpoints from the connection's extra `endpoints` (a list, or one comma/space separated
    string) when set, else the connection's own `schema://host:port` (schema defaults to http).
    The API key (the servers' `--api-key`) is the connection's password, else its extra `api_key`:
    a secret, which Airflow masks in logs (both field names are ones it masks); the DAG hands it
    to the library as a plain value inside the task, never through XCom."""

    conn_name_attr = "local_engine_conn_id"
    default_conn_name = SGLANG_CONN_ID
    conn_type = "sglang"  # the connection type deployments already registered
    hook_name = "Local inference engine (SGLang or vLLM)"

    def __init__(self, local_engine_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.local_engine_conn_id = local_engine_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["login"],
            "relabeling": {"schema": "Scheme (http or https)", "password": "API key (the servers' --api-key)"},
            "placeholders": {
                "host": "sglang-0.internal",
                "port": "30000",
                "schema": "http",
                "extra": '{"endpoints": ["http://sglang-0:30000", "http://sglang-1:30000"]}',
            },
        }

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        """The extra fields, in Airflow 3's provider `conn-fields` format (JSON schema)."""
        return {
            "endpoints": {
                "label": "Endpoints",
                "description": (
                    "SGLang or vLLM server URLs, comma separated; empty: scheme://host:port of this connection"
                ),
                "schema": {"type": ["string", "null"]},
            }
        }

    def get_endpoints(self) -> list[str]:
        from eagle3_data.engines.client import local_endpoints

        conn = self.get_connection(self.local_engine_conn_id)
        extra = conn.extra_dejson or {}
        if extra.get("endpoints"):
            return local_endpoints(extra["endpoints"])
        port = f":{conn.port}" if conn.port else ""
        return local_endpoints(f"{conn.schema or 'http'}://{conn.host}{port}")

    def get_api_key(self) -> str | None:
        """The servers' API key; None when they take requests without one."""
        conn = self.get_connection(self.local_engine_conn_id)
        return conn.password or (conn.extra_dejson or {}).get("api_key") or None
