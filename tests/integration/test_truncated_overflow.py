"""Overflow rows cut by a small max_tokens, from the dev server's OpenRouter-shaped endpoint:
the billing gate passes over the faithful rows, the cut tool calls are excluded and reported,
and every faithful row rebuilds exactly the engine's ids for the same prompt (`/generate`)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from eagle3_data.chat_format import get_output_format
from eagle3_data.dev.inference_server import create_app
from eagle3_data.reconstruction import reconstruct_rows, row_to_reconstruct
from eagle3_data.stages.validate import compare_billed_counts
from eagle3_devtools.stack import SAMPLE_DATA
from tests.generation_calls import MODEL

MAX_TOKENS = 48
PER_DATASET = 16


def test_billing_gate_with_truncated_tool_calls(kimi_tokenizer):
    client = TestClient(create_app(kimi_tokenizer))
    rows, engine = [], {}
    for name in ("tool_calls", "chat"):
        for i, line in enumerate((SAMPLE_DATA / f"{name}.jsonl").read_text().splitlines()[:PER_DATASET]):
            p = json.loads(line)
            sid = f"{name}-{i}"
            answer = client.post(
                "/v1/chat/completions", json={**p, "model": MODEL, "max_tokens": MAX_TOKENS, "seed": 7}
            ).json()
            choice = answer["choices"][0]
            rows.append(
                {
                    "sample_id": sid,
                    **{k: choice["message"].get(k) for k in ("reasoning", "content", "tool_calls")},
                    "finish_reason": choice["finish_reason"],
                    "tools": p.get("tools"),
                    "messages": p["messages"],
                    "billed": answer["usage"]["completion_tokens"],
                }
            )
            prompt = kimi_tokenizer.apply_chat_template(
                p["messages"],
                tools=p.get("tools") or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            engine[sid] = client.post(
                "/generate",
                json={"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "sampling_seed": 7}},
            ).json()["output_ids"]
    fmt = get_output_format(kimi_tokenizer, thinking=True)
    rebuilt = list(reconstruct_rows(fmt, [row_to_reconstruct(fmt, r, r["sample_id"]) for r in rows]))
    billed = {r["sample_id"]: r["billed"] for r in rows}

    naive = compare_billed_counts((r.sample_id, billed[r.sample_id], len(ids)) for r, ids in rebuilt)
    assert not naive["gate"]["passed"]  # the problem is exercised: cut tool calls rebuild short
    report = compare_billed_counts(
        (r.sample_id, billed[r.sample_id], len(ids), r.unreconstructable) for r, ids in rebuilt
    )
    assert report["gate"]["passed"] and report["deviation"] == 0.0, report
    reasons = report["excluded"]["reasons"]
    assert report["excluded"]["rows"] == sum(reasons.values()) > 0 and "truncated inside tool-call section" in reasons
    assert report["rows"] + report["excluded"]["rows"] == len(rows)

    faithful_cuts = 0
    for r, ids in rebuilt:
        if r.unreconstructable:
            assert r.finish_reason == "length" and r.sample_id.startswith("tool_calls")
            continue
        assert ids[: len(engine[r.sample_id])] == engine[r.sample_id] and len(ids) == billed[r.sample_id], r.sample_id
        faithful_cuts += r.finish_reason == "length"
    assert faithful_cuts > 0  # truncated rows without tools stay in, with the engine's exact ids
