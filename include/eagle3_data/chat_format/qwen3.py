"""Qwen3 family (the hybrid-thinking Qwen3 models: Qwen3-0.6B ... Qwen3-235B-A22B): everything
Qwen3-specific lives here.

The prompt side is Qwen3's published chat template, packaged beside this module
(`qwen3_chat_template.jinja`: the `chat_template` of Qwen/Qwen3-0.6B's tokenizer_config.json, also
llama.cpp's `models/templates/Qwen-Qwen3-0.6B.jinja`). It declares tools in the system turn,
returns tool results inside a user turn as `<tool_response>\\n...\\n</tool_response>`, drops the
reasoning of assistant turns before the last real user query, and with `enable_thinking=false`
ends the generation prompt with an empty `<think>\\n\\n</think>\\n\\n`. Not covered: the 2507
"Thinking" models (their prompt already opens `<think>`) and Qwen3-Coder (XML tool calls).

A generation, as that template writes an assistant turn, is (thinking on)
`<think>\\n{reasoning}\\n</think>\\n\\n{content}` + per call (after a `\\n` when something precedes
it) `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` + `<|im_end|>`; thinking off,
the same without the reasoning block (the prompt holds it). Call ids are never rendered.

Qwen3's tag tokens (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, ...)
are added tokens that are NOT special: text that contains one encodes to its id, ordinary encode
included. So a literal `<think>` in an answer cannot be told from structure: a rebuild of that
text gives the tag's id, whichever ids the model wrote. Only the special tokens (`<|im_end|>`,
`<|im_start|>`, ...) stay ordinary text in model-produced strings.

Two splits of generated ids, as for Kimi: `parse_ids` is by id (lossless for every generation
whose whitespace around the tags is the template's; see `_reasoning_text`), `provider_view` is
text-based, exactly as vLLM 0.32's `qwen3` reasoning parser and `hermes` tool parser do it (the
pair vLLM serves Qwen3 with; checked against them in tests/unit/test_qwen3_oracles.py): reasoning
is the raw text up to the first `</think>` (a leading `<think>` and any `<think>` inside dropped,
a `<tool_call>` ends it implicitly), content is the raw text after it (further `</think>` dropped),
calls are every `<tool_call>...</tool_call>` whose body is JSON, arguments re-serialised, and the
content is cut at the first `<tool_call>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from eagle3_data.chat_format.base import (
    AssistantMessage,
    FinishReason,
    OutputFormat,
    ParsedGeneration,
    Part,
    ProviderView,
    ToolCall,
    normalize_finish_reason,
)
from eagle3_data.codec import Codec, HFCodec
from eagle3_data.errors import UserError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
RESPONSE_BEGIN = "<tool_response>"
RESPONSE_END = "</tool_response>"

# Qwen3's published ids (tokenizer_config.json `added_tokens_decoder`): what the tokenizer audit
# expects of a Qwen3 tokenizer, written out so a wrong tokenizer cannot vouch for itself.
REFERENCE_IDS: dict[str, int] = {
    ENDOFTEXT: 151643,
    IM_START: 151644,
    IM_END: 151645,
    CALL_BEGIN: 151657,
    CALL_END: 151658,
    RESPONSE_BEGIN: 151665,
    RESPONSE_END: 151666,
    THINK_START: 151667,
    THINK_END: 151668,
}

NO_IMAGES = "Qwen3 is a text model: its template has no image placeholder"
CUT_AFTER_THINK_END = "cut right after </think>: the answer does not show it"

# The template's call body: `\n{"name": "NAME", "arguments": ARGS}\n` (ARGS as generated).
_CALL_BODY = re.compile(r'\n\{"name": "(?P<name>[^"\n]*)", "arguments": (?P<args>.*)\}\n', re.DOTALL)
# vLLM's Hermes2ProToolParser.tool_call_regex: closed calls, or an unclosed last one.
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class Qwen3Format(OutputFormat):
    name = "qwen3"
    stop_token = IM_END
    structural_tokens = (IM_START, IM_END, THINK_START, THINK_END, CALL_BEGIN, CALL_END, RESPONSE_BEGIN, RESPONSE_END)
    reference_ids = REFERENCE_IDS
    vllm_reasoning_parser, vllm_tool_parser = "qwen3", "hermes"
    sglang_reasoning_parser, sglang_tool_parser = "qwen3", "qwen25"
    pattern = None  # Qwen2's tokenizer normalises to NFC first: no tiktoken fast path equals it

    def __init__(self, tokenizer: Any, *, thinking: bool, codec: Codec | None = None):
        ids = self._bind(tokenizer, thinking)
        added = tokenizer.get_added_vocab()
        # generation_config.json stops on both: <|im_end|> ends a turn, <|endoftext|> a document
        eot = added.get(ENDOFTEXT)
        self.stop_token_ids = [ids[IM_END]] + ([eot] if eot is not None else [])
        self.vocab_size = len(tokenizer)
        self.all_special_names = tuple(added)
        self.reasoning_end_id = ids[THINK_END]
        self.tool_section_id = ids[CALL_BEGIN]
        self._think, self._think_end = ids[THINK_START], ids[THINK_END]
        self._call_begin, self._call_end = ids[CALL_BEGIN], ids[CALL_END]
        self.codec: Codec = codec or HFCodec(tokenizer)

    # ------------------------------------------------------------------ render

    def render_parts(self, message: AssistantMessage, finish_reason: str, tool_call_index_start: int = 0) -> list[Part]:
        """The template's assistant turn for `message`. Reasoning and content are taken either raw
        (as `parse_ids` and vLLM's parsers return them, wrapper newlines included) or stripped (as
        other providers return them): a missing wrapper newline is added, one present is kept."""
        finish = normalize_finish_reason(finish_reason)
        parts: list[Part] = []
        content = message.content or ""
        if self.thinking:
            closed = message.reasoning_closed
            if closed is None:
                has_more = bool(message.content) or bool(message.tool_calls) or message.tool_tail is not None
                closed = finish == "stop" or has_more
            parts += [self._think, _reasoning_text(message.reasoning or "", closed)]
            if closed:
                parts.append(self._think_end)
                content = content if content.startswith("\n\n") else "\n\n" + content
        elif message.reasoning:
            raise UserError("message has reasoning but thinking is off: nothing in the format can carry it")
        parts.append(content)
        if message.tool_calls or message.tool_tail is not None:
            if content.strip("\n") and not content.endswith("\n"):
                parts.append("\n")
            for offset, call in enumerate(message.tool_calls):
                if offset:
                    parts.append("\n")
                body = f'\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n'
                parts += [self._call_begin, body, self._call_end]
            if message.tool_tail is not None:
                parts.append(message.tool_tail)  # its tag names encode to their ids (not special)
        if finish == "stop":
            parts.append(self.special_ids[IM_END])
        return parts

    # ------------------------------------------------------------------ lossless parse

    def parse_ids(self, ids: list[int], finish_reason: str | None = None) -> ParsedGeneration:
        ids = list(ids)
        stop_id = ids.pop() if ids and ids[-1] in self.stop_token_ids else None
        finish: FinishReason
        if stop_id is not None:
            finish = "stop"
        else:
            finish = normalize_finish_reason(finish_reason) if finish_reason is not None else "length"
        decode = self.codec.decode
        msg = AssistantMessage()
        rest = ids
        if self.thinking:
            body = ids[1:] if ids[:1] == [self._think] else ids
            end = _index(body, self._think_end)
            call = _index(body, self._call_begin)
            if end is not None and (call is None or end < call):
                msg.reasoning, msg.reasoning_closed, rest = decode(body[:end]), True, body[end + 1 :]
            else:
                cut = call if call is not None else len(body)
                msg.reasoning, msg.reasoning_closed, rest = decode(body[:cut]), False, body[cut:]
        call = _index(rest, self._call_begin)
        if msg.reasoning_closed is not False or rest[:call]:
            msg.content = decode(rest if call is None else rest[:call])
        if call is not None:
            msg.tool_calls, msg.tool_tail = self._parse_calls(rest[call:])
        return ParsedGeneration(msg, finish, stop_id, None)  # Qwen3 writes no call index

    def _parse_calls(self, ids: list[int]) -> tuple[list[ToolCall], str | None]:
        """Calls written exactly as the template writes them, `\\n` between; then the raw rest
        (a cut or malformed call, text after the calls), else None."""
        decode = self.codec.decode
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(ids):
            start = pos
            if calls:
                newline = _index(ids, self._call_begin, pos)
                if newline is None or decode(ids[pos:newline]) != "\n":
                    break
                start = newline
            if ids[start] != self._call_begin:
                break
            end = _index(ids, self._call_end, start + 1)
            if end is None or self._call_begin in ids[start + 1 : end]:
                break
            match = _CALL_BODY.fullmatch(decode(ids[start + 1 : end]))
            if match is None:
                break
            name = match["name"]
            calls.append(ToolCall(id=self.call_id(name, len(calls)), name=name, arguments=match["args"]))
            pos = end + 1
        return calls, (decode(ids[pos:]) if pos < len(ids) else None)

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
        if self.thinking:
            reasoning, content = split_reasoning(text, notes)
        else:
            reasoning, content = None, text
        hides_last = None
        if finish == "length" and reasoning is not None and content is None and text.endswith(THINK_END):
            hides_last = CUT_AFTER_THINK_END
        calls: list[tuple[str, str]] = []
        offered = tools is None or bool(tools)
        # Calls the server does not parse (none offered, or not JSON) stay content text: the tag
        # tokens are not special, so that text rebuilds to the same ids and needs no note.
        if offered and content is not None and CALL_BEGIN in content:
            content, calls = _hermes_calls(content, notes)
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        message["reasoning_content"] = reasoning or None
        start = history_tool_calls or 0
        if calls:
            message["tool_calls"] = [
                {"id": self.call_id(name, start + i), "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(calls)
            ]
        out_finish = "length" if finish == "length" else ("tool_calls" if calls else "stop")
        return ProviderView(message, out_finish, notes, start, text, hides_last)

    # ------------------------------------------------------------------ prompts

    def tool_call_index_start(self, messages: list[dict[str, Any]]) -> int:
        return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")

    def prompt_tools(self, prompt_ids: list[int]) -> tuple[list[dict[str, Any]], int]:
        """The system turn's `<tools>` block (one JSON tool a line), and the history's calls: the
        `<tool_call>` ids after the system turn, whose instructions write the tag once themselves."""
        text = self.codec.decode(prompt_ids)
        m = re.search(r"<tools>\n(.*?)\n</tools>", text, re.S)
        tools: list[dict[str, Any]] = []
        for line in m.group(1).splitlines() if m else ():
            try:
                tool = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
                tools.append(tool)
        end = self.special_ids[IM_END]
        history = prompt_ids[prompt_ids.index(end) + 1 :] if m and end in prompt_ids else prompt_ids
        return tools, history.count(self._call_begin)

    @staticmethod
    def call_id(name: str, index: int) -> str:
        """`call_{index}`. Qwen3's template renders no call ids (a tool result follows its call
        by position), so the id changes no prompt or generation id; the servers invent their
        own (vLLM `chatcmpl-tool-<random>`, SGLang `call_<random>`). The provider view and the
        prompt loader use this deterministic one, counted over the conversation."""
        return f"call_{index}"

    def generation_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        images: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if images:
            raise UserError(NO_IMAGES)
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, enable_thinking=self.thinking
        )
        return self.codec.encode_batch([text])[0]

    @property
    def media_pad_id(self) -> int:
        """Kimi's image placeholder has no Qwen3 counterpart: Qwen3 is a text model."""
        raise UserError(NO_IMAGES)


def _reasoning_text(reasoning: str, closed: bool) -> str:
    """The text between `<think>` and `</think>`: one newline each side, as the template writes
    it. Raw reasoning (from the ids, or vLLM) carries them already; stripped reasoning gets them.
    A model that wrote other whitespace there is rebuilt with the template's (the gate sees it)."""
    text = reasoning if reasoning.startswith("\n") else "\n" + reasoning
    if closed and (len(text) < 2 or not text.endswith("\n")):
        text += "\n"
    return text


def split_reasoning(text: str, notes: list[str]) -> tuple[str | None, str | None]:
    """vLLM 0.32's `qwen3` reasoning parser with thinking on (its engine starts in reasoning):
    (reasoning, content), each None when empty."""
    if not text.startswith(THINK_START):
        notes.append("generation does not open with <think>: the rebuild inserts one")
    end = text.find(THINK_END)
    call = text.find(CALL_BEGIN)
    if end != -1 and (call == -1 or end < call):
        reasoning, content = text[:end], text[end + len(THINK_END) :]
    elif call != -1:
        notes.append("reasoning ended by a tool call without </think>: the rebuild inserts one")
        reasoning, content = text[:call], text[call:]
    else:
        reasoning, content = text, ""
    if reasoning.count(THINK_START) > (1 if reasoning.startswith(THINK_START) else 0):
        notes.append("<think> inside the reasoning dropped by the reasoning parser")
    reasoning = reasoning.replace(THINK_START, "")
    if THINK_END in content:
        notes.append("</think> after the reasoning dropped by the reasoning parser")
        content = content.replace(THINK_END, "")
    return reasoning or None, content or None


def _hermes_calls(content: str, notes: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """vLLM's Hermes2ProToolParser.extract_tool_calls: every call's body must be JSON with a name
    and arguments, else nothing is a call; arguments come back re-serialised; the content is the
    text before the first `<tool_call>` (None when only whitespace)."""
    try:
        bodies = [json.loads(closed or unclosed) for closed, unclosed in _HERMES_CALL.findall(content)]
        calls = [(b["name"], json.dumps(b["arguments"], ensure_ascii=False)) for b in bodies]
    except (ValueError, KeyError, TypeError):
        return content, []  # every call returned as content text
    for match, (_name, args) in zip(_HERMES_CALL.finditer(content), calls):
        body = _CALL_BODY.fullmatch(match[1] or "")
        if match[1] is None:
            notes.append("tool call not closed: the rebuild closes it")
        elif body is None or body["args"] != args:
            notes.append("tool call re-serialised by the tool parser")
    first = content.find(CALL_BEGIN)
    between = _HERMES_CALL.sub("", content[first:])
    if between.replace("\n", "") or between.count("\n") != len(calls) - 1:
        notes.append("text between or after tool calls dropped by the tool parser")
    head = content[:first]
    return (head if head.strip() else None), calls


def _index(ids: list[int], value: int, start: int = 0) -> int | None:
    try:
        return ids.index(value, start)
    except ValueError:
        return None
