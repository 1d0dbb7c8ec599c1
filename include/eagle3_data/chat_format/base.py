"""The model-independent shape of an assistant generation, and the interface a format implements.

A format knows how one model family writes a generation as text and ids (render) and how its
engine-side parsers split generated ids back into a message (parse). Everything else in the
pipeline talks to this interface, so another model family is a new module, not edits to callers.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from eagle3_data.codec import Codec, check_token
from eagle3_data.errors import UserError

FinishReason = Literal["stop", "length"]

_STOP_REASONS = {"stop", "tool_calls", "eos", "stop_sequence", "end_turn"}
_LENGTH_REASONS = {"length", "max_tokens"}


def normalize_finish_reason(value: str | None, *, where: str = "row") -> FinishReason:
    """OpenAI/OpenRouter/SGLang spellings -> "stop" | "length"; anything else cannot be reconstructed."""
    if value in _STOP_REASONS:
        return "stop"
    if value in _LENGTH_REASONS:
        return "length"
    raise UserError(f"{where}: field 'finish_reason' is {value!r}; expected 'stop' (or 'tool_calls') or 'length'")


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


@dataclass
class ProviderView:
    """What an OpenAI-compatible server returns for one generation, and what its parsers reshaped.

    `message` is the OpenAI message the serving engine's reasoning and tool-call parsers make of
    the generated text (the overflow path never sees more). `notes` names every way that split
    departs from the generation (an implicit reasoning end, whitespace the tool regexes drop, a
    call they discard...): a rebuild of such a message cannot be the generated ids, so the gate
    classes the row `structure` whatever the ids look like.
    """

    message: dict[str, Any]
    finish_reason: str
    notes: list[str]
    tool_call_index_start: int  # the index of the first call id the server returns
    text: str = ""  # the decoded generation the parsers split (stop token trimmed)
    # why the answer cannot show the generation's last token (a length cut right after a structural
    # token the parsers consume): its rebuild is then the ids minus that one, a strict prefix
    hides_last_token: str | None = None


Part = str | int  # rendered text, or a structural special id inserted by name


class OutputFormat(ABC):
    """One model family's generation format, bound to a tokenizer AND a generation mode.

    The mode (thinking on/off) is fixed at construction (`get_output_format(tok, thinking=...)`),
    so no render/parse/reconstruct path can forget it: a prompt that ends `<think></think>` and a
    rebuild that starts with reasoning cannot meet.
    """

    name: str  # what `model.family` names it by
    structural_tokens: tuple[str, ...]  # names the tokenizer must carry (and the audit checks)
    # the family's published ids by name: what the tokenizer audit expects of any tokenizer of this
    # family (the config may add more), written out so a wrong tokenizer cannot vouch for itself
    reference_ids: ClassVar[dict[str, int]]
    media_pad: str | None = None  # the image placeholder the template renders once per image (None: text model)
    # the parsers an OpenAI-compatible server splits this family's generations with (provider_view
    # reproduces them): `vllm serve --reasoning-parser/--tool-call-parser`, SGLang's flags of those names
    vllm_reasoning_parser: str
    vllm_tool_parser: str
    sglang_reasoning_parser: str
    sglang_tool_parser: str
    stop_token: str  # the name of the stop token every generation ends with (the config must pin its id)
    reasoning_end_id: int | None  # the id that closes the reasoning section (None: the format has none)
    tool_section_id: int | None  # the id that opens a tool-call section (None: no tool calls)
    pattern: str | None = None  # pre-tokenizer regex for a tiktoken fast path, when the family has one
    thinking: bool
    stop_token_ids: list[int]
    special_ids: dict[str, int]  # every structural token the format uses, by name
    codec: Codec  # bulk encode/decode, equal to the tokenizer's own
    tokenizer: Any  # the Hugging Face tokenizer the format renders prompts with
    vocab_size: int

    @property
    @abstractmethod
    def media_pad_id(self) -> int:
        """`media_pad`'s id, which a prompt's images expand; a text model's raises UserError."""

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        """Whether this tokenizer carries the format's structural tokens."""
        vocab = tokenizer.get_added_vocab()
        return all(t in vocab for t in cls.structural_tokens)

    def _bind(self, tokenizer: Any, thinking: bool) -> dict[str, int]:
        """Bind the tokenizer and the mode; the structural tokens' ids by name, each checked to be
        one id that decodes back to its name (a UserError naming the tokenizer otherwise)."""
        self.tokenizer = tokenizer
        self.thinking = bool(thinking)
        self.special_ids = {}
        for name in self.structural_tokens:
            tid, problems = check_token(tokenizer, name)
            if problems:
                raise UserError(f"tokenizer {tokenizer.name_or_path}: " + "; ".join(problems))
            assert tid is not None  # a token without problems has its one id
            self.special_ids[name] = tid
        return self.special_ids

    @abstractmethod
    def render_parts(self, message: AssistantMessage, finish_reason: str, tool_call_index_start: int = 0) -> list[Part]:
        """The generation for `message` as text pieces (model-produced strings, encoded as ordinary
        text) and structural ids (inserted by name): literal special-token text stays text."""

    def render(self, message: AssistantMessage, finish_reason: str, tool_call_index_start: int = 0) -> str:
        """The exact text the model generates for `message` (after the generation prompt)."""
        names = {tid: name for name, tid in self.special_ids.items()}
        return "".join(
            p if isinstance(p, str) else names[p]
            for p in self.render_parts(message, finish_reason, tool_call_index_start)
        )

    def encode_parts_batch(self, parts: Sequence[Sequence[Part]]) -> list[list[int]]:
        """Ids of rendered generations: text pieces through one ordinary (no special parsing) batch
        encode, structural ids spliced in. BPE never merges across a special token, so this equals
        encoding the whole text with its structural tokens recognised, minus the literal ones."""
        texts = [p for row in parts for p in row if isinstance(p, str) and p]
        encoded = iter(self.codec.encode_ordinary_batch(texts))
        out: list[list[int]] = []
        for row in parts:
            ids: list[int] = []
            for p in row:
                if isinstance(p, int):
                    ids.append(p)
                elif p:
                    ids += next(encoded)
            out.append(ids)
        return out

    @abstractmethod
    def parse_ids(self, ids: list[int], finish_reason: str | None = None) -> ParsedGeneration:
        """Split generated ids losslessly (by id), for the generation rows' message fields."""

    @abstractmethod
    def provider_view(
        self,
        ids: list[int],
        finish_reason: str,
        tools: list[dict[str, Any]] | None,
        history_tool_calls: int | None = None,
    ) -> ProviderView:
        """The OpenAI message an OpenAI-compatible server's parsers make of these generated ids
        (`tools`: the tools offered; None = unknown, taken as offered when a tool section exists).
        `history_tool_calls`: the tool calls of the conversation's assistant turns before this one
        (`tool_call_index_start(messages)`), from which the server numbers the call ids it
        returns; None = unknown, numbered from the model's own first index."""

    def _served_text(self, ids: list[int], finish_reason: str) -> tuple[FinishReason, str]:
        """What an OpenAI-compatible server hands its reasoning and tool parsers: the matched stop
        token trimmed, the rest decoded with special tokens kept (SGLang and vLLM both turn
        skip_special_tokens off for these families' parsers)."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return normalize_finish_reason(finish_reason), self.codec.decode(ids)

    @abstractmethod
    def tool_call_index_start(self, messages: list[dict[str, Any]]) -> int:
        """Index the next assistant turn's first tool call gets."""

    @staticmethod
    @abstractmethod
    def call_id(name: str, index: int) -> str:
        """The id the model writes for its `index`-th tool call of a conversation (counted over
        every call, in order), calling `name`. A static method: the prompt loader rewrites a
        dataset's own ids (`call_0`, `call_w1`) to these before any tokenizer is loaded, so the
        history reads as the model's own (the name may be nowhere else in the render)."""

    @abstractmethod
    def generation_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        images: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids ending with the generation prompt of this format's mode, each image's
        placeholder expanded to its `media_tokens` (`images`: the row's references, images.py)."""

    @abstractmethod
    def prompt_tools(self, prompt_ids: list[int]) -> tuple[list[dict[str, Any]], int]:
        """What a rendered prompt offers and holds: the tools its template declared (OpenAI shape;
        none when they are not JSON) and the tool calls of its assistant turns, so a stand-in
        engine answering from prompt ids alone can call the tools and number its calls on."""

    def literal_special_text(self, texts: Iterable[str | None]) -> list[str]:
        """Special-token names that occur as literal text in model-produced strings."""
        pattern = self._literal_pattern()
        found: set[str] = set()
        for text in texts:
            if text:
                found.update(pattern.findall(text))
        return sorted(found)

    def _literal_pattern(self) -> re.Pattern[str]:
        cached = getattr(self, "_literal_re", None)
        if cached is None:
            cached = self._literal_re = re.compile(_trie_pattern(self.all_special_names))
        return cached

    all_special_names: tuple[str, ...] = ()


def _trie_pattern(words: Iterable[str]) -> str:
    """One regex matching any of `words`, as a prefix trie: a flat alternation of 256 special-token
    names is tried name by name at every position (milliseconds per answer); a trie branches on
    one character at a time. Longest match wins, as with longest-first alternation."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        end = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if end else body

    return build(trie) or "(?!)"
