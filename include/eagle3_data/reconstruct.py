"""Text -> ids with the model's own format: the overflow path's only source of training ids.

One encode over the whole rendered generation (never per part): BPE merges across part
boundaries exactly as they would in the model's own tokenisation of that text.

Faithful only when the provider's text holds everything the model generated. A generation cut by
the length limit can lose its tail on the way to us: the provider's tool parser (SGLang's kimi_k2
detector, and the dev server) returns the content before `<|tool_calls_section_begin|>` plus the
*complete* calls only, dropping a partial call, the section markers, and any whole section with no
complete call yet; a cut inside a multi-byte character arrives as U+FFFD. Such rows are
`unreconstructable` (`unreconstructable_reason`): rebuilding them would give fewer or wrong ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_data.chat_format import AssistantMessage, OutputFormat, get_output_format, normalize_finish_reason
from eagle3_data.errors import UserError

CHUNK_ROWS = 512


def reconstruct(
    tokenizer: Any,
    message: AssistantMessage,
    finish_reason: str,
    tool_call_index_start: int = 0,
    *,
    thinking: bool = True,
) -> list[int]:
    """Output ids for one assistant message (see `reconstruct_batch`)."""
    return reconstruct_batch(tokenizer, [message], [finish_reason], [tool_call_index_start], thinking=thinking)[0]


def reconstruct_batch(
    tokenizer: Any,
    messages: Sequence[AssistantMessage],
    finish_reasons: Sequence[str],
    tool_call_index_starts: Sequence[int] | None = None,
    *,
    thinking: bool = True,
) -> list[list[int]]:
    """Output ids for many messages: render each, then one batched encode."""
    fmt = get_output_format(tokenizer)
    starts = tool_call_index_starts if tool_call_index_starts is not None else [0] * len(messages)
    if not len(messages) == len(finish_reasons) == len(starts):
        raise ValueError("messages, finish_reasons and tool_call_index_starts differ in length")
    texts = [
        fmt.render(m, f, s, thinking=thinking) for m, f, s in zip(messages, finish_reasons, starts)
    ]
    return fmt.codec.encode_batch(texts)


def unreconstructable_reason(message: AssistantMessage, finish_reason: str, tools_offered: bool) -> str | None:
    """Why the text of this generation does not determine its ids, or None when it does.

    Only a length cut loses text. Still faithful: cut inside reasoning or content of a request
    without tools (all text arrives; at worst a `</think>` generated as the very last token is
    not visible, so the ids are a strict prefix, never wrong ones). Not faithful: any cut with
    tools offered, because a tool section cut before its first complete call vanishes without
    a trace (the content before it looks like an ordinary content cut), and a cut after complete
    calls leaves the partial call and the section end unknown.
    """
    if normalize_finish_reason(finish_reason) != "length":
        return None
    if message.tool_calls:
        return "truncated inside tool-call section"
    if tools_offered:
        return "truncated with tools offered (a cut tool-call section is dropped by the provider's tool parser)"
    if (message.content or message.reasoning or "").endswith("\ufffd"):
        return "truncated inside a multi-byte character"
    return None


@dataclass
class ReconstructRow:
    where: str
    sample_id: str
    message: AssistantMessage
    finish_reason: str
    tool_call_index_start: int
    unreconstructable: str | None = None  # why the text cannot determine the ids (see module docstring)


def row_to_reconstruct(fmt: OutputFormat, row: dict[str, Any], where: str) -> ReconstructRow:
    """An OpenRouter-style row (`reasoning`, `content`, `tool_calls`, `finish_reason`, `sample_id`,
    optional `messages` for the conversation-wide tool-call index, optional `tools` = the tools
    the request offered) -> what reconstruction needs."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: not a JSON object")
    sample_id = row.get("sample_id")
    if not isinstance(sample_id, str) or not sample_id:
        raise UserError(f"{where}: field 'sample_id' is missing or not a string")
    where = f"{where} (sample_id {sample_id})"
    for name in ("reasoning", "content"):
        if row.get(name) is not None and not isinstance(row[name], str):
            raise UserError(f"{where}: field {name!r} is not a string")
    try:
        message = AssistantMessage.from_openai(row)
    except (json.JSONDecodeError, TypeError, AttributeError) as exc:
        raise UserError(f"{where}: field 'tool_calls' is not a list of OpenAI tool calls ({exc})") from exc
    finish = normalize_finish_reason(row.get("finish_reason"), where=where)
    history = _json_list(row, "messages", where)
    if not all(isinstance(m, dict) for m in history):
        raise UserError(f"{where}: field 'messages' is not a list of chat messages")
    tools = _json_list(row, "tools", where)
    reason = unreconstructable_reason(message, finish, bool(tools))
    return ReconstructRow(where, sample_id, message, finish, fmt.tool_call_index_start(history), reason)


def reconstruct_rows(
    tokenizer: Any, rows: Iterable[ReconstructRow], chunk: int = CHUNK_ROWS
) -> Iterator[tuple[ReconstructRow, list[int]]]:
    """Streams (row, output_ids) in bounded chunks: memory does not grow with the input."""
    buf: list[ReconstructRow] = []
    for row in rows:
        buf.append(row)
        if len(buf) >= chunk:
            yield from _flush(tokenizer, buf)
            buf = []
    if buf:
        yield from _flush(tokenizer, buf)


def _flush(tokenizer: Any, rows: list[ReconstructRow]) -> Iterator[tuple[ReconstructRow, list[int]]]:
    ids = reconstruct_batch(
        tokenizer, [r.message for r in rows], [r.finish_reason for r in rows], [r.tool_call_index_start for r in rows]
    )
    yield from zip(rows, ids)


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, record) from JSONL (line by line) or Parquet (batch by batch)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(p).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                n += 1
                yield f"row {n}", record
        return
    with open(p, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield f"line {n}", json.loads(line)
                except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
                    raise UserError(f"line {n}: invalid JSON ({exc})") from exc


def _json_list(row: dict, field: str, where: str) -> list:
    """An optional list field, given as a list or as its JSON text (Parquet stores it as text)."""
    value = row.get(field) or []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: field {field!r} is not valid JSON ({exc})") from exc
    if not isinstance(value, list):
        raise UserError(f"{where}: field {field!r} is not a list")
    return value
