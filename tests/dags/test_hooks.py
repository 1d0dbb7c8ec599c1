"""The Airflow hooks turn connections into the plain values the library takes."""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures.airflow import REPO


@pytest.fixture(autouse=True)
def plugins_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "plugins"))  # what Airflow does for the plugins folder
    yield
    for name in [m for m in sys.modules if m == "hooks" or m.startswith("hooks.")]:
        sys.modules.pop(name)


def _conn(monkeypatch, conn_id: str, **fields) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "http", **fields}))


@pytest.mark.parametrize(
    "fields, endpoints",
    [
        ({"host": "sglang-0", "port": 30000}, ["http://sglang-0:30000"]),
        ({"host": "sglang-0", "schema": "https"}, ["https://sglang-0"]),
        ({"host": "x", "extra": {"endpoints": ["http://a:1", "http://b:2"]}}, ["http://a:1", "http://b:2"]),
        ({"host": "x", "extra": {"endpoints": "http://a:1, http://b:2"}}, ["http://a:1", "http://b:2"]),
    ],
)
def test_sglang_hook_endpoints(monkeypatch, fields, endpoints):
    from hooks.local_engine import LocalEngineHook

    _conn(monkeypatch, "sglang_default", **fields)
    assert LocalEngineHook().get_endpoints() == endpoints


def test_sglang_hook_refuses_a_non_url_endpoint(monkeypatch):
    from hooks.local_engine import LocalEngineHook

    from eagle3_data.errors import UserError

    _conn(monkeypatch, "sglang_default", host="x", extra={"endpoints": ["sglang-0:30000"]})
    with pytest.raises(UserError, match="sglang-0:30000"):
        LocalEngineHook().get_endpoints()


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"host": "sglang-0", "password": "sk-sglang"}, "sk-sglang"),
        ({"host": "sglang-0", "extra": {"api_key": "sk-extra"}}, "sk-extra"),
        ({"host": "sglang-0", "password": "sk-sglang", "extra": {"api_key": "sk-extra"}}, "sk-sglang"),
        ({"host": "sglang-0"}, None),
    ],
)
def test_sglang_hook_api_key(monkeypatch, fields, key):
    """The servers' `--api-key`: the connection's password, else its extra `api_key`; None without."""
    from hooks.local_engine import LocalEngineHook

    _conn(monkeypatch, "sglang_default", **fields)
    assert LocalEngineHook().get_api_key() == key


@pytest.mark.parametrize(
    "host, base_url",
    [
        ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1"),
        ("openrouter.ai/api/v1", "https://openrouter.ai/api/v1"),
        (None, "https://openrouter.ai/api/v1"),
    ],
)
def test_openrouter_hook_base_url_and_key(monkeypatch, host, base_url):
    from hooks.openrouter import OpenRouterHook

    _conn(monkeypatch, "openrouter_default", **({"host": host} if host else {}), password="sk-or-secret")
    assert OpenRouterHook().get_base_url_and_key() == (base_url, "sk-or-secret")


def test_hooks_declare_their_forms():
    from hooks.local_engine import LocalEngineHook
    from hooks.openrouter import OpenRouterHook

    for hook in (LocalEngineHook, OpenRouterHook):
        ui = hook.get_ui_field_behaviour()
        assert set(ui) == {"hidden_fields", "relabeling", "placeholders"}
        assert isinstance(hook.get_connection_form_widgets(), dict)
    assert OpenRouterHook.get_ui_field_behaviour()["relabeling"]["password"] == "API key"
    assert "endpoints" in LocalEngineHook.get_connection_form_widgets()


def test_plugins_manager_does_not_load_the_hooks_under_bare_names(tmp_path):
    """The plugins manager imports every file of the plugins folder under its stem; without
    plugins/.airflowignore, hooks/local_engine.py would become `sys.modules["local_engine"]`."""
    import os
    import subprocess

    code = (
        "import sys\nfrom airflow import plugins_manager as pm\npm.ensure_plugins_loaded()\n"
        "print(sorted(m for m in ('local_engine', 'openrouter', '__init__') if m in sys.modules))\n"
    )
    env = {**os.environ, "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"), "AIRFLOW_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
