"""Kimi-K2 family (K2, K2-Thinking, K2.5, K2.6): everything Kimi-specific lives here.

A generation is `{reasoning}</think>{content}[tool section]<|im_end|>`; the tool section is
`<|tool_calls_section_begin|>` + per call `<|tool_call_begin|>functions.{name}:{idx}
<|tool_call_argument_begin|>{json}<|tool_call_end|>` + `<|tool_calls_section_end|>`, `idx`
counting calls across the whole conversation. Parsing follows SGLang's kimi_k2 reasoning and
tool-call parsers (`</think>`, or the start of the tool section, ends reasoning) but keeps every
character, so parse -> render reproduces the generated text exactly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from eagle3_data.chat_format.base import (
    AssistantMessage,
    OutputFormat,
    ParsedGeneration,
    ToolCall,
    normalize_finish_reason,
)
from eagle3_data.errors import UserError
from eagle3_data.tokenizer import (
    Codec,
    HFCodec,
    TiktokenCodec,
    TiktokenTokenizer,
    check_token,
    codecs_agree,
    tiktoken_encoding,
)

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
EOS = "[EOS]"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

# SGLang's kimi_k2 tool-call id: `functions.{name}:{idx}` (the prefix is optional there too).
_CALL_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^:\s]+):(?P<idx>\d+)\s*$")


class KimiK2Format(OutputFormat):
    name = "kimi_k2"
    structural_tokens = (
        "<think>",
        THINK_END,
        IM_END,
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        SECTION_BEGIN,
        SECTION_END,
        CALL_BEGIN,
        ARG_BEGIN,
        CALL_END,
    )

    pattern = KIMI_PATTERN

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        vocab = tokenizer.get_added_vocab()
        return all(t in vocab for t in cls.structural_tokens)

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.special_ids: dict[str, int] = {}
        for name in self.structural_tokens:
            tid, problems = check_token(tokenizer, name)
            if problems:
                raise UserError(f"tokenizer {tokenizer.name_or_path}: " + "; ".join(problems))
            self.special_ids[name] = tid
        ids = self.special_ids
        eos = tokenizer.get_added_vocab().get(EOS)
        self.stop_token_ids = [ids[IM_END]] + ([eos] if eos is not None and eos != ids[IM_END] else [])
        self._think_end = ids[THINK_END]
        self._section_begin, self._section_end = ids[SECTION_BEGIN], ids[SECTION_END]
        self._call_begin, self._arg_begin, self._call_end = ids[CALL_BEGIN], ids[ARG_BEGIN], ids[CALL_END]
        self.codec: Codec = self._fast_codec() or HFCodec(tokenizer)

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

    def render(
        self,
        message: AssistantMessage,
        finish_reason: str = "stop",
        tool_call_index_start: int = 0,
        *,
        thinking: bool = True,
    ) -> str:
        finish = normalize_finish_reason(finish_reason)
        parts: list[str] = []
        if thinking:
            closed = message.reasoning_closed
            if closed is None:
                has_more = bool(message.content) or bool(message.tool_calls) or message.tool_tail is not None
                closed = finish == "stop" or has_more
            parts.append(message.reasoning or "")
            if closed:
                parts.append(THINK_END)
        elif message.reasoning:
            raise UserError("message has reasoning but thinking is off: nothing in the format can carry it")
        parts.append(message.content or "")
        if message.tool_calls or message.tool_tail is not None:
            parts.append(SECTION_BEGIN)
            for offset, call in enumerate(message.tool_calls):
                call_id = f"functions.{call.name}:{tool_call_index_start + offset}"
                parts += [CALL_BEGIN, call_id, ARG_BEGIN, call.arguments, CALL_END]
            parts.append(message.tool_tail if message.tool_tail is not None else SECTION_END)
        if finish == "stop":
            parts.append(IM_END)
        return "".join(parts)

    def parse_ids(
        self, ids: list[int], finish_reason: str | None = None, *, thinking: bool = True
    ) -> ParsedGeneration:
        ids = list(ids)
        stop_id = ids.pop() if ids and ids[-1] in self.stop_token_ids else None
        if stop_id is not None:
            finish = "stop"
        else:
            finish = normalize_finish_reason(finish_reason) if finish_reason is not None else "length"
        decode = self.codec.decode
        msg = AssistantMessage()
        rest = ids
        if thinking:
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

    def tool_call_index_start(self, messages: list[dict[str, Any]]) -> int:
        return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")

    def generation_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, thinking: bool = True
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, thinking=thinking
        )
        return self.codec.encode_batch([text])[0]


def _index(ids: list[int], value: int, start: int = 0) -> int | None:
    try:
        return ids.index(value, start)
    except ValueError:
        return None
