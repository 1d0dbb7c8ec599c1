"""SGLang 0.5.23's behaviours a client must meet, against the dev server (protocol-true to them):
a full queue is backpressure, a silently truncated prompt is a failed row naming the cut, and a
sampling key SGLang's schema lets through but its SamplingParams refuses never reaches it."""

from __future__ import annotations

import httpx
import pytest

from eagle3_data.errors import UserError
from eagle3_data.storage import StageRef
from tests.generation_calls import generate_local
from tests.integration.test_generation import SAMPLING, prompts


def test_a_full_queue_is_backpressure_not_a_dead_endpoint(store, start_dev_server, kimi_tokenizer, tmp_path):
    """`--max-queued-requests` answers 503 "The request queue is full.": counted against the
    endpoint, one endpoint allowed one failure would be dropped at the first and the stage stop."""
    server = start_dev_server({"seed": 8, "endpoints": {"generate": {"queue_full": 0.5}}})
    ref = StageRef(run_key="sgl", stage="generate_local", dataset="chat")
    s = generate_local(
        store,
        ref,
        prompts(16, "chat"),
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        journal_dir=tmp_path,
        in_flight_per_endpoint=4,
        max_endpoint_failures=1,
        max_attempts=2,
    )
    assert s["complete"] and s["counts"]["ok"] == 16, s
    assert server.stats()["faults"]["generate"]["queue_full"] >= 8  # the queue really was full, often


def test_a_prompt_the_server_truncates_is_a_failed_row_naming_the_cut(
    store, start_dev_server, kimi_tokenizer, tmp_path
):
    server = start_dev_server({"auto_truncate_to": 10})  # --allow-auto-truncate with a short context
    ref = StageRef(run_key="sgl", stage="generate_local", dataset="cut")
    s = generate_local(store, ref, prompts(4, "cut"), kimi_tokenizer, [server.url], SAMPLING, journal_dir=tmp_path)
    assert s["complete"] and s["counts"]["failed"] == 4, s  # final: the same server cuts it the same way
    for r in store.read_table(ref).to_pylist():
        assert r["status"] == "failed" and r["output_ids"] is None
        assert (
            f"prompt cut by {server.url}: {len(r['prompt_ids'])} prompt ids sent, meta_info.prompt_tokens = 10"
            in r["error"]
        )


def test_choice_is_refused_before_any_request(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({})
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "choice": ["a", "b"]}}
    assert httpx.post(f"{server.url}/generate", json=body).status_code == 500  # what SGLang does with it
    ref = StageRef(run_key="sgl", stage="generate_local", dataset="choice")
    with pytest.raises(UserError, match="'choice' is not an SGLang sampling parameter"):
        generate_local(
            store,
            ref,
            prompts(2, "chat"),
            kimi_tokenizer,
            [server.url],
            dict(SAMPLING, choice=["a"]),
            journal_dir=tmp_path,
        )
    assert not server.stats()["requests"].get("generate")
