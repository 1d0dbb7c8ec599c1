"""A seeded stand-in for Kimi-K2.5's sampler: Kimi-format generations as real token ids.

The dev inference server needs outputs that exercise everything the pipeline must get right
(reasoning, its end token, content with code/CJK/whitespace edges, tool calls with valid JSON
arguments, the stop token, length truncation and non-canonical BPE splits) while staying fully
deterministic, so tests and validation have a ground truth. Text is picked from a small corpus by
an RNG seeded from the prompt ids (and the sampling seed unless temperature is 0); ids come from
the real tokenizer, piece by piece between special tokens, which equals encoding the rendered text
in one go. Non-canonical splits replace one multi-byte token by two valid tokens whose bytes
concatenate to it: the text is unchanged, the ids are not what re-encoding gives.

Its generations are Kimi's: the structural tokens and call ids come from the Kimi format module
(chat_format/kimi_k2.py), and a tokenizer without them is refused. Another family's stand-in
would write that family's structure the same way.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from eagle3_data.chat_format.kimi_k2 import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    IM_END,
    IM_MIDDLE,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    THINK_START,
    KimiK2Format,
)

ENGLISH = [
    "Let me think about what the user is asking.",
    "The question is about the difference between a list and a tuple.",
    "First, I should check the edge cases carefully.",
    "Okay, so the answer depends on the input size.",
    "I need to be careful with off-by-one errors here.",
    "The user probably wants a short, direct answer.",
    "There are two ways to approach this: iteratively or recursively.",
    "Hmm, wait. That isn't quite right; let me reconsider.",
    "The total is 42, which matches the expected value.",
    "Don't forget that it's O(n log n) in the worst case.",
    "NOR gates are functionally complete, as are NAND gates.",
    "Here's a concise summary of the main points.",
]
CODE = [
    "```python\ndef fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    "
    "return a\n```",
    '```bash\nfor f in *.txt; do\n  wc -l "$f"\ndone\n```',
    '```json\n{"name": "eagle", "layers": [1, 29, 57]}\n```',
    "```c\nint main(void) {\n\treturn 0;\n}\n```",
    '```python\nwith open(path, encoding="utf-8") as fh:\n    rows = [line.rstrip("\\r\\n") for line in fh]\n```',
]
CJK = [
    "这是一个简单的例子，用来说明这个问题。",
    "日本語のテキストも正しく処理する必要があります。",
    "한국어 문장도 포함되어 있습니다.",
    "答案是：四十二。🙂",
]
EDGES = ["\n\n", "  ", "\r\n", " \t", "…", "—", "🚀 ", "naïve café "]


@dataclass
class Segment:
    """A run of output ids with the role it plays in the parsed message."""

    kind: str  # reasoning | think_end | content | section_begin | call | section_end | stop
    ids: list[int]
    call: dict[str, Any] | None = None


@dataclass
class Generation:
    """One generation: the ids a Kimi server returns and the message its parsers would give."""

    output_ids: list[int]
    finish_reason: str  # stop | length
    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, ids KimiK2Format.call_id
    reasoning_tokens: int = 0
    noncanonical_splits: int = 0
    matched_stop: int | None = None


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class DevTextModel:
    """Deterministic generator over the real Kimi tokenizer (see module docstring)."""

    def __init__(self, tokenizer, noncanonical_rates: dict[str, float] | None = None, tool_call_rate: float = 0.7):
        self.tok = tokenizer
        self.rates = dict(noncanonical_rates or {})
        self.tool_call_rate = tool_call_rate
        ids = {
            name: tokenizer.convert_tokens_to_ids(name)
            for name in (
                THINK_END,
                THINK_START,
                IM_END,
                IM_MIDDLE,
                SECTION_BEGIN,
                SECTION_END,
                CALL_BEGIN,
                ARG_BEGIN,
                CALL_END,
            )
        }
        for name, i in ids.items():  # derive by name, verify both ways (FACTS.md: 163533 is "chas")
            if tokenizer.encode(name, add_special_tokens=False) != [i] or tokenizer.decode([i]) != name:
                raise RuntimeError(f"tokenizer does not round-trip special token {name!r} (id {i})")
        self.special = ids
        self._bytes_to_id: dict[bytes, int] | None = None
        self._id_to_bytes: dict[int, bytes] | None = None
        self._splits = 0

    # ---- prompt inspection -------------------------------------------------------------------
    def prompt_tools(self, prompt_ids: list[int]) -> list[dict[str, Any]]:
        """Tools declared in a rendered prompt (`tool_declare` system turn, compact JSON)."""
        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        m = re.search(f"tool_declare{re.escape(IM_MIDDLE)}(.*?){re.escape(IM_END)}", text, re.S)
        if not m:
            return []
        try:
            tools = json.loads(m.group(1))
        except json.JSONDecodeError:
            return []  # e.g. a TypeScript-style declaration: generate plain answers
        return [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]

    # ---- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        dataset: str | None = None,
    ) -> Generation:
        rng = _rng(prompt_ids, "greedy" if temperature == 0 else seed)
        thinking = prompt_ids[-1:] != [self.special[THINK_END]]  # an empty reasoning block = thinking off
        tools = self.prompt_tools(prompt_ids)
        call_index = prompt_ids.count(self.special[CALL_BEGIN])
        rate = self.rates.get(dataset or "", self.rates.get("default", 0.0))
        split_rng = _rng(prompt_ids, seed, "splits")
        self._splits = 0

        segments: list[Segment] = []
        if thinking:
            reasoning = " ".join(rng.sample(ENGLISH, rng.randint(1, 4)))
            if rng.random() < 0.3:
                reasoning += " " + rng.choice(CJK)
            segments.append(Segment("reasoning", self._encode(reasoning, rate, split_rng)))
            segments.append(Segment("think_end", [self.special[THINK_END]]))
        calls = self._tool_calls(rng, tools, call_index) if tools and rng.random() < self.tool_call_rate else []
        content = self._content(rng, short=bool(calls))
        if content:
            segments.append(Segment("content", self._encode(content, rate, split_rng)))
        if calls:
            segments.append(Segment("section_begin", [self.special[SECTION_BEGIN]]))
            for call in calls:
                ids = (
                    [self.special[CALL_BEGIN]]
                    + self._encode(call["id"], 0, split_rng)
                    + [self.special[ARG_BEGIN]]
                    + self._encode(call["function"]["arguments"], 0, split_rng)
                    + [self.special[CALL_END]]
                )
                segments.append(Segment("call", ids, call))
            segments.append(Segment("section_end", [self.special[SECTION_END]]))
        segments.append(Segment("stop", [self.special[IM_END]]))
        return self._truncate(segments, max_new_tokens)

    def _content(self, rng: random.Random, short: bool) -> str:
        if short:
            return rng.choice(["", "", "I'll look that up.", "Let me call the tool."])
        parts = [rng.choice(ENGLISH)]
        for _ in range(rng.randint(0, 3)):
            parts.append(rng.choice([rng.choice(ENGLISH), rng.choice(CODE), rng.choice(CJK)]))
        text = "\n\n".join(parts)
        if rng.random() < 0.25:
            text = rng.choice(EDGES) + text
        if rng.random() < 0.25:
            text += rng.choice(EDGES)
        return text

    def _tool_calls(self, rng: random.Random, tools: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
        calls = []
        for k in range(rng.randint(1, min(2, len(tools)))):
            fn = rng.choice(tools)["function"]
            props = (fn.get("parameters") or {}).get("properties") or {}
            args = {name: _value(rng, spec) for name, spec in props.items()}
            calls.append(
                {
                    "id": KimiK2Format.call_id(fn["name"], start + k),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
        return calls

    def _encode(self, text: str, rate: float, rng: random.Random) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        if rate <= 0:
            return ids
        out: list[int] = []
        for i in ids:
            pair = self._split(i) if rng.random() < rate else None
            out.extend(pair or [i])
            self._splits += pair is not None
        return out

    def _split(self, token_id: int) -> list[int] | None:
        """Two valid ids whose bytes concatenate to `token_id`'s bytes, or None."""
        if self._bytes_to_id is None:
            alphabet = _byte_decoder()
            self._id_to_bytes = {}
            for tok, i in self.tok.get_vocab().items():
                try:
                    self._id_to_bytes[i] = bytes(alphabet[c] for c in tok)
                except KeyError:
                    continue  # special tokens
            self._bytes_to_id = {b: i for i, b in self._id_to_bytes.items()}
        b = self._id_to_bytes.get(token_id, b"")
        for k in range(1, len(b)):
            left, right = self._bytes_to_id.get(b[:k]), self._bytes_to_id.get(b[k:])
            if left is not None and right is not None:
                return [left, right]
        return None

    def _truncate(self, segments: list[Segment], max_new_tokens: int) -> Generation:
        """Cut at `max_new_tokens` and parse what is left as SGLang's kimi_k2 parsers would."""
        out: list[int] = []
        reasoning_ids: list[int] = []
        content_ids: list[int] = []
        calls: list[dict[str, Any]] = []
        thinking = any(s.kind == "reasoning" for s in segments)
        think_closed = not thinking
        finish, matched = "stop", None
        for seg in segments:
            room = max_new_tokens - len(out)
            if room <= 0:
                finish = "length"
                break
            take = seg.ids[:room]
            out.extend(take)
            complete = len(take) == len(seg.ids)
            if seg.kind == "reasoning":
                reasoning_ids = take
            elif seg.kind == "think_end":
                think_closed = True
            elif seg.kind == "content":
                content_ids = take
            elif seg.kind == "call" and complete:
                calls.append(seg.call)
            elif seg.kind == "stop":
                matched = seg.ids[0]
            if not complete:
                finish = "length"
                break
        reasoning = self.tok.decode(reasoning_ids) if thinking else None
        content = self.tok.decode(content_ids)
        if thinking and not think_closed and finish == "length":
            content = ""  # stopped inside reasoning: everything so far is reasoning
        return Generation(
            output_ids=out,
            finish_reason=finish,
            reasoning=reasoning,
            content=content,
            tool_calls=calls,
            reasoning_tokens=len(reasoning_ids),
            noncanonical_splits=self._splits,
            matched_stop=matched,
        )


def _value(rng: random.Random, spec: dict[str, Any]) -> object:
    if spec.get("enum"):
        return rng.choice(spec["enum"])
    kind = spec.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "number":
        return round(rng.uniform(-50, 50), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value(rng, spec.get("items") or {}) for _ in range(rng.randint(1, 2))]
    if kind == "object":
        return {k: _value(rng, v) for k, v in (spec.get("properties") or {}).items()}
    return rng.choice(["Paris", "東京", "São Paulo", 'the "quoted" one', "a\\b path", "New York"])


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet (char -> byte), the mapping the Kimi BPE vocabulary uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
