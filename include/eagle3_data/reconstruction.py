"""Text -> ids with the model's own format: the overflow path's only source of training ids.

Model-produced strings (reasoning, content, tool names, arguments) are text: they are encoded
as ordinary text (tiktoken's `encode_ordinary`, the HF backend with special parsing off), so a
literal stop token a provider passes through becomes the text tokens the model emitted;
the structural ids (the end of reasoning, the tool-section tokens, the stop id) are inserted by name from
the format. BPE never merges across a special token, so encoding the pieces between structural
ids equals one encode of the whole rendered generation.

Faithful only when the provider's text holds everything the model generated. Rows whose text
cannot determine the ids are `unreconstructable` with a reason (`unreconstructable_reason`),
counted in the report and never merged, instead of getting a confident wrong rebuild:
- a length cut that may lose text: the provider's tool parser (SGLang's kimi_k2 detector, and the
  dev server) returns the content before the tool section plus the *complete* calls
  only, dropping a partial call, the section markers, and any whole section with no complete call
  yet; a cut inside a multi-byte character arrives as U+FFFD;
- a tool name that is not among the offered tools (a provider shortening `web.search_v2` to
  `search_v2`): the offered name the call id carries is used when there is one;
- reasoning that was billed (`reasoning_tokens` > 0) but is absent from the answer;
- reasoning returned although thinking is off (nothing in the format can carry it);
- a `finish_reason` the format cannot rebuild (`content_filter`, `error`, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_data import json_records
from eagle3_data.chat_format import AssistantMessage, OutputFormat, ToolCall, normalize_finish_reason
from eagle3_data.errors import UserError

CHUNK_ROWS = 512

# The name a Kimi call id carries (`functions.web.search_v2:0` -> `web.search_v2`).
_ID_NAME = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):\d+$")


def reconstruct(
    fmt: OutputFormat, message: AssistantMessage, finish_reason: str, tool_call_index_start: int = 0
) -> list[int]:
    """Output ids for one assistant message (see `reconstruct_batch`)."""
    return reconstruct_batch(fmt, [message], [finish_reason], [tool_call_index_start])[0]


def reconstruct_batch(
    fmt: OutputFormat,
    messages: Sequence[AssistantMessage],
    finish_reasons: Sequence[str],
    tool_call_index_starts: Sequence[int] | None = None,
) -> list[list[int]]:
    """Output ids for many messages in the format's mode: render each into text pieces and
    structural ids, then one batched ordinary encode of all the pieces."""
    starts = tool_call_index_starts if tool_call_index_starts is not None else [0] * len(messages)
    if not len(messages) == len(finish_reasons) == len(starts):
        raise ValueError("messages, finish_reasons and tool_call_index_starts differ in length")
    return fmt.encode_parts_batch([fmt.render_parts(m, f, s) for m, f, s in zip(messages, finish_reasons, starts)])


def unreconstructable_reason(
    message: AssistantMessage,
    finish_reason: str,
    tools_offered: bool,
    *,
    thinking: bool,
    billed_reasoning_tokens: int | None = None,
) -> str | None:
    """Why the text of this generation does not determine its ids, or None when it does.

    Length cuts: still faithful are cuts inside reasoning or content of a request without tools
    (all text arrives; at worst an end-of-reasoning token generated as the very last token is not visible, so
    the ids are a strict prefix, never wrong ones). Not faithful: any cut with tools offered,
    because a tool section cut before its first complete call vanishes without a trace (the
    content before it looks like an ordinary content cut), and a cut after complete calls leaves
    the partial call and the section end unknown. `thinking` (the format's mode) and the billed
    reasoning count catch reasoning the answer cannot carry or does not carry.
    """
    if not thinking and message.reasoning:
        return "reasoning returned although thinking is off (the format cannot carry it)"
    if billed_reasoning_tokens and not message.reasoning:
        return f"reasoning billed ({billed_reasoning_tokens} tokens) but absent from the answer"
    try:
        finish = normalize_finish_reason(finish_reason)
    except UserError:
        return f"finish_reason {finish_reason!r} cannot be rebuilt (expected stop, tool_calls or length)"
    if finish != "length":
        return None
    if message.tool_calls:
        return "truncated inside tool-call section"
    if tools_offered:
        return "truncated with tools offered (a cut tool-call section is dropped by the provider's tool parser)"
    if (message.content or message.reasoning or "").endswith("\ufffd"):
        return "truncated inside a multi-byte character"
    return None


def resolve_tool_names(message: AssistantMessage, tools: list[dict[str, Any]] | None) -> str | None:
    """Put each call under the name of an offered tool, in place; the reason when one cannot be.

    A provider may shorten a name (vLLM's kimi_k2 parser returns `search_v2` for the offered
    `web.search_v2`) while the call id still carries the full one: the offered name the id
    carries wins. `tools` None = unknown (no check)."""
    if tools is None or not message.tool_calls:
        return None
    offered = {(t.get("function") or {}).get("name") for t in tools if isinstance(t, dict)}
    fixed = []
    for call in message.tool_calls:
        if call.name in offered:
            fixed.append(call)
            continue
        m = _ID_NAME.match(call.id or "")
        if m and m["name"] in offered:
            fixed.append(ToolCall(call.id, m["name"], call.arguments))
            continue
        shown = ", ".join(sorted(n for n in offered if n)) or "none"
        return f"tool name {call.name!r} is not among the offered tools ({shown})"
    message.tool_calls = fixed
    return None


@dataclass
class ReconstructRow:
    where: str
    sample_id: str
    message: AssistantMessage
    finish_reason: str
    tool_call_index_start: int
    unreconstructable: str | None = None  # why the text cannot determine the ids (see module docstring)
    literal_special: list[str] = field(default_factory=list)  # special-token names found as text


def row_to_reconstruct(fmt: OutputFormat, row: dict[str, Any], where: str) -> ReconstructRow:
    """An OpenRouter-style row (`reasoning`, `content`, `tool_calls`, `finish_reason`, `sample_id`,
    optional `messages` for the conversation-wide tool-call index, optional `tools` = the tools
    the request offered (absent = unknown), optional `usage` for the billed reasoning) -> what
    reconstruction needs."""
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
    finish = row.get("finish_reason")
    if not isinstance(finish, str):
        raise UserError(f"{where}: field 'finish_reason' is {finish!r}; expected a string such as 'stop'")
    history = _json_list(row, "messages", where)
    if not all(isinstance(m, dict) for m in history):
        raise UserError(f"{where}: field 'messages' is not a list of chat messages")
    tools = _json_list(row, "tools", where) if "tools" in row else None
    reason = unreconstructable_reason(
        message, finish, bool(tools), thinking=fmt.thinking, billed_reasoning_tokens=_billed_reasoning(row, where)
    ) or resolve_tool_names(message, tools)
    literal = fmt.literal_special_text(
        [message.reasoning, message.content] + [t for c in message.tool_calls for t in (c.name, c.arguments)]
    )
    return ReconstructRow(where, sample_id, message, finish, fmt.tool_call_index_start(history), reason, literal)


def _billed_reasoning(row: dict[str, Any], where: str) -> int | None:
    """`usage.reasoning_tokens` (generation rows) or `usage.completion_tokens_details.reasoning_tokens`
    (an OpenAI/OpenRouter response)."""
    usage = _json_field(row.get("usage"), "usage", where)
    if not isinstance(usage, dict):
        return None
    value = usage.get("reasoning_tokens")
    if value is None:
        value = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise UserError(f"{where}: field 'usage.reasoning_tokens' is {value!r}, not a count")
    return value


def reconstruct_rows(
    fmt: OutputFormat, rows: Iterable[ReconstructRow], chunk: int = CHUNK_ROWS
) -> Iterator[tuple[ReconstructRow, list[int]]]:
    """Streams (row, output_ids) in bounded chunks: memory does not grow with the input.
    Unreconstructable rows come back with no ids (`[]`): nothing trustworthy can be built."""
    buf: list[ReconstructRow] = []
    for row in rows:
        buf.append(row)
        if len(buf) >= chunk:
            yield from _flush(fmt, buf)
            buf = []
    if buf:
        yield from _flush(fmt, buf)


def _flush(fmt: OutputFormat, rows: list[ReconstructRow]) -> Iterator[tuple[ReconstructRow, list[int]]]:
    todo = [r for r in rows if not r.unreconstructable]
    ids = iter(
        reconstruct_batch(
            fmt, [r.message for r in todo], [r.finish_reason for r in todo], [r.tool_call_index_start for r in todo]
        )
    )
    for r in rows:
        yield r, ([] if r.unreconstructable else next(ids))


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, record) from JSONL (line by line) or Parquet (batch by batch)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        n = 0
        try:
            pf = pq.ParquetFile(p)
        except Exception as exc:  # pyarrow raises several types for a non-Parquet file
            raise UserError(f"--input {path}: not a readable Parquet file ({str(exc).splitlines()[0][:120]})") from None
        for batch in pf.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                n += 1
                try:
                    json_records.check_value(record)
                except json_records.JsonRefused as exc:
                    raise UserError(f"row {n}: field {exc.field!r} {exc.reason}") from None
                yield f"row {n}", record
        return
    with open(p, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield f"line {n}", json_records.loads(line)
                except json_records.JsonRefused as exc:
                    raise UserError(f"line {n}: field {exc.field or '<line>'!r} {exc.reason}") from None
                except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
                    raise UserError(f"line {n}: invalid JSON ({exc})") from exc


def _json_field(value: Any, field: str, where: str) -> Any:
    """A field given as its value or as its JSON text (Parquet stores nested fields as text)."""
    if isinstance(value, str):
        try:
            return json_records.loads(value)
        except json_records.JsonRefused as exc:
            raise UserError(f"{where}: field {json_records.join_field(field, exc.field)!r} {exc.reason}") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: field {field!r} is not valid JSON ({exc})") from exc
    return value


def _json_list(row: dict[str, Any], field: str, where: str) -> list[Any]:
    """An optional list field, given as a list or as its JSON text (Parquet stores it as text)."""
    value = _json_field(row.get(field) or [], field, where)
    if not isinstance(value, list):
        raise UserError(f"{where}: field {field!r} is not a list")
    return value
