"""Both generation stages against the dev inference server, into a real S3 (SeaweedFS)."""

from __future__ import annotations

import json
import re

import pytest

from eagle3_data.chat_format import get_output_format
from eagle3_data.storage import StageRef
from tests.generation_calls import MODEL, generate_local, generate_overflow

SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 160, "thinking": True}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
SECRET = "sk-or-v1-THIS-KEY-MUST-NOT-LEAK-0123456789"


def prompts(n: int, dataset: str = "tool_calls") -> list[dict]:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Question {i}: what is the weather in city {i}?"}]
        rows.append(
            {
                "sample_id": f"s{i:04d}",
                "dataset": dataset,
                "sample_index": i,
                "messages": json.dumps(msgs),
                "tools": json.dumps(WEATHER) if i % 2 == 0 else None,
                "route": "both",
            }
        )
    return rows


def test_local_generation_ids_parse_and_resume(store, start_dev_server, kimi_tokenizer, tmp_path):
    dev_server = start_dev_server({})
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    ref = StageRef(run_key="run-a", stage="generate_local", dataset="tool_calls")
    summary = generate_local(
        store,
        ref,
        prompts(24),
        kimi_tokenizer,
        [dev_server.url],
        SAMPLING,
        in_flight_per_endpoint=4,
        rows_per_part=5,
        journal_dir=tmp_path,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 24, summary
    table = store.read_table(ref).to_pylist()
    assert sorted(r["sample_id"] for r in table) == [f"s{i:04d}" for i in range(24)]
    im_end = kimi_tokenizer.convert_tokens_to_ids("<|im_end|>")
    stats = dev_server.stats()
    for r in table:
        assert r["status"] == "ok" and r["source"] == "sglang"
        assert r["prompt_ids"] == fmt.generation_prompt_ids(
            json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None
        )
        prov = json.loads(r["provenance"])
        if r["finish_reason"] == "stop":
            assert r["output_ids"][-1] == im_end  # stored WITH the stop id, as SGLang gives it
            assert prov["finish_reason"] == {"type": "stop", "matched": im_end}  # the engine's finish, as given
        else:
            assert im_end not in r["output_ids"] and len(r["output_ids"]) == 160
            assert prov["finish_reason"] == {"type": "length", "length": 160}
        assert re.fullmatch(rf"{r['sample_id']}\.[0-9a-f]{{8}}\.0", prov["rid"]) and prov["weight_version"] == "dev"
        assert prov["sampling"]["stop_token_ids"] == fmt.stop_token_ids  # the audited ids, always sent
        # what the parser split out is exactly the text of the ids
        rendered = fmt.render(fmt.parse_ids(r["output_ids"], r["finish_reason"]).message, r["finish_reason"])
        assert kimi_tokenizer.decode(r["output_ids"]) == rendered
        assert stats["answered"]["generate"][r["sample_id"]] == 1
    assert any(r["tool_calls"] for r in table)
    for r in table:
        for call in json.loads(r["tool_calls"] or "[]"):
            assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}
    # complete stage: a rerun sends nothing
    again = generate_local(store, ref, prompts(24), kimi_tokenizer, [dev_server.url], SAMPLING, journal_dir=tmp_path)
    assert again["reused"] and again["counts"]["ok"] == 24 and again["cost_usd"] == 0
    assert sum(dev_server.stats()["requests"]["generate"][f"s{i:04d}"] for i in range(24)) == 24


def test_local_generation_draws_prompts_from_a_stream_as_slots_free_up(
    store, start_dev_server, kimi_tokenizer, tmp_path, monkeypatch
):
    """The pipeline passes the prompts stage as a stream of rows: the client decodes a prompt
    only when a free slot takes it, so at most `in_flight` prompts are alive, never all of them
    queued up front; a spill that cannot be read back stops the stage instead of hanging it."""
    from eagle3_data.stages.generate import checkpoint
    from eagle3_data.stages.generate.progress import Progress

    dev_server = start_dev_server({})
    decode = checkpoint.Prompts.iter
    state = {"drawn": 0, "settled": 0, "ahead": []}

    def counting(self, skip=()):
        for p in decode(self, skip):
            state["drawn"] += 1
            state["ahead"].append(state["drawn"] - state["settled"])
            yield p

    class Settled(Progress):
        def update(self, **counts):
            super().update(**counts)
            state["settled"] += counts.get("ok", 0) + counts.get("failed", 0)

    monkeypatch.setattr(checkpoint.Prompts, "iter", counting)
    ref = StageRef(run_key="run-stream", stage="generate_local", dataset="tool_calls")
    summary = generate_local(
        store,
        ref,
        iter(prompts(30)),
        kimi_tokenizer,
        [dev_server.url],
        SAMPLING,
        in_flight_per_endpoint=3,
        rows_per_part=8,
        journal_dir=tmp_path,
        progress=Settled(),
    )
    assert summary["complete"] and summary["counts"]["ok"] == 30, summary
    assert state["drawn"] == 30 and max(state["ahead"]) <= 3  # decoded as taken: one per busy slot

    def unreadable(self, skip=()):
        yield next(decode(self, skip))
        raise OSError("spill unreadable")

    monkeypatch.setattr(checkpoint.Prompts, "iter", unreadable)
    with pytest.raises(OSError, match="spill unreadable"):
        generate_local(
            store,
            StageRef("run-stream-2", "generate_local", "tool_calls"),
            prompts(10),
            kimi_tokenizer,
            [dev_server.url],
            SAMPLING,
            in_flight_per_endpoint=3,
            journal_dir=tmp_path,
        )


def test_overflow_text_matches_local_ids_and_key_never_stored(
    store, start_dev_server, kimi_tokenizer, tmp_path, caplog
):
    dev_server = start_dev_server({})
    caplog.set_level("DEBUG")
    local = StageRef(run_key="run-b", stage="generate_local", dataset="tool_calls")
    over = StageRef(run_key="run-b", stage="generate_overflow", dataset="tool_calls")
    generate_local(store, local, prompts(12), kimi_tokenizer, [dev_server.url], SAMPLING, journal_dir=tmp_path)
    summary = generate_overflow(
        store,
        over,
        prompts(12),
        kimi_tokenizer,
        dev_server.url + "/v1",
        SECRET,
        "moonshotai/kimi-k2.5",
        {"order": ["moonshotai"], "allow_fallbacks": False},
        5.0,
        sampling=SAMPLING,
        concurrency=8,
        journal_dir=tmp_path,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 12 and summary["cost_usd"] > 0, summary
    by_id = {r["sample_id"]: r for r in store.read_table(local).to_pylist()}
    for r in store.read_table(over).to_pylist():
        assert r["output_ids"] is None and r["source"] == "openrouter"
        assert json.loads(r["provenance"])["generation_id"].startswith("gen-")
        mine = by_id[r["sample_id"]]
        assert r["prompt_ids"] == mine["prompt_ids"]
        assert (r["reasoning"], r["content"]) == (mine["reasoning"], mine["content"])
        assert r["usage"]["completion_tokens"] == len(mine["output_ids"])
        assert (r["finish_reason"] == "length") == (mine["finish_reason"] == "length")
    # the key appears nowhere: rows, manifests, side files, logs
    bucket = store.client.list_objects_v2(Bucket=store.bucket)["Contents"]
    for obj in bucket:
        body = store.client.get_object(Bucket=store.bucket, Key=obj["Key"])["Body"].read()
        assert SECRET.encode() not in body, obj["Key"]
    assert SECRET not in caplog.text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace")


def test_local_refuses_ids_that_do_not_match_completion_tokens(store, start_dev_server, kimi_tokenizer, tmp_path):
    """SGLang's output_ids run through the matched stop token: a server whose ids miss it (fewer
    ids than meta_info.completion_tokens) is refused, never silently repaired."""
    server = start_dev_server({"include_stop_in_output_ids": False})
    ref = StageRef(run_key="run-c", stage="generate_local", dataset="chat")
    summary = generate_local(
        store,
        ref,
        prompts(3, "chat"),
        kimi_tokenizer,
        [server.url],
        dict(SAMPLING, max_new_tokens=4000),
        journal_dir=tmp_path,
        max_attempts=1,
    )
    assert summary["counts"]["ok"] == 0, summary
    assert not summary["complete"]  # retryable: a rerun may meet a correct server


def test_sglang_protocol_rids_warmup_readmission(store, start_dev_server, kimi_tokenizer, tmp_path):
    """A fresh rid per attempt (a retry with the same rid is a 400 "Duplicate request ID" on
    SGLang), an endpoint that refuses requests is dropped after `max_endpoint_failures` and
    re-admitted when /health answers again; unknown sampling keys never reach the server."""
    from eagle3_data.errors import UserError

    server = start_dev_server({"refuse_first": 3})
    ref = StageRef(run_key="run-p", stage="generate_local", dataset="chat")
    summary = generate_local(
        store,
        ref,
        prompts(4, "chat"),
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        journal_dir=tmp_path,
        in_flight_per_endpoint=1,
        max_attempts=6,
        max_endpoint_failures=3,
        health_interval_s=0.05,
        warmup_timeout_s=60,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 4, summary
    rids = {json.loads(r["provenance"])["rid"] for r in store.read_table(ref).to_pylist()}
    assert any(not rid.endswith(".0") for rid in rids)  # retried with fresh rids, and answered
    assert server.stats()["requests"]["generate"] and sum(server.stats()["answered"]["generate"].values()) == 4
    with pytest.raises(UserError, match="'seed' is not an SGLang sampling parameter"):
        generate_local(
            store,
            StageRef(run_key="run-q", stage="generate_local", dataset="chat"),
            prompts(1, "chat"),
            kimi_tokenizer,
            [server.url],
            dict(SAMPLING, seed=1),
            journal_dir=tmp_path,
        )


def test_sglang_waits_while_the_server_warms_up(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"warmup_s": 1.0})  # /health answers 503 for the first second
    ref = StageRef(run_key="run-w", stage="generate_local", dataset="chat")
    summary = generate_local(
        store,
        ref,
        prompts(2, "chat"),
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        journal_dir=tmp_path,
        health_interval_s=0.1,
        warmup_timeout_s=60,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 2
    assert sum(server.stats()["requests"]["generate"].values()) == 2  # nothing was sent before it was ready
    server.configure({"healthy": False})
    from eagle3_data.errors import UserError

    with pytest.raises(UserError, match="no SGLang endpoint is usable: .*not ready after 0.2 s of warm-up"):
        generate_local(
            store,
            StageRef(run_key="run-x", stage="generate_local", dataset="chat"),
            prompts(1, "chat"),
            kimi_tokenizer,
            [server.url],
            SAMPLING,
            journal_dir=tmp_path,
            health_interval_s=0.05,
            warmup_timeout_s=0.2,
        )


def test_calibration_overlap_agrees_unless_bpe_splits(store, start_dev_server, kimi_tokenizer, tmp_path):
    """Route "both" samples go greedy on both paths; the report compares engine ids with the
    reconstruction of the provider's text. The dev server splits BPE tokens only in dataset
    "splitty": there (and only there) the first-N-token agreement must drop while the text agrees."""
    from eagle3_data.stages.validate.consistency import consistency_report

    server = start_dev_server({"datasets": {"splitty": {"noncanonical_rate": 0.05}}})
    reports = {}
    for ds in ("chat", "splitty"):
        rows = [dict(r, dataset=ds) for r in prompts(8, ds)]
        local = StageRef(run_key="cal", stage="generate_local", dataset=ds)
        over = StageRef(run_key="cal", stage="generate_overflow", dataset=ds)
        sampling = dict(SAMPLING, temperature=0.9, max_new_tokens=4000)  # route "both" overrides to 0
        generate_local(store, local, rows, kimi_tokenizer, [server.url], sampling, journal_dir=tmp_path)
        generate_overflow(
            store,
            over,
            rows,
            kimi_tokenizer,
            server.url + "/v1",
            SECRET,
            MODEL,
            {},
            None,
            sampling=sampling,
            concurrency=4,
            journal_dir=tmp_path,
        )
        assert all(
            json.loads(r["provenance"])["sampling"]["temperature"] == 0.0 for r in store.read_table(local).to_pylist()
        )
        reports[ds] = consistency_report(
            get_output_format(kimi_tokenizer, thinking=True),
            store.read_table(local).to_pylist(),
            store.read_table(over).to_pylist(),
            first_n=10_000,
        )
    assert reports["chat"]["samples"] == 8 and reports["chat"]["agreement"] == 1.0
    split = reports["splitty"]
    assert split["agreement"] < 1.0 and all(s["same_text"] for s in split["per_sample"])
