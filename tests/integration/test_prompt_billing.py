"""The prompt side of billing through the real stages (overflow generation on the dev server,
reconstruct, validate): a provider that renders the request with a system message of its own
bills that message's tokens on every answer; the gate fails the dataset naming the rows and the
gap, while the honest server's run passes. The expected counts are the Kimi template's own
render (`apply_chat_template`, tests/conversation_oracle.py), not the pipeline's."""

from __future__ import annotations

import json
import re

import pytest

from eagle3_data.errors import GateFailed
from eagle3_data.storage import StageRef
from eagle3_data.storage.writer import StageWriter
from eagle3_devtools.stack import SAMPLE_DATA
from tests.conversation_oracle import render

INJECTED = "You are a helpful assistant. Answer concisely."
DATASET = "tool_calls"


def _run(kimi_tokenizer_dir, run_key: str):
    from eagle3_data.config import load_config
    from eagle3_data.runs.run import Run

    config = load_config().with_overrides(
        {"tokenizer": {"source": str(kimi_tokenizer_dir)}, "validation": {"allow_unvalidated_overflow": True}},
        where="test",
    )
    return Run(config=config, run_key=run_key, date=None, datasets=[DATASET], dry_run=False, skip_hidden_states=True)


def _overflow_run(store, server, kimi_tokenizer, run):
    """Generate the dataset's first prompts on the overflow path, reconstruct them, and write the
    other stages validate reads (no local rows: the overflow share is allowed unvalidated here)."""
    from eagle3_data import pipeline
    from eagle3_data.stages.prompts.load import PromptShape, load_prompts
    from tests.generation_calls import MODEL, generate_overflow

    sampling = {"temperature": 0.0, "max_new_tokens": 96}
    rows = [
        {**r, "route": "overflow"}
        for r in list(
            load_prompts(str(SAMPLE_DATA / f"{DATASET}.jsonl"), DATASET, PromptShape(sampling=sampling)).rows
        )[:6]
    ]
    done = generate_overflow(
        store,
        pipeline.stage_ref(run, "generate_overflow", DATASET),
        rows,
        kimi_tokenizer,
        server.url + "/v1",
        "sk-test",
        MODEL,
        {},
        None,
        sampling={**sampling, "thinking": True},
        concurrency=2,
        rows_per_part=4,
    )
    assert done["complete"], done
    for stage, kind, data in (("prompts", "prompts", rows), ("generate_local", "generations", [])):
        with StageWriter(
            store, pipeline.stage_ref(run, stage, DATASET), kind, rows_per_part=64, params={}, fresh=True
        ) as w:
            if data:
                w.write(data)
            w.commit()
    pipeline.reconstruct(run, store, DATASET)
    return rows


def test_a_provider_rendering_another_prompt_fails_the_gate_on_prompt_billing(
    store, start_dev_server, kimi_tokenizer, kimi_tokenizer_dir
):
    from eagle3_data import pipeline
    from eagle3_data.stages import BILLING_REPORT

    # the honest provider: billed prompt tokens are the template's render of the request, and the gate passes
    honest = _run(kimi_tokenizer_dir, "prompt-billing-honest")
    rows = _overflow_run(store, start_dev_server({}), kimi_tokenizer, honest)
    expected = {
        r["sample_id"]: len(
            render(kimi_tokenizer, json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None)
        )
        for r in rows
    }
    committed = {
        r["sample_id"]: r for r in store.read_table(StageRef(honest.run_key, "reconstruct", DATASET)).to_pylist()
    }
    assert {sid: r["usage"]["prompt_tokens"] for sid, r in committed.items()} == expected
    assert {sid: len(r["prompt_ids"]) for sid, r in committed.items()} == expected
    result = pipeline.validate(honest, store, DATASET)
    assert result.gate.passed, result.gate.reasons
    report = store.get_json(StageRef(honest.run_key, "validate", DATASET), BILLING_REPORT)["prompt"]
    assert report["rows"] == len(rows) and report["mean_abs_diff"] == 0.0 and report["gate"]["passed"]

    # a provider prepending its own system message: each answer bills that message's render on top
    injected = _run(kimi_tokenizer_dir, "prompt-billing-injected")
    rows = _overflow_run(
        store, start_dev_server({"endpoints": {"chat": {"inject_system_prompt": INJECTED}}}), kimi_tokenizer, injected
    )
    gap = {}
    for r in rows:
        messages, tools = json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None
        gap[r["sample_id"]] = len(
            render(kimi_tokenizer, [{"role": "system", "content": INJECTED}, *messages], tools)
        ) - len(render(kimi_tokenizer, messages, tools))
    assert (
        len(set(gap.values())) == 1 and next(iter(gap.values())) > 2
    )  # one system message: the same gap on every answer
    size = next(iter(gap.values()))
    with pytest.raises(GateFailed) as failed:
        pipeline.validate(injected, store, DATASET)
    message = str(failed.value)
    assert (
        f"overflow prompt billing: billed prompt tokens differ from the prompt ids by {size:.2f} tokens per answer"
        in message
    )
    assert f"{len(rows)} answer(s) (100.00%) billed more than 2 prompt tokens away" in message
    named = re.findall(r"([0-9a-f]{32}) \(\+(\d+)\)", message)  # the rows, each with its gap
    assert len(named) == min(5, len(rows)) and all(gap[sid] == int(n) for sid, n in named)
    report = store.get_json(StageRef(injected.run_key, "validate", DATASET), BILLING_REPORT)
    assert report["gate"]["passed"]  # the completion side cannot see it: its tokens are the answers' own
    prompt = report["prompt"]
    assert prompt["diff_distribution"] == [[f"+{size}" if size <= 8 else ">= +9", len(rows)]]
    assert {o["sample_id"]: o["diff"] for o in prompt["over_tolerance"]["examples"]} == gap
    print("prompt billing gap per answer", size, json.dumps(prompt["gate"]["reasons"]))
