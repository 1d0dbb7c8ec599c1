"""A dead endpoint is named within seconds, before anything is dispatched: nothing listening at
an SGLang/vLLM URL or at the overflow base URL ends the stage with the URL and what was tried,
instead of a silent wait through the warm-up (600 s) or every sample's retries."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
import yaml

from eagle3_data.config import LocalGenerationConfig
from eagle3_data.engines.client import wait_healthy
from eagle3_data.errors import EndpointUnavailable
from eagle3_data.stages.generate.local_endpoints import HealthWait
from eagle3_data.stages.generate.openrouter_http import SdkPost
from eagle3_data.storage import StageRef

SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 16, "thinking": True}


def _dead_url() -> str:
    with socket.socket() as s:  # bound and closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _prompts(n: int = 3) -> list[dict]:
    return [
        {
            "sample_id": f"s{i}",
            "dataset": "ds",
            "sample_index": i,
            "route": "both",
            "tools": None,
            "messages": json.dumps([{"role": "user", "content": f"q{i}"}]),
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_local_endpoint_with_nothing_listening(store, kimi_tokenizer, tmp_path, engine):
    from tests.generation_calls import generate_local

    dead = _dead_url()
    started = time.monotonic()
    with pytest.raises(EndpointUnavailable) as err:
        generate_local(
            store,
            StageRef("dead", "generate_local", "ds"),
            _prompts(),
            kimi_tokenizer,
            [dead],
            SAMPLING,
            engine=engine,
            journal_dir=tmp_path,
            health_interval_s=0.1,
            unreachable_timeout_s=1.0,
        )
    assert time.monotonic() - started < 10  # the warm-up (600 s) is for servers that answer
    message = str(err.value)
    assert dead in message and "no connection for" in message and f"GET {dead}/health" in message, message
    assert "unreachable_timeout_s" in message
    assert not store.is_complete(StageRef("dead", "generate_local", "ds"))


def _waiting_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "waiting for" in r.getMessage()]


def test_local_health_wait_says_so_from_its_first_retry(caplog):
    """A wait on a refused port lasts `unreachable_timeout_s` (15 s by default) before the error:
    its first retry already prints a WARNING naming the URL, not an INFO line after 10 s that the
    CLI and the demo (WARNING) never show."""
    import aiohttp

    dead = _dead_url()

    async def wait():
        async with aiohttp.ClientSession() as http:
            timings = HealthWait(LocalGenerationConfig(unreachable_timeout_s=2.0), health_interval_s=0.1)
            return await wait_healthy(http, dead, "sglang", timings)

    problem = asyncio.run(wait())
    assert problem is not None and "no connection for" in problem
    lines = _waiting_lines(caplog)
    assert lines and lines[0].startswith(f"sglang endpoint: waiting for {dead}/health ... (1 tries over"), lines


def test_overflow_reachability_check_says_so_from_its_first_retry(caplog):
    """The overflow client's check before the first paid request: same, its first retry names the URL."""
    dead = _dead_url()

    async def check():
        client = SdkPost(dead + "/v1", "sk-test", 1, 5.0)
        try:
            await client.check_reachable(2.0)
        finally:
            await client.http.close()

    with pytest.raises(EndpointUnavailable, match="no connection for"):
        asyncio.run(check())
    lines = _waiting_lines(caplog)
    assert lines and lines[0].startswith(f"openrouter: waiting for {dead}/v1/models ... (no connection for "), lines
    assert " s of 2 s, 1 tries, last: ClientConnectorError" in lines[0], lines


def test_a_warming_server_is_still_waited_for(store, start_dev_server, kimi_tokenizer, tmp_path):
    """Answering 503 (loading its model) is not dead: the warm-up, not the connect window, bounds it."""
    from tests.generation_calls import generate_local

    server = start_dev_server({"warmup_s": 2.0})
    summary = generate_local(
        store,
        StageRef("warm", "generate_local", "ds"),
        _prompts(),
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        journal_dir=tmp_path,
        health_interval_s=0.1,
        unreachable_timeout_s=0.5,
        warmup_timeout_s=60,
    )
    assert summary["counts"]["ok"] == 3


def test_one_dead_endpoint_beside_a_live_one_is_named_and_skipped(
    store, start_dev_server, kimi_tokenizer, tmp_path, caplog
):
    from tests.generation_calls import generate_local

    server, dead = start_dev_server({}), _dead_url()
    summary = generate_local(
        store,
        StageRef("half", "generate_local", "ds"),
        _prompts(),
        kimi_tokenizer,
        [dead, server.url],
        SAMPLING,
        journal_dir=tmp_path,
        health_interval_s=0.1,
        unreachable_timeout_s=1.0,
    )
    assert summary["counts"]["ok"] == 3
    assert any(dead in r.getMessage() and "no connection" in r.getMessage() for r in caplog.records)


def test_overflow_base_url_with_nothing_listening(store, kimi_tokenizer, tmp_path):
    from tests.generation_calls import generate_overflow

    dead = _dead_url()
    with pytest.raises(EndpointUnavailable) as err:
        generate_overflow(
            store,
            StageRef("dead", "generate_overflow", "ds"),
            _prompts(),
            kimi_tokenizer,
            dead + "/v1",
            "sk-test",
            "moonshotai/kimi-k2.5",
            None,
            1.0,
            sampling=SAMPLING,
            journal_dir=tmp_path,
            unreachable_timeout_s=1.0,
        )
    message = str(err.value)
    assert f"GET {dead}/v1/models" in message and "no connection for" in message and "nothing was sent" in message


def test_cli_names_a_dead_endpoint_in_seconds(s3_server, store, kimi_tokenizer_dir, tmp_path, monkeypatch, capsys):
    from eagle3_data.cli import main
    from eagle3_data.config import default_config_raw

    raw = default_config_raw()
    raw["storage"]["bucket"] = store.bucket
    raw["tokenizer"]["source"] = str(kimi_tokenizer_dir)
    raw["generation"]["local"]["unreachable_timeout_s"] = 2.0
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    for name, value in (
        ("AWS_ACCESS_KEY_ID", s3_server.access_key),
        ("AWS_SECRET_ACCESS_KEY", s3_server.secret_key),
        ("AWS_ENDPOINT_URL", s3_server.endpoint_url),
        ("EAGLE3_JOURNAL_DIR", str(tmp_path / "j")),
    ):
        monkeypatch.setenv(name, value)
    dead = _dead_url()
    started = time.monotonic()
    code = main(
        [
            "generate",
            "local",
            "--config",
            str(tmp_path / "pipeline.yaml"),
            "--dataset",
            "chat",
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--run-key",
            "dead",
            "--endpoint",
            dead,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert time.monotonic() - started < 30
    last = err.strip().splitlines()[-1]
    assert last.startswith("eagle3-data: error: ") and dead in last and "no connection for" in last, err
