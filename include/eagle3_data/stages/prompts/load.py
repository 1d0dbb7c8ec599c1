"""Prompt datasets: chat rows from JSONL, Parquet or a `datasets` save_to_disk folder, local or S3.

A row is OpenAI `messages` (optional `tools`), ShareGPT `conversations` or a plain `prompt`
string (prompt_layouts maps the last two to messages); every row is validated as messages.

Every good row is normalised to canonical JSON and given a `sample_id` that depends only on what
is generated (dataset, messages, tools, sampling, repeat number), so a rerun or a backfill finds
the same ids and skips work already paid for. A malformed row never stops the load: it goes to
`rejects` with the file, line and field, and the counts go into the manifest.

Where the files are (`source`):
  date given      {source}/{dataset}/date=YYYY-MM-DD/ *.jsonl|*.parquet (scheduled runs, backfills)
  a file          that file
  a folder        {source}/{dataset}.jsonl|.parquet, else {source}/{dataset}/ *.jsonl|*.parquet|*.arrow,
                  else the folder itself when it is named after the dataset or is a `datasets`
                  save_to_disk folder (its state.json lists the .arrow files, in order)
`source` is a local path or `s3://bucket/key-or-prefix`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa

from eagle3_data import json_records, prompt_layouts
from eagle3_data.conversations import needs_rounds, pair_results
from eagle3_data.errors import UserError
from eagle3_data.images import ImageError, ImageSink, image_parts
from eagle3_data.prompt_files import (
    DATE_PATTERN,
    PromptFile,
    resolve_files,
)
from eagle3_data.rejects import format_rejects
from eagle3_data.spill import RowSpill
from eagle3_data.storage import canonical_json, check_name

if TYPE_CHECKING:
    from botocore.client import BaseClient

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
_RAW_LIMIT = 2000


# What a load spills per accepted row: the prompts stage's columns, and where the row came from
# (file, line, raw text) for a reject that only the token limit finds, after the load.
_ORIGIN_COLUMNS = [("source", pa.string()), ("line", pa.int64()), ("raw", pa.string())]


class PromptRows(RowSpill):
    """A load's accepted rows (schemas.PROMPTS shape; `route` left None for the router), spilled
    to a local file with their origin (file, line, raw text): only their count stays in memory.
    Iterating yields PROMPTS row dicts; `batches()` Arrow batches of the PROMPTS columns."""

    def __init__(self) -> None:
        from eagle3_data.schemas import PROMPTS

        super().__init__(pa.schema([*PROMPTS, *_ORIGIN_COLUMNS]))
        self.columns = PROMPTS.names

    def batches(self, columns: list[str] | None = None):
        return super().batches(self.columns if columns is None else columns)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.rows()


@dataclass
class PromptLoad:
    rows: PromptRows
    rejects: list[dict[str, Any]]  # schemas.REJECTS shape
    sources: list[dict[str, Any]] = field(default_factory=list)  # {"uri", "bytes", "sha256"}: manifest inputs
    counts: dict[str, int] = field(default_factory=dict)


_Reject = prompt_layouts.LayoutRefused  # a row refused: the field (as its layout names it) and why


class _ImageReject(_Reject):
    """A row refused for one of its images (counted apart: `image_rejects`)."""


def sample_id(
    dataset: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    sampling: dict[str, Any],
    index: int,
) -> str:
    """Stable id of one generation: sha256 over canonical JSON, 32 hex digits. `index` is the
    repeat number, so the same prompt twice in a file is one sample, not two."""
    key = canonical_json(
        {"dataset": dataset, "messages": messages, "tools": tools or None, "sampling": sampling, "index": index}
    )
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class PromptShape:
    """What a load makes of each row: the values (from the run's config) that decide a row's
    prompts and their sample ids, apart from where the rows are read.

    `sampling` and `repeats` go into every sample_id. `max_message_bytes` (config
    limits.max_message_bytes): a longer message refuses its row. `regenerate` and `history`
    (generation.*) decide which prompts a row gives; `call_id`: the output format's own call id
    (`OutputFormat.call_id`, `generation.call_ids: format`), None keeps the dataset's ids."""

    sampling: dict
    repeats: int = 1
    max_message_bytes: int | None = None
    regenerate: str = "final_turn"
    history: str = "dataset"
    call_id: Callable[[str, int], str] | None = None


class Normalised(NamedTuple):
    """One row in canonical form (`_normalise`)."""

    messages: list[dict]
    tools: list[dict] | None
    ignored_fields: int  # the row's fields no layout reads
    answer_dropped: bool  # final_turn: the row's trailing assistant messages were left out


def load_prompts(
    source: str,
    dataset: str,
    shape: PromptShape,
    *,
    date: str | None = None,
    client: BaseClient | None = None,
    images: ImageSink | None = None,
) -> PromptLoad:
    """Load, validate and normalise one dataset's prompts as `shape` says; see the module
    docstring for `source`.

    `client`: the caller's S3 client, required for an s3:// source (Airflow passes aws_default's).
    A message whose canonical JSON is over `shape.max_message_bytes` bytes is rejected; the token
    limit needs the tokenizer and is applied after, by `limit_prompt_tokens`, so bad files fail
    before the tokenizer loads.
    Files are read a line (a Parquet batch) at a time and the accepted rows spilled to a local
    file (`PromptRows`), so memory does not grow with the number of prompts.
    `shape.regenerate="every_turn"` makes one prompt of each user turn of a row: the messages up to
    and including it (`turn_prompts`); `final_turn` one of the whole row. `trajectory`, and
    `every_turn` on the `regenerated` history, keep the whole row (its recorded answers and tool
    results included) as one prompt: the generation stage asks for its turns in rounds
    (conversations).
    In `final_turn` a row that ends with the dataset's answer is answered again after its last
    user (or tool) message: the trailing assistant messages are left out of the prompt (counted in
    `counts["answers_dropped"]`), as the other modes leave them out of every turn's prompt.
    `shape.call_id`: every call of a row is renamed to it, numbered over the row as the model
    numbers its calls, and each tool message re-keyed to the call it answers (`pair_results`);
    None keeps the dataset's ids (`given`).
    `images`: where image parts' images go (images.ImageSink: the run's bucket, the size limit);
    each is read once, checked and stored, its part rewritten to name the stored object, and the
    row's `images` column lists their references in prompt order. None: a row with an image part
    is refused."""
    regenerate, repeats = shape.regenerate, shape.repeats
    whole = needs_rounds(regenerate, shape.history)
    check_name(dataset, "dataset")
    if date is not None and not DATE_PATTERN.fullmatch(date):
        raise UserError(f"invalid date {date!r}: expected YYYY-MM-DD")
    if repeats < 1:
        raise UserError(f"repeats must be >= 1, got {repeats}")
    files = resolve_files(source, dataset, date, client)
    load = PromptLoad(
        rows=PromptRows(),
        rejects=[],
        counts={"read": 0, "rejected": 0, "duplicates": 0, "ignored_fields": 0, "answers_dropped": 0},
    )
    seen: set[str] = set()
    ordinal = 0
    for f in files:
        digest = hashlib.sha256()
        for line, raw, record in _read_records(f, client, digest):
            load.counts["read"] += 1
            try:
                if record is None:
                    raise _Reject("", "not valid JSON")
                if isinstance(record, _Reject):
                    raise record
                row = _normalise(record, shape.call_id, drop_answer=regenerate == "final_turn")
                messages, tools = row.messages, row.tools
                refs = _store_images(messages, images, f, client)
                source_id = _source_id(record)
                _check_bytes(messages, shape.max_message_bytes)
                if whole:  # one prompt row; its user turns (refused when none) size the stage's task
                    user_turns = len(turn_prompts(messages, regenerate))
                    prompts = [messages]
                else:
                    prompts = turn_prompts(messages) if regenerate == "every_turn" else [messages]
            except _Reject as exc:
                load.counts["rejected"] += 1
                if isinstance(exc, _ImageReject):
                    load.counts["image_rejects"] = load.counts.get("image_rejects", 0) + 1
                load.rejects.append(
                    {
                        "dataset": dataset,
                        "source": f.uri,
                        "line": line,
                        "field": exc.field,
                        "reason": f"{f.uri} line {line}: {exc}",
                        "raw": raw[:_RAW_LIMIT],
                    }
                )
                continue
            load.counts["ignored_fields"] += row.ignored_fields
            load.counts["answers_dropped"] += row.answer_dropped
            if refs:  # per prompt row (its repeats and turn prompts share its images)
                for key, n in (
                    ("image_rows", 1),
                    ("images", len(refs)),
                    ("media_tokens", sum(r["media_tokens"] for r in refs.values())),
                ):
                    load.counts[key] = load.counts.get(key, 0) + n
            if whole:
                load.counts["user_turns"] = load.counts.get("user_turns", 0) + user_turns * repeats
            tools_json = canonical_json(tools) if tools else None
            for prompt in prompts:
                messages_json = canonical_json(prompt)
                for r in range(repeats):
                    sid = sample_id(dataset, prompt, tools, shape.sampling, r)
                    if sid in seen:
                        load.counts["duplicates"] += 1
                        continue
                    seen.add(sid)
                    prompt_refs = [refs[i, j] for i, j, _ in image_parts(prompt)]
                    load.rows.append(
                        {
                            "sample_id": sid,
                            "dataset": dataset,
                            "sample_index": ordinal * repeats + r,
                            "messages": messages_json,
                            "tools": tools_json,
                            "route": None,
                            "source_id": source_id,
                            "images": canonical_json(prompt_refs) if prompt_refs else None,
                            "source": f.uri,
                            "line": line,
                            "raw": raw[:_RAW_LIMIT],
                        }
                    )
                ordinal += 1
        load.sources.append({"uri": f.uri, "bytes": f.size, "sha256": digest.hexdigest()})
    load.counts["rows"] = len(load.rows)
    return load


def _store_images(
    messages: list[dict[str, Any]], sink: ImageSink | None, f: PromptFile, client
) -> dict[tuple[int, int], dict[str, Any]]:
    """Read, check and store every image part of a normalised row (images.ImageSink), rewriting
    each part's url to the stored object: (message, part) -> its reference. A broken, missing or
    oversized image refuses the row, naming the part."""
    refs = {}
    for i, j, part in image_parts(messages):
        where = f"messages[{i}].content[{j}]"
        if sink is None:
            raise _Reject(where, "image parts are read by the prompts stage only (no image store given)")
        try:
            ref = sink.add(part["image_url"]["url"], f.uri, client)
        except ImageError as exc:
            raise _ImageReject(where, f"image: {exc}") from None
        if ref["uri"] is not None:  # None: a check-only sink
            part["image_url"] = {"url": ref["uri"]}
        refs[i, j] = ref
    return refs


def _check_bytes(messages: list[dict[str, Any]], max_bytes: int | None) -> None:
    if max_bytes is not None:
        for i, m in enumerate(messages):
            size = len(canonical_json(m).encode())
            if size > max_bytes:
                raise _Reject(
                    f"messages[{i}]", f"{size} bytes, over the limit of {max_bytes} (limits.max_message_bytes)"
                )


# a load of at least this many rows renders its prompts on forked workers (`limit_prompt_tokens`)
FORK_MIN_ROWS = 4096
_FORKED_COUNT: Callable[..., Any] | None = None  # set in the parent just before forking; the workers inherit it


def _count_one(count_tokens: Callable[..., Any], max_tokens: int, messages: str, tools: str | None, images: str | None):
    """(tokens or None, verdict or None) of one prompt (`limit_prompt_tokens`)."""
    try:
        extra = {"images": json.loads(images)} if images else {}
        n = count_tokens(json.loads(messages), json.loads(tools) if tools else None, **extra)
    except Exception as exc:  # the chat template refuses this conversation
        return None, f"the chat template cannot render it: {str(exc)[:200]}"
    over = f"{n} prompt tokens, over the limit of {max_tokens} (limits.max_prompt_tokens)"
    return n, None if n <= max_tokens else over


def _forked_init() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _count_forked(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return _count_one(_FORKED_COUNT, *args)


def limit_prompt_tokens(
    load: PromptLoad,
    max_tokens: int | None,
    count_tokens: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], int],
    counted: dict[str, int] | None = None,
    workers: int = 1,
) -> None:
    """Move the rows whose prompt is over `max_tokens` tokens (as `count_tokens(messages, tools)`
    renders it: the chat template's generation prompt; an image row's references are passed as
    `images=`, their media tokens count) to the rejects, before any request. A
    prompt the template cannot render is rejected too. Repeats of one prompt (adjacent rows: the
    same prompt on another line is a duplicate sample, dropped by the load) are counted once.
    `counted` (the plan's): filled with each row's prompt tokens by sample_id, so nothing renders twice.
    `workers` > 1: a load of FORK_MIN_ROWS rows or more renders on that many forked processes
    (the chat template is pure Python: ~1 ms a prompt; same results, in order)."""
    global _FORKED_COUNT
    if max_tokens is None:
        return
    pool = None
    if workers > 1 and len(load.rows) >= FORK_MIN_ROWS:
        import multiprocessing

        from eagle3_data.mismatch.pool import _default_sigterm, can_fork_workers

        if "fork" in multiprocessing.get_all_start_methods() and can_fork_workers():
            _FORKED_COUNT = count_tokens
            with _default_sigterm():
                pool = multiprocessing.get_context("fork").Pool(workers, initializer=_forked_init)
    last, verdict, dropped, n = None, None, [], None
    try:
        for batch in load.rows.batches(
            ["sample_id", "dataset", "messages", "tools", "images", "source", "line", "raw"]
        ):
            # the raw line is read only for a row refused here (the rest: half the conversion)
            rows = batch.drop_columns(["raw"]).to_pylist()
            todo, prev = [], last
            for row in rows:  # this batch's new prompts, rendered at once (on the workers)
                if (row["messages"], row["tools"]) != prev:
                    prev = (row["messages"], row["tools"])
                    todo.append((max_tokens, row["messages"], row["tools"], row["images"]))
            if pool is not None:
                results = iter(pool.map(_count_forked, todo, chunksize=max(1, len(todo) // (4 * workers))))
            else:
                results = (_count_one(count_tokens, *t) for t in todo)
            for i, row in enumerate(rows):
                key = (row["messages"], row["tools"])
                if key != last:
                    last = key
                    n, verdict = next(results)
                if verdict is None:
                    if counted is not None and n is not None:
                        counted[row["sample_id"]] = n
                    continue
                dropped.append(row["sample_id"])
                uri, line = row["source"], row["line"]
                if not any(
                    r["source"] == uri and r["line"] == line for r in load.rejects[-1:]
                ):  # repeats: one reject per line
                    load.rejects.append(
                        {
                            "dataset": row["dataset"],
                            "source": uri,
                            "line": line,
                            "field": "messages",
                            "reason": f"{uri} line {line}: messages: {verdict}",
                            "raw": batch.column("raw")[i].as_py(),
                        }
                    )
                    load.counts["rejected"] = load.counts.get("rejected", 0) + 1
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        _FORKED_COUNT = None
    load.rows.drop(dropped)
    load.counts["rows"] = len(load.rows)


def format_load_rejects(load: PromptLoad, per_kind: int = 3, where: str = "") -> str:
    """What a person must see about a load (`rejects.format_rejects`): rejected / read, a count
    per kind of reject, and the first few of each kind with their file, line and field."""
    return format_rejects(load.rejects, load.counts.get("read", 0), per_kind=per_kind, rows=f"prompt rows{where}")


def prompt_token_limit(tokenizer, configured: int | None, max_new_tokens: int) -> int | None:
    """limits.max_prompt_tokens, else the model's context (the tokenizer's model_max_length) less
    the generation budget: a longer prompt could not get its answer. None when unknown."""
    if configured is not None:
        return configured
    context = getattr(tokenizer, "model_max_length", None)
    if not isinstance(context, int) or context <= 0 or context > 10_000_000:  # HF's "unset" is 1e30
        return None
    return max(1, context - max_new_tokens)


def require_rows(load: PromptLoad, what: str) -> None:
    """A load without one accepted row stops the stage before anything is written or paid."""
    if not load.rows:
        first = load.rejects[0]["reason"] if load.rejects else "the files hold no rows"
        raise UserError(
            f"{what}: 0 usable prompt rows ({load.counts.get('read', 0)} read, "
            f"{load.counts.get('rejected', 0)} rejected; first: {first}); nothing committed"
        )


# -- validation and normalisation -------------------------------------------------------------------
def turn_prompts(messages: list[dict[str, Any]], regenerate: str = "every_turn") -> list[list[dict[str, Any]]]:
    """Every user turn's prompt: the messages up to and including it. The earlier assistant
    turns stay the dataset's own (the template renders them as it does at that point: Kimi's
    drops their reasoning), so each sample is what the model sees when it answers that turn."""
    out = [messages[: j + 1] for j, m in enumerate(messages) if m["role"] == "user"]
    if not out:
        raise _Reject("messages", f"no user turn to answer (regenerate: {regenerate})")
    return out


def _normalise(
    record: Any, call_id: Callable[[str, int], str] | None = None, *, drop_answer: bool = False
) -> Normalised:
    """A row in any layout (prompt_layouts), every tool message paired with the call it answers (refused when it
    answers none) and, given `call_id`, the calls renamed to the format's own ids (see
    `load_prompts`). `drop_answer` (final_turn): the assistant messages the row ends with are left
    out, the target answers again after the user or tool message before them."""
    if not isinstance(record, dict):
        raise _Reject("", f"expected a JSON object, got {type(record).__name__}")
    messages, tools, used = prompt_layouts.to_messages(record)
    name = "messages" if "messages" in used else f"{prompt_layouts.layout_of(record)} as messages"
    if isinstance(messages, str):  # Parquet files often hold the list as a JSON string
        messages = _json_field(messages, "messages")
    if not isinstance(messages, list):
        raise _Reject("messages", f"expected a list, got {type(messages).__name__}")
    if not messages:
        raise _Reject(name, "empty")
    out = [_message(m, f"{name}[{i}]") for i, m in enumerate(messages)]
    answers = pair_results(out, name)
    if call_id is not None:
        _format_call_ids(out, answers, call_id)
    end = len(out)
    while drop_answer and end and out[end - 1]["role"] == "assistant":
        end -= 1
    if end < len(out) and not any(m["role"] in ("user", "tool") for m in out[:end]):
        raise _Reject(
            f"{name}[{len(out) - 1}].role", "no user or tool message before the assistant's answer: nothing to answer"
        )
    if isinstance(tools, str):
        tools = _json_field(tools, "tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _Reject("tools", f"expected a list or null, got {type(tools).__name__}")
        tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)] or None
    ignored = len(set(record) - used - {"id"})
    return Normalised(out[:end], tools, ignored, end < len(out))


def _format_call_ids(
    messages: list[dict[str, Any]], answers: dict[int, tuple[int, int]], call_id: Callable[[str, int], str]
) -> None:
    """Rename every call (in place) to `call_id(name, k)`, k counting the row's calls in order (as
    the model counts them: `OutputFormat.tool_call_index_start`), and re-key each tool message
    to the new id of the call it answers (`answers`: conversations.pair_results)."""
    ids: dict[tuple[int, int], str] = {}
    for i, m in enumerate(messages):
        for k, call in enumerate(m.get("tool_calls") or ()):
            call["id"] = ids[i, k] = call_id(call["function"]["name"], len(ids))
    for j, at in answers.items():
        messages[j]["tool_call_id"] = ids[at]


def _source_id(record: dict[str, Any]) -> str | None:
    """The row's own `id` (a string or an integer), kept as provenance beside the sample id: the
    sample id depends only on what is generated, the dataset's id is how its owner finds the row."""
    value = record.get("id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _Reject("id", f"expected a string or an integer, got {type(value).__name__}")
    return str(value)[:256]


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise _Reject(where, f"expected an object, got {type(m).__name__}")
    m = {k: v for k, v in m.items() if v is not None}  # Parquet structs carry every key, unset ones null
    unknown = sorted(set(m) - MESSAGE_FIELDS)
    if unknown:
        raise _Reject(f"{where}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(MESSAGE_FIELDS))})")
    role = m.get("role")
    if role not in ROLES:
        raise _Reject(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in m and not isinstance(m[key], str):
            raise _Reject(f"{where}.{key}", f"expected a string, got {type(m[key]).__name__}")
    if "tool_calls" in m:
        if role != "assistant":
            raise _Reject(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {role!r}")
        if not isinstance(m["tool_calls"], list):
            raise _Reject(f"{where}.tool_calls", f"expected a list, got {type(m['tool_calls']).__name__}")
        m["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(m["tool_calls"])]
        if not m["tool_calls"]:
            del m["tool_calls"]
    if "content" not in m:
        if role != "assistant" or "tool_calls" not in m:
            raise _Reject(f"{where}.content", "missing")
    else:
        m["content"] = _content(m["content"], f"{where}.content", images=role == "user")
    if role == "tool" and "tool_call_id" not in m:
        raise _Reject(f"{where}.tool_call_id", "missing on a tool message")
    return m


def _content(content: Any, where: str, *, images: bool = False) -> str | list[dict[str, Any]]:
    """A message's content: a string, or text parts and (`images`: user messages) OpenAI
    `image_url` parts, whose url `_store_images` resolves."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _Reject(where, f"expected a string or a list of text parts, got {type(content).__name__}")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and images:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url  # some datasets give the url as a string
            if not isinstance(url, str) or not url:
                raise _Reject(f"{where}[{i}].image_url.url", "missing or not a string")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            allowed = "text and image_url" if images else "text"
            raise _Reject(f"{where}[{i}]", f"only {allowed} parts are supported here, got {kind!r}")
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict):
        raise _Reject(where, f"expected an object, got {type(c).__name__}")
    fn = c.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _Reject(f"{where}.function.name", "missing or not a string")
    args = fn.get("arguments")
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise _Reject(f"{where}.function.arguments", f"expected a JSON string, got {type(args).__name__}")
    parsed = _json_field(args, f"{where}.function.arguments", f"not valid JSON: {args[:80]!r}")
    if not isinstance(parsed, dict):
        raise _Reject(f"{where}.function.arguments", f"must be a JSON object, got {type(parsed).__name__}")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if c.get("id") is not None:
        if not isinstance(c["id"], str):
            raise _Reject(f"{where}.id", f"expected a string, got {type(c['id']).__name__}")
        out["id"] = c["id"]
    return out


_json_field = prompt_layouts.loads_field  # a field holding JSON as a string, parsed like a line


def _tool(t: Any, where: str) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise _Reject(where, "expected {'type': 'function', 'function': {...}}")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _Reject(f"{where}.function.name", "missing or not a string")
    if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
        raise _Reject(f"{where}.function.description", f"expected a string, got {type(fn['description']).__name__}")
    params = fn.get("parameters")
    if isinstance(params, str):
        params = _json_field(params, f"{where}.function.parameters")
    if params is not None and not isinstance(params, dict):
        raise _Reject(f"{where}.function.parameters", f"expected a JSON Schema object, got {type(params).__name__}")
    out_fn = {k: v for k, v in fn.items() if v is not None}
    if params is not None:
        out_fn["parameters"] = params
    return {"type": "function", "function": out_fn}


def _read_records(f: PromptFile, client, digest) -> Iterator[tuple[int, str, Any]]:
    """(line number, raw text, parsed object or None) per row, a line (a Parquet batch) at a time;
    feeds `digest` with the file's bytes."""
    with _open(f, client) as fh:
        if f.uri.endswith((".parquet", ".arrow")):
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
            fh.seek(0)
            line = 0
            for batch in _table_batches(f, fh):
                for row in batch.to_pylist():
                    line += 1
                    try:
                        json_records.check_value(row)
                    except json_records.JsonRefused as exc:
                        yield line, json.dumps(row, default=str)[:_RAW_LIMIT], _Reject(exc.field, exc.reason)
                        continue
                    yield line, json.dumps(row, ensure_ascii=False, default=str), row
            return
        for line, raw_bytes in enumerate(fh, start=1):
            digest.update(raw_bytes)
            raw_bytes = raw_bytes.removesuffix(b"\n")
            try:
                raw = raw_bytes.decode("utf-8")
            except UnicodeDecodeError as exc:  # rejected, never "repaired" to U+FFFD and paid for
                yield (
                    line,
                    raw_bytes.decode("utf-8", errors="replace"),
                    _Reject("", f"invalid UTF-8 at byte {exc.start} of the line"),
                )
                continue
            if not raw.strip():
                continue
            try:
                yield line, raw, json_records.loads(raw)
            except json_records.JsonRefused as exc:
                yield line, raw, _Reject(exc.field, exc.reason)
            except ValueError:
                yield line, raw, None


def _table_batches(f: PromptFile, fh) -> Iterator[pa.RecordBatch]:
    """Record batches of a Parquet file, or of an Arrow IPC stream (what `datasets` writes; the
    IPC file format is read too)."""
    import pyarrow.ipc
    import pyarrow.parquet as pq

    kind = "Parquet" if f.uri.endswith(".parquet") else "Arrow"
    try:
        if kind == "Parquet":
            yield from pq.ParquetFile(fh).iter_batches(batch_size=1024)
            return
        try:
            reader = pyarrow.ipc.open_stream(fh)
        except pa.ArrowInvalid:
            fh.seek(0)
            file_reader = pyarrow.ipc.open_file(fh)
            yield from (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
            return
        yield from reader
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{f.uri}: not a readable {kind} file ({exc})") from None


def _open(f: PromptFile, client):
    """The file for reading: a local one as it is; an S3 object streamed into a spooled temp
    file first (RAM up to 8 MiB, then disk), never held whole in memory."""
    if f.path is not None:
        return f.path.open("rb")
    from eagle3_data.storage.client import s3_errors

    out = tempfile.SpooledTemporaryFile(max_size=8 << 20)  # noqa: SIM115 (returned open)
    try:
        with s3_errors(client, f"reading {f.uri}"):
            body = client.get_object(Bucket=f.bucket, Key=f.key)["Body"]
            for chunk in iter(lambda: body.read(1 << 20), b""):
                out.write(chunk)
    except BaseException:
        out.close()  # a read that failed part-way must not leave the spilled file behind
        raise
    out.seek(0)
    return out
