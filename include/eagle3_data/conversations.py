"""Conversations regenerated turn after turn: `every_turn` on the regenerated history, and `trajectory`.

`final_turn` and `every_turn` on the dataset's own history know every prompt before the first
request. These two modes do not: a turn's prompt holds the answers generated before it. A
generation stage in these modes is run in rounds inside one StageRun (one lease, one journal,
one set of parts): each round asks for the next turn of every conversation still going, as one
batch, and its answers decide the next round's prompts. Every turn is a generation row of its
own (its id `step_id`: a hash chain over its prompt), so it is checkpointed, gated, billed and
never paid twice like any sample; a resumed attempt rebuilds where each conversation stands
from the committed and journaled rows.

A *thread* is a chain of turns that depend on each other:
  every_turn, history regenerated   one per row: each user turn answered after the answers
                                    generated before it; a turn that calls tools (there is no
                                    result to give it) or is cut ends the thread;
  trajectory, history dataset       one per user turn of a row, after the row's own history;
  trajectory, history regenerated   one per row, its user turns in order after the trajectories
                                    generated before them.
In a trajectory the model's tool calls are answered from the row's recorded ones: a call whose
name and JSON-equal arguments match a recorded call gets that call's result (parallel calls
each theirs) and the model goes on. A recorded result is the one its tool message gives the call
it answers in the assistant message right before it (`pair_results`), never looked
up by id across the row: datasets reuse ids (`call_0` in every turn). Each recorded result
answers one regenerated call, in order of appearance from the thread's first user turn on (then
the row's earlier ones): a call polled twice with two recorded results gets the first, then the
second; a third identical call has none left. The first call with no recorded result left ends
the trajectory there (`unmatched_call`), as does an answer without calls (`answered`), a cut one
(`length`), a failed turn (`failed`) and `max_steps` turns.

A *sample* is what the model saw: one per user turn. In a trajectory it is the history as
rendered at its start, then every generated turn, tool result and the final answer: the last
turn's prompt (Kimi's template keeps the reasoning of the turns of the current tool-call
trajectory, so every turn's prompt starts with the one before it; `prefix_ok` records that it
did) plus its output, with loss mask 1 exactly on the generated spans. The stage commits the
samples beside its parts (`SAMPLES_FILE`); the merge folds each trajectory's turn rows into its
one record (`trajectory_folds` plans it, `Folds.apply` applies it to each row), the report shows
the figures (`Tally`).

This module is the one place for what the stages share about conversations: the prompt loader
re-keys tool results to their calls and the rounds splice recorded results by `pair_results`,
the generation stage runs the rounds, the merge folds the turn rows.
"""

from __future__ import annotations

import hashlib
import io
import json
from array import array
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.canonical import canonical_json
from eagle3_data.errors import UserError
from eagle3_data.images import refs_for
from eagle3_data.prompt_layouts import LayoutRefused

if TYPE_CHECKING:
    from eagle3_data.chat_format.base import OutputFormat

SAMPLES_FILE = "conversation_samples.parquet"
SAMPLES_BATCH = 4096  # rows per row group of the SAMPLES file: what `samples_file` holds at once
END_REASONS = ("answered", "unmatched_call", "tool_calls", "length", "failed", "max_steps")
SAMPLES = pa.schema(
    [
        ("sample_id", pa.string()),  # the merged record's id
        ("conversation", pa.string()),  # the prompt row's sample id
        ("user_turn", pa.int32()),  # which user turn of the row (0-based)
        ("steps", pa.list_(pa.string())),  # the turns' generation row ids, in order
        ("end", pa.string()),  # END_REASONS
        ("splice_hits", pa.int32()),  # tool calls answered from the recorded results
        ("splice_misses", pa.int32()),  # tool calls with no recorded result (0 or the ending turn's)
        ("unmatched", pa.string()),  # the first call with no recorded result: {"name", "arguments"}, else null
        ("base", pa.int32()),  # tokens of the first turn's prompt: the record's prompt part
        (
            "masked",
            pa.list_(pa.int32()),
        ),  # [start, end) pairs after `base` that are not generated (tool results, headers)
        ("prefix_ok", pa.bool_()),  # every turn's prompt starts with the one before it
        (
            "exact_turns",
            pa.int32(),
        ),  # earlier turns whose engine ids equal their render in the last prompt (null: text only)
        ("turns_left", pa.int32()),  # user turns of the row not reached (the thread ended before them)
    ]
)


def needs_rounds(regenerate: str, history: str) -> bool:
    """Whether a turn's prompt depends on answers generated in the same stage."""
    return regenerate == "trajectory" or (regenerate == "every_turn" and history == "regenerated")


def step_id(before: str, appended: list[dict[str, Any]]) -> str:
    """A turn's generation row id: a hash chain over its prompt, `before` the id of the turn
    before it (or the thread's root: the row's sample id, the mode, the thread), `appended` the
    messages its prompt adds to that turn's. The id thus covers the whole prompt: a calibration
    conversation (route `both`) whose two paths answered differently asks each path for turns
    with other ids, so the calibration compares only answers to one prompt."""
    return hashlib.sha256(canonical_json({"after": before, "messages": appended}).encode()).hexdigest()[:32]


def sample_of(conversation: str, mode: str, thread: int, user_turn: int) -> str:
    key = canonical_json({"conversation": conversation, "mode": mode, "thread": thread, "user_turn": user_turn})
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def call_key(call: Mapping[str, Any]) -> tuple[str, str] | None:
    """A tool call's name and its arguments as canonical JSON (so `{"a":1, "b":2}` and
    `{"b": 2, "a": 1}` are one call); None when the arguments are not JSON."""
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return None
    return str(fn.get("name")), canonical_json(parsed)


def pair_results(messages: list[dict[str, Any]], where: str = "messages") -> dict[int, tuple[int, int]]:
    """Which call each tool message answers: its index -> (index of the assistant message, index of
    the call in it). A run of tool messages answers the calls of the assistant message right before
    it: first the results whose `tool_call_id` names one of its calls (each call answered once),
    then the others take its calls still unanswered, in order. Calls may go unanswered (the
    template renders them as they are); a result that answers none is refused, naming it (`where`:
    the messages as the row's layout names them). Datasets reuse ids (`call_0` in every turn), so
    an id is never looked up across the conversation. The loader re-keys each result to its call's
    new id by it (prompts.load), a trajectory splices the recorded results by it (`recorded_results`)."""
    out: dict[int, tuple[int, int]] = {}
    i = 0
    while i < len(messages):
        if messages[i]["role"] != "tool":
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        owner = i - 1
        calls = messages[owner].get("tool_calls") or [] if owner >= 0 else []
        if not calls:
            raise LayoutRefused(f"{where}[{i}].role", "a tool result with no assistant tool call right before it")
        free = list(range(len(calls)))
        for j in range(i, end):
            k = next((k for k in free if calls[k].get("id") == messages[j]["tool_call_id"]), None)
            if k is not None:
                free.remove(k)
                out[j] = (owner, k)
        for j in range(i, end):
            if j in out:
                continue
            if not free:
                raise LayoutRefused(
                    f"{where}[{j}].tool_call_id",
                    f"{messages[j]['tool_call_id']!r} answers no call of {where}[{owner}]: "
                    f"its {len(calls)} call(s) have their results already",
                )
            out[j] = (owner, free.pop(0))
        i = end
    return out


def recorded_results(messages: list[dict[str, Any]], start: int = 0) -> dict[tuple[str, str], deque[Any]]:
    """The recorded results by `call_key`, each key's in the order a walk from message `start`
    meets its calls: the calls from `start` on first, then the row's earlier ones (the history a
    thread starting there was given). A walk takes each result once (`popleft`)."""
    out: dict[tuple[str, str], deque[Any]] = {}
    answered = sorted(pair_results(messages).items(), key=lambda a: (a[1][0] < start, a[1]))
    for j, (i, k) in answered:
        key = call_key(messages[i]["tool_calls"][k])
        if key is not None:
            out.setdefault(key, deque()).append(messages[j].get("content"))
    return out


@dataclass
class Turn:
    """What a walk needs of one turn's generation row."""

    status: str
    finish_reason: str | None
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] | None
    output_len: int | None  # engine ids (None: text only, the overflow path)
    output_sha: str | None
    prompt_len: int | None = None  # the row's prompt ids (the render the engine was given), when it has them
    prompt_sha: str | None = None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Turn:
        calls = row.get("tool_calls")
        ids = row.get("output_ids")
        prompt = row.get("prompt_ids")
        return cls(
            row["status"],
            row.get("finish_reason"),
            row.get("content"),
            row.get("reasoning"),
            json.loads(calls) if isinstance(calls, str) else calls,
            None if ids is None else len(ids),
            None if ids is None else _ids_sha(ids),
            None if prompt is None else len(prompt),
            None if prompt is None else _prompt_sha(prompt),
        )

    def message(self) -> dict[str, Any]:
        """The assistant message the next prompt holds (the template renders it)."""
        m: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


def _ids_sha(ids: Iterable[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def _prompt_sha(ids: Iterable[int]) -> str:
    return hashlib.sha256(array("q", ids).tobytes()).hexdigest()


@dataclass(frozen=True, slots=True)
class Pair:
    """What a sample row needs of two consecutive turns of a sample (`after` the one whose prompt
    follows `parent`'s answer), read off `after`'s prompt ids once, when its row is observed:
    whether it starts with `parent`'s prompt, where the answer's span in it ends (after its first
    stop token, else the prompt's end), and whether the answer's render equals the engine's ids."""

    parent: str
    prefix_ok: bool
    end: int
    length: int
    exact: bool


class _Spans(NamedTuple):
    """A sample's SAMPLES columns that its turns' prompt ids give (`TurnDriver._sample_row`)."""

    base: int  # tokens of the first turn's prompt
    masked: list[int]  # [start, end) pairs after `base` that are not generated
    prefix_ok: bool  # every turn's prompt starts with the one before it
    exact_turns: int  # earlier turns whose engine ids equal their render in the next prompt


class PromptRow(Protocol):
    """What the rounds read of one prompt row (stages.generate.checkpoint.Prompt)."""

    sample_id: str
    dataset: str
    route: str | None
    source_id: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tools_json: str | None

    @property
    def images(self) -> list[dict[str, Any]]: ...


@dataclass
class Sample:
    user_turn: int
    steps: list[str] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)  # messages in each turn's prompt
    end: str | None = None
    hits: int = 0
    misses: int = 0
    unmatched: dict[str, Any] | None = None


@dataclass
class Walk:
    """Where one thread stands: its samples so far, its messages, and the turn it waits for
    (`pending`: its step id; `messages` are then its prompt) or None when it has ended."""

    samples: list[Sample]
    messages: list[dict[str, Any]]
    pending: str | None
    turns_left: int = 0
    parent: str | None = None  # the pending turn's previous turn in its sample (None: the sample's first)


class TurnDriver:
    """The rounds of one stage: `start(conversations)`, then `observe(row)` for every final turn
    row (committed, replayed or new), `next_prompts()` for each round, and `samples_file()` (the
    SAMPLES file and its figures) at the end."""

    def __init__(self, mode: str, history: str, fmt: OutputFormat, *, max_steps: int = 8):
        if not needs_rounds(mode, history):
            raise ValueError(f"regenerate {mode!r} with history {history!r} needs no rounds")
        self.mode, self.history, self.fmt, self.max_steps = mode, history, fmt, max_steps
        self.tag = f"{mode}/{history}"
        self.turns: dict[str, Turn] = {}
        self.asked: set[str] = set()
        self._ids: dict[tuple[str, int], str] = {}  # (id before, messages in the prompt) -> step id
        # a turn asked for after an earlier turn of its sample -> that turn; its row is then read once
        # into a Pair (`observe`), so the samples file needs no second render of the prompts
        self._parents: dict[str, str] = {}
        self._pairs: dict[str, Pair] = {}
        self.conversations: Iterable[PromptRow] | None = None  # `start`

    def start(self, conversations: Iterable[PromptRow]) -> None:
        """`conversations`: the stage's prompt rows (stages.generate.checkpoint.Prompts), one per row."""
        self.conversations = conversations

    def observe(self, row: Mapping[str, Any]) -> None:
        sid = row["sample_id"]
        turn = self.turns[sid] = Turn.of(row)
        parent = self._parents.pop(sid, None)
        up = self.turns.get(parent) if parent is not None else None
        if (
            parent is not None
            and up is not None
            and up.prompt_sha is not None
            and turn.status == "ok"
            and row.get("prompt_ids") is not None
        ):
            self._pairs[sid] = self._pair(parent, up, row["prompt_ids"])

    def _pair(self, parent: str, here: Turn, after: Sequence[int]) -> Pair:
        """`after` (a turn's prompt ids) against its sample's previous turn `here`, as `_sample_row`'s
        render of both compares them."""
        n, stops = here.prompt_len, set(self.fmt.stop_token_ids)
        assert n is not None, "a turn with a prompt_sha has its prompt_len"
        after = after if isinstance(after, list) else list(after)
        end = next((i + 1 for i in range(n, len(after)) if after[i] in stops), len(after))
        exact = (
            here.output_sha is not None
            and here.output_len is not None
            and _ids_sha(after[n : n + here.output_len]) == here.output_sha
        )
        return Pair(parent, _prompt_sha(after[:n]) == here.prompt_sha, end, len(after), exact)

    # -- walking -------------------------------------------------------------------------------
    def threads(self, p: PromptRow) -> Iterator[tuple[int, int]]:
        """(thread number, index of the user message it starts at) of one conversation."""
        users = [i for i, m in enumerate(p.messages) if m["role"] == "user"]
        if self.mode == "trajectory" and self.history == "dataset":
            yield from enumerate(users)
        elif users:
            yield 0, users[0]

    def walk(self, p: PromptRow, thread: int, start: int) -> Walk:
        users = [i for i, m in enumerate(p.messages) if m["role"] == "user" and i >= start]
        if self.history == "dataset":
            users = users[:1]
        recorded = recorded_results(p.messages, start) if self.mode == "trajectory" else {}
        messages = list(p.messages[: start + 1])
        samples: list[Sample] = []
        before, since = canonical_json([p.sample_id, self.tag, thread]), 0
        for u, at in enumerate(users):
            if u:  # the next user turn after the generated answer, with any system message before it
                first = at
                while first - 1 > users[u - 1] and p.messages[first - 1]["role"] == "system":
                    first -= 1
                messages += p.messages[first : at + 1]
            sample = Sample(user_turn=_user_index(p.messages, at))
            samples.append(sample)
            while sample.end is None:
                sid = self._ids.get((before, len(messages)))
                if sid is None:  # each id is hashed once: a walk in a later round looks it up
                    sid = self._ids[before, len(messages)] = step_id(before, messages[since:])
                turn = self.turns.get(sid)
                if turn is None:
                    return Walk(samples, messages, sid, len(users) - u - 1, sample.steps[-1] if sample.steps else None)
                before, since = sid, len(messages)
                if turn.status != "ok":  # the sample is the turns before it
                    sample.end = "failed"
                    break
                sample.steps.append(sid)
                sample.prompt_lens.append(len(messages))
                sample.end = self._advance(sample, turn, messages, recorded)
            if sample.end != "answered":
                return Walk(samples, messages, None, len(users) - u - 1)
        return Walk(samples, messages, None)

    def _advance(
        self, sample: Sample, turn: Turn, messages: list[dict[str, Any]], recorded: dict[tuple[str, str], deque[Any]]
    ) -> str | None:
        """Append what follows `turn` (an ok one) to `messages`, taking the results its calls get
        from `recorded`; the sample's end reason, or None to go on."""
        messages.append(turn.message())
        if turn.finish_reason == "length":
            return "length"
        if not turn.tool_calls:
            return "answered"
        if self.mode != "trajectory":
            return "tool_calls"
        results = [
            queue.popleft() if (key := call_key(c)) is not None and (queue := recorded.get(key)) else _MISSING
            for c in turn.tool_calls
        ]
        missed = [c for c, r in zip(turn.tool_calls, results) if r is _MISSING]
        if missed:  # nothing is spliced: the trajectory ends at this turn
            sample.misses += len(missed)
            fn = missed[0].get("function") or {}
            sample.unmatched = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            return "unmatched_call"
        sample.hits += len(results)
        if len(sample.steps) >= self.max_steps:
            return "max_steps"
        messages += [
            {"role": "tool", "tool_call_id": c.get("id") or "", "content": r} for c, r in zip(turn.tool_calls, results)
        ]
        return None

    def walks(self) -> Iterator[tuple[PromptRow, int, Walk]]:
        assert self.conversations is not None, "`start` gives the conversations before a walk"
        for p in self.conversations:
            for thread, start in self.threads(p):
                yield p, thread, self.walk(p, thread, start)

    def next_prompts(self) -> list[dict[str, Any]]:
        """The prompt rows of the next turn of every thread still going and not asked for yet
        (a turn asked and not final yet, a retryable failure, is left to the next attempt)."""
        out = []
        for p, _, w in self.walks():
            if w.pending is None or w.pending in self.asked:
                continue
            self.asked.add(w.pending)
            if w.parent is not None:
                self._parents[w.pending] = w.parent
            out.append(
                {
                    "sample_id": w.pending,
                    "dataset": p.dataset,
                    "route": p.route,
                    "source_id": p.source_id,
                    "messages": canonical_json(w.messages),
                    "tools": p.tools_json if p.tools else None,
                }
            )
        return out

    # -- the samples ---------------------------------------------------------------------------
    def sample_rows(self) -> Iterator[dict[str, Any]]:
        """One SAMPLES row per sample that got an answer (one whose first turn failed too: a sample
        lost, counted), its mask spans from the template's render of each turn's prompt (the
        prompts the engine was given)."""
        for p, thread, w in self.walks():
            for s in w.samples:
                if s.steps or s.end == "failed":  # a first turn that failed is a sample lost: counted
                    yield self._sample_row(p, thread, w, s)

    def _sample_row(self, p: PromptRow, thread: int, w: Walk, s: Sample) -> dict[str, Any]:
        found = [self._pairs.get(sid) for sid in s.steps[1:]]
        pairs = [pair for pair in found if pair is not None]
        base = self.turns[s.steps[0]].prompt_len if s.steps else None
        if (
            base is not None
            and len(pairs) == len(found)
            and all(pair.parent == s.steps[j] for j, pair in enumerate(pairs))
        ):
            # the rows' own prompt ids, read once as they were observed
            masked: list[int] = []
            for pair in pairs:
                masked += [pair.end - base, pair.length - base]
            spans = _Spans(base, masked, all(pair.prefix_ok for pair in pairs), sum(pair.exact for pair in pairs))
        else:  # rows observed before their turn was asked for in this process (a resumed stage): rendered
            spans = self._rendered(p, w, s)
        last = self.turns[s.steps[-1]] if s.steps else None
        return {
            "sample_id": sample_of(p.sample_id, self.tag, thread, s.user_turn),
            "conversation": p.sample_id,
            "user_turn": s.user_turn,
            "steps": s.steps,
            "end": s.end,
            "splice_hits": s.hits,
            "splice_misses": s.misses,
            "unmatched": json.dumps(s.unmatched, ensure_ascii=False) if s.unmatched else None,
            "base": spans.base,
            "masked": spans.masked,
            "prefix_ok": spans.prefix_ok,
            "exact_turns": spans.exact_turns if last is not None and last.output_sha is not None else None,
            "turns_left": w.turns_left if s is w.samples[-1] else 0,
        }

    def _rendered(self, p: PromptRow, w: Walk, s: Sample) -> _Spans:
        renders = [
            self.fmt.generation_prompt_ids(w.messages[:n], p.tools, refs_for(w.messages[:n], p.images))
            for n in s.prompt_lens
        ]
        stops = set(self.fmt.stop_token_ids)
        base, masked, prefix_ok, exact = len(renders[0]) if renders else 0, [], True, 0
        for j in range(len(renders) - 1):
            here, after = renders[j], renders[j + 1]
            prefix_ok &= after[: len(here)] == here
            end = next((i + 1 for i in range(len(here), len(after)) if after[i] in stops), len(after))
            masked += [end - base, len(after) - base]
            turn = self.turns[s.steps[j]]
            if (
                turn.output_sha is not None
                and turn.output_len is not None
                and _ids_sha(after[len(here) : len(here) + turn.output_len]) == turn.output_sha
            ):
                exact += 1
        return _Spans(base, masked, prefix_ok, exact)

    def samples_file(self) -> tuple[bytes, dict[str, Any]]:
        """The SAMPLES Parquet file and its figures (for the manifest and the report), written
        SAMPLES_BATCH rows at a time: beside the driver it holds one batch of rows and the file's
        bytes, not every sample's row (a Python dict each) and their table at once."""
        buf, tally, rows = io.BytesIO(), Tally(), self.sample_rows()
        with pq.ParquetWriter(buf, SAMPLES) as writer:  # (leaves `buf` open)
            while batch := list(islice(rows, SAMPLES_BATCH)):
                writer.write_table(pa.Table.from_pylist(batch, schema=SAMPLES))
                tally.add(batch)
        return buf.getvalue(), tally.figures(self.tag)


_MISSING = object()


def _user_index(messages: list[dict[str, Any]], at: int) -> int:
    return sum(m["role"] == "user" for m in messages[:at])


class Tally:
    """What the report shows of a stage's samples, counted a batch at a time: how many, turns per
    sample, why they ended, the splices, and whether every turn's prompt started with the one
    before it."""

    def __init__(self) -> None:
        self.steps: Counter[int] = Counter()
        self.ends: Counter[str] = Counter()
        self.sums: Counter[str] = Counter()

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        for r in rows:
            n = len(r["steps"])
            self.steps[n] += 1
            self.ends[r["end"]] += 1
            self.sums.update(
                samples=1,
                turns=n,
                splice_hits=r["splice_hits"],
                splice_misses=r["splice_misses"],
                not_prefix=not r["prefix_ok"],
                exact_turns=r["exact_turns"] or 0,
                earlier_turns=n - 1,
                user_turns_not_reached=r["turns_left"],
            )

    def figures(self, tag: str) -> dict[str, Any]:
        s = self.sums
        return {
            "mode": tag,
            "samples": s["samples"],
            "turns": s["turns"],
            "turns_per_sample": {str(k): v for k, v in sorted(self.steps.items())},
            "end": {k: self.ends[k] for k in END_REASONS if self.ends[k]},
            **{
                k: s[k]
                for k in (
                    "splice_hits",
                    "splice_misses",
                    "not_prefix",
                    "exact_turns",
                    "earlier_turns",
                    "user_turns_not_reached",
                )
            },
        }


def read_samples(data: bytes) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = pq.read_table(io.BytesIO(data), schema=SAMPLES).to_pylist()
    return rows


FOLDED, DROPPED, OWN = "folded", "dropped", "own"  # what the merge does with a turn row (`Folds.rows`)


@dataclass(frozen=True, slots=True)
class TrajectoryRecord:
    """The record a sample's last usable turn row becomes (`Folds.rows`)."""

    sample_id: str  # the sample's (SAMPLES), which the record takes
    base: int  # tokens of the first turn's prompt: the record's prompt part
    masked: list[int]  # [start, end) pairs after `base` that are not generated, one per transition kept
    trajectory: dict[str, Any]  # for the record's provenance: turns kept, turns generated, end (and what cut it)


@dataclass(frozen=True, slots=True)
class TurnRow:
    """An ok generation row as the merge takes it (`Folds.apply`)."""

    sample_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    provenance: str | None
    masked: list[int] | None = None  # [start, end) output positions that are not generated; None: none


@dataclass
class Folds:
    """The merge's plan for one stage's trajectory turn rows (`trajectory_folds`).

    `rows`: each turn row id -> the record it becomes (TrajectoryRecord), or FOLDED (its tokens
    are in a later turn's record), DROPPED (unusable, or after an unusable turn of its sample) or
    OWN (a sample whose prompts did not chain: the row is a record of its own). `counts`: the
    samples and turn rows in, and what became of each sample (kept whole, kept cut, dropped,
    unfolded, and the status that cut or dropped it), so that the merge manifest's figures can
    be added up."""

    rows: dict[str, TrajectoryRecord | str] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def apply(self, row: TurnRow, counts: Counter[str]) -> TurnRow | None:
        """`row` with its fold applied: None for a turn row left out (FOLDED: its tokens are in
        the record's prompt; DROPPED); a sample's last usable turn becomes its record (prompt =
        the first turn's prompt, output = the rest, with the spans that are not generated; its
        provenance says how many turns it keeps and why the trajectory ended); any other row is
        kept as it is. Each turn row is counted in `counts` (its dataset's figures) as folded,
        record or dropped, so that the manifest's turn rows add up."""
        plan = self.rows.get(row.sample_id)
        if plan in (FOLDED, DROPPED):
            counts[f"trajectory_turns_{plan}"] += 1
            return None
        counts["trajectory_turns_record"] += plan is not None
        if not isinstance(plan, TrajectoryRecord):  # no trajectory's, or OWN
            return row
        provenance = {
            **(json.loads(row.provenance) if row.provenance else {}),
            "turn_id": row.sample_id,
            "trajectory": plan.trajectory,
        }
        return TurnRow(
            sample_id=plan.sample_id,
            prompt_ids=row.prompt_ids[: plan.base],
            output_ids=row.prompt_ids[plan.base :] + row.output_ids,
            provenance=json.dumps(provenance, sort_keys=True),
            masked=list(plan.masked) or None,
        )


def trajectory_folds(
    samples: Iterable[dict[str, Any]], rows: Mapping[str, tuple[str, str | None]] | None = None
) -> Folds:
    """For the merge: each sample folded into one record made of its turns up to its last usable
    one. `rows`: the status and error of every row of the stage whose ids the merge takes (the
    local stage, or the reconstruct stage for the overflow path), by row id; None: every turn
    is usable. A turn is usable when its row is `ok` there: the reconstruct stage may mark a turn
    the generation stage answered `unreconstructable` (a length cut with tools offered), and an
    answer from another model is `identity_mismatch`. Such a turn and every turn after it are
    dropped (a later turn's prompt holds the unusable answer as if it were the target's); the
    turns before it still make a record: the last usable turn's prompt plus its output, with
    the mask spans of its own transitions (`masked` holds one [start, end) pair per transition,
    so the first k-1 pairs are those of the first k turns). A sample with no usable turn is
    dropped. Counting these here, not only the rows, is what lets the manifest's figures add up:
    samples = whole + cut + dropped + unfolded."""
    out = Folds()
    for s in samples:
        steps = list(s["steps"])
        out.counts["trajectory_samples"] += 1
        out.counts["trajectory_turns"] += len(steps)
        if not steps:  # its first turn failed: nothing was generated to train on
            out.counts["trajectory_samples_dropped"] += 1
            out.counts[f"trajectory_dropped_{s['end']}"] += 1
            continue
        if shared := set(steps) & out.rows.keys():  # a turn row is one sample's: never folded twice
            raise UserError(
                f"sample {s['sample_id']}: turn rows {sorted(shared)[:3]} belong to another sample too "
                f"({SAMPLES_FILE} of another version?): rerun the generation stage"
            )
        status = [("ok", None) if rows is None else rows.get(sid, ("missing", None)) for sid in steps]
        usable = next((j for j, (st, _) in enumerate(status) if st != "ok"), len(steps))
        if not s["prefix_ok"]:  # each usable turn a record of its own
            out.counts["trajectory_samples_unfolded"] += 1
            out.rows.update({sid: OWN if j < usable else DROPPED for j, sid in enumerate(steps)})
            continue
        out.rows.update({sid: FOLDED if j < usable - 1 else DROPPED for j, sid in enumerate(steps)})
        if not usable:
            out.counts["trajectory_samples_dropped"] += 1
            out.counts[f"trajectory_dropped_{status[0][0]}"] += 1
            continue
        cut = usable < len(steps)
        end = f"cut_{status[usable][0]}" if cut else s["end"]
        out.counts["trajectory_samples_cut" if cut else "trajectory_samples_whole"] += 1
        if cut:
            out.counts[f"trajectory_cut_{status[usable][0]}"] += 1
        out.rows[steps[usable - 1]] = TrajectoryRecord(
            sample_id=s["sample_id"],
            base=s["base"],
            masked=list(s["masked"])[: 2 * (usable - 1)],
            trajectory={
                "turns": usable,
                "generated_turns": len(steps),
                "end": end,
                **({"cut_by": steps[usable], "cut_error": status[usable][1]} if cut else {}),
            },
        )
    return out
