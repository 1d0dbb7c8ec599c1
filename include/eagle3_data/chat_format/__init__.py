"""The model's output format: render an assistant message to generated text, parse ids back.

`get_output_format(tokenizer)` picks the registered format whose structural tokens the tokenizer
carries (or the one named); special ids are always derived from the tokenizer by name.
A new model family is a new module registering an `OutputFormat` subclass in `FORMATS`.
"""

from __future__ import annotations

import weakref
from typing import Any

from eagle3_data.chat_format.base import (
    AssistantMessage,
    FinishReason,
    OutputFormat,
    ParsedGeneration,
    ToolCall,
    normalize_finish_reason,
)
from eagle3_data.chat_format.kimi_k2 import KimiK2Format
from eagle3_data.errors import UserError

FORMATS: dict[str, type[OutputFormat]] = {KimiK2Format.name: KimiK2Format}

_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

__all__ = [
    "AssistantMessage",
    "FinishReason",
    "FORMATS",
    "OutputFormat",
    "ParsedGeneration",
    "ToolCall",
    "find_output_format",
    "get_output_format",
    "normalize_finish_reason",
]


def find_output_format(tokenizer: Any, name: str | None = None) -> type[OutputFormat] | None:
    if name is not None:
        if name not in FORMATS:
            raise UserError(f"unknown output format {name!r}; known: {', '.join(FORMATS)}")
        return FORMATS[name]
    return next((cls for cls in FORMATS.values() if cls.matches(tokenizer)), None)


def get_output_format(tokenizer: Any, name: str | None = None) -> OutputFormat:
    """The format bound to this tokenizer (built once per tokenizer object: building verifies ids)."""
    key = (name,)
    bound = _BOUND.setdefault(tokenizer, {})
    if key not in bound:
        cls = find_output_format(tokenizer, name)
        if cls is None:
            raise UserError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')}: no known output format "
                f"matches its special tokens (known: {', '.join(FORMATS)})"
            )
        bound[key] = cls(tokenizer)
    return bound[key]
