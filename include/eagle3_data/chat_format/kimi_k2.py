"""Kimi-K2 family (K2, K2-Thinking, K2.5, K2.6): everything Kimi-specific lives here.

A generation is `{reasoning}</think>{content}[tool section]<|im_end|>`; the tool section is
`<|tool_calls_section_begin|>` + per call `<|tool_call_begin|>functions.{name}:{idx}
<|tool_call_argument_begin|>{json}<|tool_call_end|>` + `<|tool_calls_section_end|>`, `idx`
counting calls across the whole conversation.

Two splits of generated ids: `parse_ids` is lossless (by id; parse -> render reproduces the ids)
and fills the local generation rows; `provider_view` is what an OpenAI-compatible server returns,
text-based exactly as SGLang 0.5.23's kimi_k2 reasoning parser and tool-call detector do it (and
checked against them in tests/unit/test_sglang_oracle.py): a leading `<think>` is stripped, the
first `</think>` *text* ends reasoning (else `<|tool_calls_section_begin|>` does), calls come from
a regex that drops whitespace around ids and arguments and anything that is not `{...}`, and the
content is the text before the section. The validation gate rebuilds that view.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from eagle3_data.chat_format.base import (
    AssistantMessage,
    OutputFormat,
    ParsedGeneration,
    Part,
    ProviderView,
    ToolCall,
    normalize_finish_reason,
)
from eagle3_data.codec import (
    Codec,
    HFCodec,
    TiktokenCodec,
    TiktokenTokenizer,
    check_token,
    codecs_agree,
    tiktoken_encoding,
)
from eagle3_data.errors import UserError
from eagle3_data.images import expand_media

# Moonshot's pre-tokenizer split (tokenization_kimi.py; splintr.KIMI_PATTERN).
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

THINK_END = "</think>"
IM_END = "<|im_end|>"
IM_MIDDLE = "<|im_middle|>"
EOS = "[EOS]"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

THINK_START = "<think>"
MEDIA_PAD = "<|media_pad|>"
CUT_AFTER_THINK_END = "cut right after </think>: the answer does not show it"

# SGLang's kimi_k2 tool-call id: `functions.{name}:{idx}` (the prefix is optional there too).
_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+):(?P<idx>\d+)\s*$")

# SGLang 0.5.23 KimiK2Detector's regexes (function_call/kimik2_detector.py), whitespace captured
# so the view can say what they drop; the groups do not change what matches.
_SGL_CALL = re.compile(
    r"<\|tool_call_begin\|>(?P<ws1>\s*)(?P<id>[^\s<|]+)(?P<ws2>\s*)<\|tool_call_argument_begin\|>"
    r"(?P<ws3>\s*)(?P<args>\{.*?\})(?P<ws4>\s*)<\|tool_call_end\|>",
    re.DOTALL,
)
_SGL_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
_SGL_COUNTER = re.compile(r"^\d+$")


class KimiK2Format(OutputFormat):
    name = "kimi_k2"
    stop_token = IM_END
    structural_tokens = (
        THINK_START,
        THINK_END,
        IM_END,
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        IM_MIDDLE,
        SECTION_BEGIN,
        SECTION_END,
        CALL_BEGIN,
        ARG_BEGIN,
        CALL_END,
    )

    # Moonshot's published ids (tokenizer_config.json `added_tokens_decoder`), audited by name
    reference_ids: ClassVar[dict[str, int]] = {
        "[BOS]": 163584,
        EOS: 163585,
        IM_END: 163586,
        "<|im_user|>": 163587,
        "<|im_assistant|>": 163588,
        "<|im_system|>": 163594,
        SECTION_BEGIN: 163595,
        SECTION_END: 163596,
        CALL_BEGIN: 163597,
        ARG_BEGIN: 163598,
        CALL_END: 163599,
        IM_MIDDLE: 163601,
        THINK_START: 163606,
        THINK_END: 163607,
    }
    media_pad = MEDIA_PAD
    vllm_reasoning_parser = vllm_tool_parser = "kimi_k2"
    sglang_reasoning_parser = sglang_tool_parser = "kimi_k2"

    pattern = KIMI_PATTERN

    def __init__(self, tokenizer: Any, *, thinking: bool, codec: Codec | None = None):
        ids = self._bind(tokenizer, thinking)
        added = tokenizer.get_added_vocab()
        eos = added.get(EOS)
        self.stop_token_ids = [ids[IM_END]] + ([eos] if eos is not None and eos != ids[IM_END] else [])
        self.vocab_size = len(tokenizer)
        self.all_special_names = tuple(added)
        self._think_end = self.reasoning_end_id = ids[THINK_END]
        self.tool_section_id = ids[SECTION_BEGIN]
        self._section_begin, self._section_end = ids[SECTION_BEGIN], ids[SECTION_END]
        self._call_begin, self._arg_begin, self._call_end = ids[CALL_BEGIN], ids[ARG_BEGIN], ids[CALL_END]
        self.codec: Codec = codec or self._fast_codec() or HFCodec(tokenizer)

    def _fast_codec(self) -> TiktokenCodec | None:
        """tiktoken over the directory's `tiktoken.model`, used only if it agrees with the HF tokenizer."""
        import tiktoken

        encoding = getattr(self.tokenizer, "model", None)  # Moonshot's remote code and ours wrap one
        if isinstance(self.tokenizer, TiktokenTokenizer):
            return TiktokenCodec(encoding)  # already verified against the HF tokenizer of these files
        if not isinstance(encoding, tiktoken.Encoding):
            vocab_file = Path(self.tokenizer.name_or_path or "") / "tiktoken.model"
            if not vocab_file.is_file():
                return None
            encoding = tiktoken_encoding(vocab_file, KIMI_PATTERN, self.tokenizer.get_added_vocab())
        codec = TiktokenCodec(encoding)
        specials = list(self.tokenizer.get_added_vocab())
        if codecs_agree(codec, HFCodec(self.tokenizer), len(self.tokenizer), specials) is not None:
            return None
        return codec

    # ------------------------------------------------------------------ render

    def render_parts(self, message: AssistantMessage, finish_reason: str, tool_call_index_start: int = 0) -> list[Part]:
        finish = normalize_finish_reason(finish_reason)
        ids = self.special_ids
        parts: list[Part] = []
        if self.thinking:
            closed = message.reasoning_closed
            if closed is None:
                has_more = bool(message.content) or bool(message.tool_calls) or message.tool_tail is not None
                closed = finish == "stop" or has_more
            parts.append(message.reasoning or "")
            if closed:
                parts.append(ids[THINK_END])
        elif message.reasoning:
            raise UserError("message has reasoning but thinking is off: nothing in the format can carry it")
        parts.append(message.content or "")
        if message.tool_calls or message.tool_tail is not None:
            parts.append(ids[SECTION_BEGIN])
            for offset, call in enumerate(message.tool_calls):
                call_id = self.call_id(call.name, tool_call_index_start + offset)
                parts += [ids[CALL_BEGIN], call_id, ids[ARG_BEGIN], call.arguments, ids[CALL_END]]
            if message.tool_tail is not None:
                parts += self._tail_parts(message.tool_tail)
            else:
                parts.append(ids[SECTION_END])
        if finish == "stop":
            parts.append(ids[IM_END])
        return parts

    def _tail_parts(self, tail: str) -> list[Part]:
        """A lossless parse's raw section tail: its structural names are structure (they came
        from ids), the rest text."""
        names = {name: tid for name, tid in self.special_ids.items()}
        pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", tail)
        return [names.get(p, p) for p in pieces if p]

    # ------------------------------------------------------------------ lossless parse

    def parse_ids(self, ids: list[int], finish_reason: str | None = None) -> ParsedGeneration:
        ids = list(ids)
        stop_id = ids.pop() if ids and ids[-1] in self.stop_token_ids else None
        if stop_id is not None:
            finish = "stop"
        else:
            finish = normalize_finish_reason(finish_reason) if finish_reason is not None else "length"
        decode = self.codec.decode
        msg = AssistantMessage()
        rest = ids
        if self.thinking:
            end = _index(ids, self._think_end)
            section = _index(ids, self._section_begin)
            if end is not None and (section is None or end < section):
                msg.reasoning, msg.reasoning_closed, rest = decode(ids[:end]), True, ids[end + 1 :]
            else:
                cut = section if section is not None else len(ids)
                msg.reasoning, msg.reasoning_closed, rest = decode(ids[:cut]), False, ids[cut:]
        section = _index(rest, self._section_begin)
        if msg.reasoning_closed is not False or rest[:section]:
            msg.content = decode(rest if section is None else rest[:section])
        first_index = None
        if section is not None:
            msg.tool_calls, msg.tool_tail, first_index = self._parse_section(rest[section + 1 :])
        return ParsedGeneration(msg, finish, stop_id, first_index)

    def _parse_section(self, ids: list[int]) -> tuple[list[ToolCall], str | None, int | None]:
        """Well-formed calls, then the raw rest if the section is cut or malformed (else None)."""
        decode = self.codec.decode
        calls: list[ToolCall] = []
        first_index = None
        pos = 0
        while pos < len(ids) and ids[pos] == self._call_begin:
            arg = _index(ids, self._arg_begin, pos + 1)
            end = _index(ids, self._call_end, pos + 1)
            if arg is None or end is None or end < arg:
                break
            head = ids[pos + 1 : arg]
            if any(i in (self._call_begin, self._section_end) for i in head):
                break
            raw_id = decode(head)
            match = _CALL_ID.match(raw_id)
            name = match["name"] if match else raw_id
            if match and first_index is None and not calls:
                first_index = int(match["idx"])
            calls.append(ToolCall(id=raw_id, name=name, arguments=decode(ids[arg + 1 : end])))
            pos = end + 1
        if ids[pos:] == [self._section_end]:
            return calls, None, first_index
        return calls, decode(ids[pos:]), first_index

    # ------------------------------------------------------------------ the provider's view

    def provider_view(
        self,
        ids: list[int],
        finish_reason: str,
        tools: list[dict[str, Any]] | None,
        history_tool_calls: int | None = None,
    ) -> ProviderView:
        finish, text = self._served_text(ids, finish_reason)
        notes: list[str] = []
        reasoning, normal = split_reasoning(text, force_reasoning=self.thinking, notes=notes)
        if reasoning is not None and not self.thinking:
            notes.append("reasoning opened with <think> although thinking is off")
        hides_last = None
        if finish == "length" and reasoning is not None and normal == "" and text.endswith(THINK_END):
            hides_last = CUT_AFTER_THINK_END
        content, calls, start = normal, [], 0
        offered = tools is None or bool(tools)
        if SECTION_BEGIN in normal:
            if offered:
                content, calls, start = self._split_tools(normal, tools, notes, history_tool_calls)
            else:
                notes.append("tool section generated with no tools offered: returned as content text")
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [
                {"id": self.call_id(name, start + i), "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(calls)
            ]
        out_finish = "length" if finish == "length" else ("tool_calls" if calls else "stop")
        return ProviderView(message, out_finish, notes, start, text, hides_last)

    def _split_tools(
        self, normal: str, tools: list[dict[str, Any]] | None, notes: list[str], history: int | None
    ) -> tuple[str, list[tuple[str, str]], int]:
        """SGLang's `detect_and_parse`: calls by regex over the whole text, content = text before
        the section. Returns content, [(name, arguments)], and the index the returned ids start
        from: SGLang's serving_chat numbers them `functions.{name}:{history + i}` (history: the
        request's earlier assistant tool calls, `_get_history_tool_calls_cnt`), whatever index
        the model wrote; unknown history: the model's own first index."""
        bot = normal.find(SECTION_BEGIN)
        calls: list[tuple[str, str]] = []
        start: int | None = None
        pos = bot + len(SECTION_BEGIN)
        for m in _SGL_CALL.finditer(normal):
            if m.start() < bot:
                notes.append("tool call text before the tool section")
            elif normal[pos : m.start()]:
                gap = normal[pos : m.start()]
                notes.append(
                    "call dropped by the tool parser" if CALL_BEGIN in gap else "text between tool calls dropped"
                )
            pos = max(pos, m.end())
            if any(m[g] for g in ("ws1", "ws2", "ws3", "ws4")):
                notes.append("whitespace around a tool-call id or arguments dropped")
            name, index = _call_name(m["id"], tools, m["args"])
            if name is None:
                notes.append(f"tool call id {m['id']!r} not understood: call dropped")
                continue
            if start is None:
                start = history if history is not None else (index if index is not None else 0)
            if m["id"] != self.call_id(name, start + len(calls)):
                notes.append(f"tool call id {m['id']!r} rewritten by the server")
            try:
                json.loads(m["args"])
            except ValueError:
                notes.append("tool call arguments are not valid JSON")
            calls.append((name, m["args"]))
        tail = normal[pos:]
        if tail != SECTION_END:
            if CALL_BEGIN in tail:
                notes.append("call dropped by the tool parser")
            elif tail.startswith(SECTION_END):
                notes.append("text after the tool section dropped")
            else:
                notes.append("tool section not closed: its tail is dropped")
        return normal[:bot], calls, start or 0

    # ------------------------------------------------------------------ prompts

    def tool_call_index_start(self, messages: list[dict[str, Any]]) -> int:
        return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")

    def prompt_tools(self, prompt_ids: list[int]) -> tuple[list[dict[str, Any]], int]:
        """The `tool_declare` system turn's tools (compact JSON; a TypeScript-style declaration
        gives none), and the history's calls counted by their `<|tool_call_begin|>` ids."""
        text = self.codec.decode(prompt_ids)
        history_calls = prompt_ids.count(self._call_begin)
        m = re.search(f"tool_declare{re.escape(IM_MIDDLE)}(.*?){re.escape(IM_END)}", text, re.S)
        if not m:
            return [], history_calls
        try:
            tools = json.loads(m.group(1))
        except json.JSONDecodeError:
            return [], history_calls
        return [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)], history_calls

    @staticmethod
    def call_id(name: str, index: int) -> str:
        """`functions.{name}:{index}`: Kimi's template writes a call's id where the function's name
        would be, and SGLang's and vLLM's kimi_k2 parsers read the name back from it."""
        return f"functions.{name}:{index}"

    def generation_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        images: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, thinking=self.thinking
        )
        ids = self.codec.encode_batch([text])[0]
        return expand_media(ids, images, self.media_pad_id) if images else ids

    @cached_property
    def media_pad_id(self) -> int:
        """`<|media_pad|>`'s id: the placeholder the template renders once per image."""
        tid, problems = check_token(self.tokenizer, MEDIA_PAD)
        if problems:
            raise UserError(f"tokenizer {self.tokenizer.name_or_path}: " + "; ".join(problems))
        return tid


def split_reasoning(text: str, *, force_reasoning: bool, notes: list[str] | None = None) -> tuple[str | None, str]:
    """SGLang 0.5.23 KimiK2Detector.detect_and_parse (reasoning_parser.py): (reasoning, normal text)."""
    notes = notes if notes is not None else []
    if not (force_reasoning or THINK_START in text):
        return None, text
    processed = text
    if processed.startswith(THINK_START):
        notes.append("leading <think> stripped by the reasoning parser")
    while processed.startswith(THINK_START):
        processed = processed[len(THINK_START) :]
    if THINK_END not in processed:
        idx = processed.find(SECTION_BEGIN)
        if idx != -1:
            notes.append("reasoning ended by the tool section without </think>: the rebuild inserts one")
            return processed[:idx], processed[idx:]
        return processed, ""
    reasoning, normal = processed.split(THINK_END, 1)
    return reasoning, normal


def _call_name(call_id: str, tools: list[dict[str, Any]] | None, args: str) -> tuple[str | None, int | None]:
    """SGLang's `_parse_tool_call_id`: `functions.name:idx`, or a bare counter whose name is
    inferred from the offered tools (one tool: it; several: the best key overlap)."""
    m = _SGL_ID.match(call_id)
    if m:
        return m["name"], int(m["index"])
    if not _SGL_COUNTER.match(call_id):
        return None, None
    index = int(call_id)
    fns = [(t.get("function") or {}) for t in tools or []]
    if len(fns) == 1:
        return fns[0].get("name"), index
    try:
        keys = set(json.loads(args))
    except (ValueError, TypeError):
        return None, index
    best, best_score = None, -1
    for fn in fns:
        props = set(((fn.get("parameters") or {}).get("properties") or {}))
        if not props:
            continue
        score = len(keys & props) - len(keys - props)
        if score > best_score:
            best, best_score = fn.get("name"), score
    return best, index


def _index(ids: list[int], value: int, start: int = 0) -> int | None:
    try:
        return ids.index(value, start)
    except ValueError:
        return None
