"""A seeded stand-in for the target's sampler: generations in the target family's format, as real token ids.

The dev inference server needs outputs that exercise everything the pipeline must get right
(reasoning, its end token, content with code/CJK/whitespace edges, tool calls with valid JSON
arguments, the stop token, length truncation and non-canonical BPE splits) while staying fully
deterministic, so tests and validation have a ground truth. Text is picked from a small corpus by
an RNG seeded from the prompt ids (and the sampling seed unless temperature is 0); ids come from
the real tokenizer, piece by piece between special tokens, which equals encoding the rendered text
in one go. Non-canonical splits replace one multi-byte token by two valid tokens whose bytes
concatenate to it: the text is unchanged, the ids are not what re-encoding gives.

The structure is the family's own: the message (reasoning, content, tool calls) goes through the
output format's `render_parts` (chat_format/), which the tokenizer's special tokens pick, so
Kimi's and Qwen3's generations come from this one code path; the prompt's tools and history
calls are read back by the format too (`prompt_tools`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any

from eagle3_data.chat_format import AssistantMessage, OutputFormat, ToolCall, get_output_format

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

    kind: str  # reasoning | think_end | content | structure (tool calls, a reasoning opener) | stop
    ids: list[int]
    call: dict[str, Any] | None = None


@dataclass
class Generation:
    """One generation: the ids the target's server returns and the message its parsers would give."""

    output_ids: list[int]
    finish_reason: str  # stop | length
    reasoning: str | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, ids the format's call_id
    reasoning_tokens: int = 0
    noncanonical_splits: int = 0
    matched_stop: int | None = None


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class DevTextModel:
    """Deterministic generator over the target's real tokenizer (see module docstring)."""

    def __init__(self, tokenizer, noncanonical_rates: dict[str, float] | None = None, tool_call_rate: float = 0.7):
        self.tok = tokenizer
        self.rates = dict(noncanonical_rates or {})
        self.tool_call_rate = tool_call_rate
        # the family the tokenizer's special tokens say (one without a known format is refused)
        self.formats = {mode: get_output_format(tokenizer, thinking=mode) for mode in (True, False)}
        for name, i in self.formats[True].special_ids.items():  # verify both ways (FACTS.md: 163533 is "chas")
            if tokenizer.encode(name, add_special_tokens=False) != [i] or tokenizer.decode([i]) != name:
                raise RuntimeError(f"tokenizer does not round-trip special token {name!r} (id {i})")
        self._bytes_to_id: dict[bytes, int] | None = None
        self._id_to_bytes: dict[int, bytes] | None = None
        self._splits = 0

    # ---- prompt inspection -------------------------------------------------------------------
    def prompt_format(self, prompt_ids: list[int]) -> OutputFormat:
        """The format in the prompt's mode: a reasoning end among the generation prompt's last
        two ids closes an empty reasoning block, thinking off (Kimi's prompt ends on it, Qwen3's
        one token after it)."""
        off = self.formats[False].reasoning_end_id in prompt_ids[-2:]
        return self.formats[not off]

    def prompt_tools(self, prompt_ids: list[int]) -> list[dict[str, Any]]:
        """Tools declared in a rendered prompt (the format reads its own declaration)."""
        return self.formats[True].prompt_tools(prompt_ids)[0]

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
        fmt = self.prompt_format(prompt_ids)
        tools, call_index = fmt.prompt_tools(prompt_ids)
        rate = self.rates.get(dataset or "", self.rates.get("default", 0.0))
        split_rng = _rng(prompt_ids, seed, "splits")
        self._splits = 0

        reasoning = None
        if fmt.thinking:
            reasoning = " ".join(rng.sample(ENGLISH, rng.randint(1, 4)))
            if rng.random() < 0.3:
                reasoning += " " + rng.choice(CJK)
        calls = self._tool_calls(rng, fmt, tools, call_index) if tools and rng.random() < self.tool_call_rate else []
        content = self._content(rng, short=bool(calls))
        message = AssistantMessage(
            reasoning=reasoning, content=content, tool_calls=[ToolCall.from_openai(c) for c in calls]
        )
        segments = self._segments(fmt, fmt.render_parts(message, "stop", call_index), rate, split_rng)
        return self._truncate(fmt, segments, tools, call_index, max_new_tokens)

    def _segments(self, fmt: OutputFormat, parts: list, rate: float, split_rng: random.Random) -> list[Segment]:
        """The rendered parts as runs of ids by role: reasoning up to the reasoning end, content up
        to the tool section, the section as structure (its text canonical), the stop token. Text
        between two structural ids is encoded in one go (what a model's BPE writes)."""
        merged: list[str | int] = []
        for part in parts:
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            else:
                merged.append(part)
        segments: list[Segment] = []
        phase = "reasoning" if fmt.thinking else "content"
        for k, part in enumerate(merged):
            if isinstance(part, int):
                if part == fmt.reasoning_end_id and phase == "reasoning":
                    segments.append(Segment("think_end", [part]))
                    phase = "content"
                    continue
                if k == len(merged) - 1 and part in fmt.stop_token_ids:
                    segments.append(Segment("stop", [part]))
                    continue
                if part == fmt.tool_section_id:
                    phase = "tools"
                segments.append(Segment("structure", [part]))
            elif part:
                text_rate = rate if phase in ("reasoning", "content") else 0
                kind = phase if phase != "tools" else "structure"
                segments.append(Segment(kind, self._encode(part, text_rate, split_rng)))
        return segments

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

    def _tool_calls(
        self, rng: random.Random, fmt: OutputFormat, tools: list[dict[str, Any]], start: int
    ) -> list[dict[str, Any]]:
        calls = []
        for k in range(rng.randint(1, min(2, len(tools)))):
            fn = rng.choice(tools)["function"]
            props = (fn.get("parameters") or {}).get("properties") or {}
            args = {name: _value(rng, spec) for name, spec in props.items()}
            calls.append(
                {
                    "id": fmt.call_id(fn["name"], start + k),
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

    def _truncate(
        self,
        fmt: OutputFormat,
        segments: list[Segment],
        tools: list[dict[str, Any]],
        call_index: int,
        max_new_tokens: int,
    ) -> Generation:
        """Cut at `max_new_tokens` and split what is left as the server's parsers would (the
        format's `provider_view`, checked against them)."""
        out: list[int] = []
        reasoning_tokens = 0
        finish, matched = "stop", None
        for seg in segments:
            room = max_new_tokens - len(out)
            if room <= 0:
                finish = "length"
                break
            take = seg.ids[:room]
            out.extend(take)
            if seg.kind == "reasoning":
                reasoning_tokens = len(take)
            elif seg.kind == "stop":
                matched = seg.ids[0]
            if len(take) < len(seg.ids):
                finish = "length"
                break
        view = fmt.provider_view(out, finish, tools, call_index).message
        return Generation(
            output_ids=out,
            finish_reason=finish,
            reasoning=view.get("reasoning_content") if fmt.thinking else None,
            content=view.get("content") or "",
            tool_calls=view.get("tool_calls") or [],
            reasoning_tokens=reasoning_tokens,
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
    """GPT-2 byte-level alphabet (char -> byte), the mapping Kimi's and Qwen3's BPE vocabularies use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
