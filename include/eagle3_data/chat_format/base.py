"""The model-independent shape of an assistant generation, and the interface a format implements.

A format knows how one model family writes a generation as text and ids (render) and how its
engine-side parsers split generated ids back into a message (parse). Everything else in the
pipeline talks to this interface, so another model family is a new module, not edits to callers.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from eagle3_data.errors import UserError
from eagle3_data.tokenizer import Codec

FinishReason = Literal["stop", "length"]

_STOP_REASONS = {"stop", "tool_calls", "eos", "stop_sequence", "end_turn"}
_LENGTH_REASONS = {"length", "max_tokens"}


def normalize_finish_reason(value: str | None, *, where: str = "row") -> FinishReason:
    """OpenAI/OpenRouter/SGLang spellings -> "stop" | "length"; anything else cannot be reconstructed."""
    if value in _STOP_REASONS:
        return "stop"
    if value in _LENGTH_REASONS:
        return "length"
    raise UserError(
        f"{where}: field 'finish_reason' is {value!r}; expected 'stop' (or 'tool_calls') or 'length'"
    )


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: `arguments` is the JSON text exactly as generated."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_openai(cls, obj: dict[str, Any]) -> ToolCall:
        fn = obj.get("function") or {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            # Same serialisation as the chat template's `tojson` filter.
            args = json.dumps(args, ensure_ascii=False)
        return cls(id=str(obj.get("id") or ""), name=str(fn.get("name") or ""), arguments=args)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class AssistantMessage:
    """An assistant generation: reasoning, content, tool calls.

    `reasoning_closed` says whether the end-of-reasoning token was generated (None = infer:
    yes, unless a length-truncated message has only reasoning). `tool_tail` is raw text of a
    tool section that does not fit the call structure (cut by the length limit, or malformed);
    it is rendered verbatim after the well-formed calls instead of the section end. Both are
    set by `parse_ids` so a parsed generation renders back to exactly its text.
    """

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning_closed: bool | None = None
    tool_tail: str | None = None

    @classmethod
    def from_openai(cls, obj: dict[str, Any]) -> AssistantMessage:
        """From an OpenAI/OpenRouter message (`reasoning` or `reasoning_content`)."""
        reasoning = obj.get("reasoning")
        if reasoning is None:
            reasoning = obj.get("reasoning_content")
        calls = obj.get("tool_calls") or []
        if isinstance(calls, str):
            calls = json.loads(calls)
        return cls(
            reasoning=reasoning,
            content=obj.get("content"),
            tool_calls=[ToolCall.from_openai(c) for c in calls],
        )

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


@dataclass
class ParsedGeneration:
    """Generated ids split into a message, plus what the split observed about the ids."""

    message: AssistantMessage
    finish_reason: FinishReason
    stop_token_id: int | None  # the trailing stop id, when the engine output had one
    tool_call_index_start: int | None  # the index the model gave its first call, if parseable


class OutputFormat(ABC):
    """One model family's generation format, bound to a tokenizer."""

    name: str
    structural_tokens: tuple[str, ...]  # names the tokenizer must carry (and the audit checks)
    pattern: str | None = None  # pre-tokenizer regex for a tiktoken fast path, when the family has one
    stop_token_ids: list[int]
    special_ids: dict[str, int]  # every structural token the format uses, by name
    codec: Codec  # bulk encode/decode, equal to the tokenizer's own

    @classmethod
    @abstractmethod
    def matches(cls, tokenizer: Any) -> bool:
        """Whether this tokenizer carries the format's structural tokens."""

    @abstractmethod
    def render(
        self,
        message: AssistantMessage,
        finish_reason: str = "stop",
        tool_call_index_start: int = 0,
        *,
        thinking: bool = True,
    ) -> str:
        """The exact text the model generates for `message` (after the generation prompt)."""

    @abstractmethod
    def parse_ids(
        self, ids: list[int], finish_reason: str | None = None, *, thinking: bool = True
    ) -> ParsedGeneration:
        """Split generated ids the way the serving engine's parsers do, losslessly."""

    @abstractmethod
    def tool_call_index_start(self, messages: list[dict[str, Any]]) -> int:
        """Index the next assistant turn's first tool call gets."""

    @abstractmethod
    def generation_prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, thinking: bool = True
    ) -> list[int]:
        """Prompt ids ending with the generation prompt, from the tokenizer's chat template."""
