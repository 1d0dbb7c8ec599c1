"""Conversations regenerated turn by turn (`generation.regenerate: every_turn`) through the CLI's
local stage on the dev server: one sample per user turn of include/sample_data/conversations.jsonl
(multi-turn, parallel tool calls, ShareGPT and OpenAI layouts, an earlier answer with reasoning),
each prompt's ids the real Kimi template's render of the history up to that turn."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from eagle3_data.cli import main
from eagle3_data.config import default_config_raw
from eagle3_data.storage import StageRef

CONVERSATIONS = Path(__file__).resolve().parents[2] / "include" / "sample_data" / "conversations.jsonl"


def test_every_turn_generates_one_sample_per_user_turn_with_the_templates_ids(s3_server, store, kimi_tokenizer,
                                                                               kimi_tokenizer_dir, tmp_path, monkeypatch):
    raw = default_config_raw()
    raw["storage"]["bucket"] = store.bucket
    raw["tokenizer"]["source"] = str(kimi_tokenizer_dir)
    raw["generation"]["sampling"]["max_new_tokens"] = 24
    raw["routing"].update(overflow_fraction=0.0, calibration_samples=0)  # every turn local: exact ids
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(raw))
    for name, value in (("AWS_ACCESS_KEY_ID", s3_server.access_key), ("AWS_SECRET_ACCESS_KEY", s3_server.secret_key),
                        ("AWS_ENDPOINT_URL", s3_server.endpoint_url), ("EAGLE3_JOURNAL_DIR", str(tmp_path / "j"))):
        monkeypatch.setenv(name, value)
    assert main(["generate", "local", "--config", str(tmp_path / "pipeline.yaml"), "--dataset", "chat", "--prompts",
                 str(CONVERSATIONS), "--run-key", "turns", "--dev", "--regenerate", "every_turn"]) == 0
    rows = store.read_table(StageRef("turns", "generate_local", "chat")).to_pylist()
    lines = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]
    user_turns = sum(m["role"] == "user" for r in lines for m in r.get("messages", []))
    user_turns += sum(t["from"] == "human" for r in lines for t in r.get("conversations", []))
    assert len(rows) == user_turns == 10 and all(r["status"] == "ok" for r in rows)
    prompts = {r["sample_id"]: r for r in store.read_table(StageRef("turns", "prompts", "chat")).to_pylist()}
    assert set(prompts) == {r["sample_id"] for r in rows}
    for r in rows:
        p = prompts[r["sample_id"]]
        messages, tools = json.loads(p["messages"]), json.loads(p["tools"]) if p["tools"] else None
        assert messages[-1]["role"] == "user"
        expected = kimi_tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                                      return_dict=False)
        assert r["prompt_ids"] == expected, r["sample_id"]  # what the model sees when it answers that turn
    # each turn's history is the row's own, up to that turn: the longest prompt of trip-1 holds its parallel calls
    longest = max((json.loads(p["messages"]) for p in prompts.values()), key=len)
    assert len(longest) == 9 and [c["function"]["name"] for c in longest[2]["tool_calls"]] == ["get_weather"] * 2
    assert store.read_manifest(StageRef("turns", "prompts", "chat"))["params"]["regenerate"] == "every_turn"
