"""The model's output format: render an assistant message to generated text, parse ids back.

`get_output_format(tokenizer, thinking=...)` picks the registered format whose structural tokens
the tokenizer carries (or the one named), bound to the generation mode once: everything after
(render, parse, the provider's view, reconstruction, validation, calibration) takes the object,
never a thinking flag. Special ids are always derived from the tokenizer by name.
A new model family is a new module registering an `OutputFormat` subclass in `FORMATS`; a config
names it (`model.family`) or leaves it to the tokenizer's special tokens.
"""

from __future__ import annotations

import weakref
from typing import Any

from eagle3_data.chat_format.base import (
    AssistantMessage,
    FinishReason,
    OutputFormat,
    ParsedGeneration,
    ProviderView,
    ToolCall,
    normalize_finish_reason,
)
from eagle3_data.chat_format.kimi_k2 import KimiK2Format
from eagle3_data.chat_format.qwen3 import Qwen3Format
from eagle3_data.errors import UserError

FORMATS: dict[str, type[OutputFormat]] = {KimiK2Format.name: KimiK2Format, Qwen3Format.name: Qwen3Format}

_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

__all__ = [
    "FORMATS",
    "AssistantMessage",
    "FinishReason",
    "OutputFormat",
    "ParsedGeneration",
    "ProviderView",
    "ToolCall",
    "find_output_format",
    "get_output_format",
    "normalize_finish_reason",
]


def find_output_format(tokenizer: Any, name: str | None = None) -> type[OutputFormat] | None:
    """The format whose structural tokens the tokenizer carries, or the one named (`model.family`).
    A named family the tokenizer's tokens say is another is refused: a Qwen3 config pointed at a
    Kimi tokenizer (or the reverse) would otherwise fail far later, in a rebuild."""
    detected = next((cls for cls in FORMATS.values() if cls.matches(tokenizer)), None)
    if name is None:
        return detected
    if name not in FORMATS:
        raise UserError(f"unknown output format {name!r}; known: {', '.join(FORMATS)}")
    if detected is not None and detected.name != name:
        raise UserError(
            f"model.family is {name!r} but tokenizer {getattr(tokenizer, 'name_or_path', '?')} carries the "
            f"special tokens of {detected.name!r}: point tokenizer.source at a {name} tokenizer or set model.family: "
            f"{detected.name}"
        )
    return FORMATS[name]


def get_output_format(tokenizer: Any, name: str | None = None, *, thinking: bool) -> OutputFormat:
    """The format bound to this tokenizer and generation mode. `thinking` has no default: the
    mode is the one fact every rebuild depends on. Built once per (tokenizer, name, mode); the
    two modes share one verified codec."""
    if not isinstance(thinking, bool):
        raise TypeError(f"thinking must be a bool, not {type(thinking).__name__}")
    key = (name, thinking)
    bound = _BOUND.setdefault(tokenizer, {})
    if key not in bound:
        cls = find_output_format(tokenizer, name)
        if cls is None:
            raise UserError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')}: no known output format "
                f"matches its special tokens (known: {', '.join(FORMATS)})"
            )
        twin = bound.get((name, not thinking))
        bound[key] = cls(tokenizer, thinking=thinking, codec=twin.codec if twin else None)
    return bound[key]
