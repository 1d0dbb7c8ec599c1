"""One canonical JSON helper, byte-identical to the spellings existing artifacts were keyed with.

The golden values were computed with the three helpers this module replaced (storage's, the
checkpoint's, and the pipeline's ASCII-escaped one): if any changes, every existing sample id or
prompts manifest stops matching and reruns would regenerate paid work.
"""

from __future__ import annotations

import hashlib
import json

from eagle3_data.canonical import canonical_json
from eagle3_data.stages.prompts.load import sample_id

MESSAGES = [{"role": "user", "content": "Grüße, 世界 — ☃"}]
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 2048, "thinking": True}


def test_sample_ids_are_unchanged():
    assert sample_id("chat", MESSAGES, None, SAMPLING, 0) == "fe1086eecf3dc646cd91bb64934ba0c1"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert sample_id("tool_calls", MESSAGES, tools, SAMPLING, 1) == "f348376c09626da29d77d18456faa08b"


def test_prompts_rows_hash_keeps_its_ascii_spelling():
    rows = [{"sample_id": "x", "messages": json.dumps(MESSAGES, ensure_ascii=False), "route": "local"}]
    digest = hashlib.sha256(canonical_json(rows, ascii_only=True).encode()).hexdigest()
    assert digest == "6f8dffb81d7079599529188c8aa7fe2993c8c77007d2a94c61bd2bc25a496e51"


def test_one_helper_everywhere():
    from eagle3_data import storage
    from eagle3_data.stages.generate import checkpoint

    assert storage.canonical_json is canonical_json and checkpoint.canonical_json is canonical_json
    assert canonical_json({"b": "é", "a": [1, None]}) == '{"a":[1,null],"b":"é"}'
