"""`OpenRouterHook`: base URL and API key of connection `openrouter_default`."""

from __future__ import annotations

from typing import Any

from airflow.sdk.bases.hook import BaseHook
from eagle3_airflow import OPENROUTER_CONN_ID

DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"


class OpenRouterHook(BaseHook):
    """Host = base URL (https:// assumed when it has no scheme; empty: OpenRouter's public API),
    password = API key. The key is a secret: Airflow masks it in logs; never put it in XCom."""

    conn_name_attr = "openrouter_conn_id"
    default_conn_name = OPENROUTER_CONN_ID
    conn_type = "openrouter"
    hook_name = "OpenRouter"

    def __init__(self, openrouter_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.openrouter_conn_id = openrouter_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "port", "login", "extra"],
            "relabeling": {"host": "Base URL", "password": "API key"},
            "placeholders": {"host": DEFAULT_BASE_URL, "password": "sk-or-..."},
        }

    @classmethod
    def get_connection_form_widgets(cls) -> dict[str, Any]:
        return {}

    def get_base_url_and_key(self) -> tuple[str, str]:
        conn = self.get_connection(self.openrouter_conn_id)
        host = (conn.host or "").strip()
        if not host:
            base_url = DEFAULT_BASE_URL
        elif "://" in host:
            base_url = host
        else:
            base_url = f"https://{host}"
        return base_url, conn.password or ""
