"""The turn driver's walk (conversations) on hand-made turn rows: which call gets which
recorded result, when a trajectory ends and why, what a regenerated history holds, and that a
resumed driver (the same rows observed again) asks for exactly the turns not yet answered."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eagle3_data.conversations import (
    FOLDED,
    OWN,
    TrajectoryRecord,
    TurnDriver,
    TurnRow,
    call_key,
    needs_rounds,
    recorded_results,
    trajectory_folds,
)
from eagle3_data.stages.generate.checkpoint import parse_prompts

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ROW = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Lisbon and Porto?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lisbon", "unit": "C"}'},
            },
            {
                "id": "functions.get_weather:1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Porto", "unit": "C"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "21 clear"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "17 cloudy"},
    {"role": "assistant", "content": "Lisbon 21, Porto 17."},
    {"role": "user", "content": "and tomorrow?"},
]


def _driver(mode="trajectory", history="dataset", max_steps=8, row=ROW) -> TurnDriver:
    d = TurnDriver(mode, history, fmt=None, max_steps=max_steps)
    d.start(
        parse_prompts(
            [
                {
                    "sample_id": "conv",
                    "dataset": "d",
                    "messages": json.dumps(row),
                    "tools": json.dumps(WEATHER),
                    "route": "local",
                }
            ],
            "d",
            None,
        )
    )
    return d


def _call(i: int, args: str) -> dict:
    return {
        "id": f"functions.get_weather:{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": args},
    }


def _answer(sid: str, content="ok", calls=None, finish="stop", status="ok") -> dict:
    return {
        "sample_id": sid,
        "status": status,
        "finish_reason": finish,
        "content": content,
        "reasoning": "r",
        "tool_calls": json.dumps(calls) if calls else None,
        "output_ids": [1, 2, 3],
    }


def _prompt(rows: list[dict], sid: str) -> list[dict]:
    return json.loads(next(r for r in rows if r["sample_id"] == sid)["messages"])


def test_calls_match_by_name_and_json_equal_arguments():
    assert call_key(_call(0, '{"unit":"C","city":"Lisbon"}')) == call_key(_call(5, '{"city": "Lisbon", "unit": "C"}'))
    assert call_key(_call(0, '{"city": "Lisbon"}')) != call_key(_call(0, '{"city": "Lisbon", "unit": "C"}'))
    assert call_key(_call(0, "not json")) is None
    assert {k: list(v) for k, v in recorded_results(ROW).items()} == {
        call_key(_call(0, '{"city":"Lisbon","unit":"C"}')): ["21 clear"],
        call_key(_call(0, '{"city":"Porto","unit":"C"}')): ["17 cloudy"],
    }
    assert needs_rounds("trajectory", "dataset") and needs_rounds("every_turn", "regenerated")
    assert not needs_rounds("every_turn", "dataset") and not needs_rounds("final_turn", "regenerated")


def test_parallel_calls_get_their_own_results_in_call_order_and_the_trajectory_goes_on():
    d = _driver()
    first = d.next_prompts()
    assert len(first) == 2  # history dataset: one trajectory per user turn, both start at once
    t0 = next(r for r in first if len(json.loads(r["messages"])) == 2)
    assert _prompt(first, t0["sample_id"]) == ROW[:2]
    # the model calls Porto first, then Lisbon, with its own key order and spacing
    calls = [_call(0, '{"unit": "C", "city": "Porto"}'), _call(1, '{"city":"Lisbon","unit":"C"}')]
    d.observe(_answer(t0["sample_id"], content="looking", calls=calls))
    second = d.next_prompts()
    assert len(second) == 1 and d.next_prompts() == []  # a turn is asked for once
    messages = _prompt(second, second[0]["sample_id"])
    assert messages[:2] == ROW[:2]
    assert messages[2] == {"role": "assistant", "content": "looking", "reasoning_content": "r", "tool_calls": calls}
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "17 cloudy"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "21 clear"},
    ]
    d.observe(_answer(second[0]["sample_id"], content="done"))
    walks = {w.samples[0].user_turn: w for _, _, w in d.walks()}
    s = walks[0].samples[0]
    assert (s.end, s.hits, s.misses, len(s.steps)) == ("answered", 2, 0, 2) and walks[0].pending is None


def test_one_unmatched_call_ends_the_trajectory_without_splicing_the_others():
    d = _driver()
    t0 = next(r for r in d.next_prompts() if len(json.loads(r["messages"])) == 2)
    d.observe(
        _answer(t0["sample_id"], calls=[_call(0, '{"city": "Lisbon", "unit": "C"}'), _call(1, '{"city": "Faro"}')])
    )
    assert d.next_prompts() == []
    s = next(w for _, _, w in d.walks() if w.samples[0].user_turn == 0).samples[0]
    assert (s.end, s.hits, s.misses) == ("unmatched_call", 0, 1)
    assert s.unmatched == {"name": "get_weather", "arguments": '{"city": "Faro"}'}


@pytest.mark.parametrize(
    "finish,status,calls,end",
    [("length", "ok", None, "length"), ("stop", "failed", None, "failed"), ("stop", "ok", None, "answered")],
)
def test_why_a_trajectory_ends(finish, status, calls, end):
    d = _driver()
    t0 = next(r for r in d.next_prompts() if len(json.loads(r["messages"])) == 2)
    d.observe(_answer(t0["sample_id"], finish=finish, status=status, calls=calls))
    s = next(w for _, _, w in d.walks() if w.samples[0].user_turn == 0).samples[0]
    assert s.end == end and len(s.steps) == (0 if status == "failed" else 1)


def test_max_steps_bounds_a_trajectory():
    d = _driver(max_steps=2)
    sid = next(r for r in d.next_prompts() if len(json.loads(r["messages"])) == 2)["sample_id"]
    for city in ("Lisbon", "Porto"):  # each recorded result answers one call
        d.observe(_answer(sid, calls=[_call(0, f'{{"city": "{city}", "unit": "C"}}')]))
        nxt = [r for r in d.next_prompts() if len(json.loads(r["messages"])) > 2]
        sid = nxt[0]["sample_id"] if nxt else None
    s = next(w for _, _, w in d.walks() if w.samples[0].user_turn == 0).samples[0]
    assert sid is None and (s.end, len(s.steps), s.hits) == ("max_steps", 2, 2)


def test_a_regenerated_history_holds_the_generated_answers_and_a_resumed_driver_asks_only_whats_left():
    d = _driver("every_turn", "regenerated")
    first = d.next_prompts()
    assert len(first) == 1 and _prompt(first, first[0]["sample_id"]) == ROW[:2]
    answer = _answer(first[0]["sample_id"], content="generated 1")
    d.observe(answer)
    second = d.next_prompts()
    messages = _prompt(second, second[0]["sample_id"])
    # the dataset's tool calls and answer of turn 1 are replaced by the generated answer
    assert messages == ROW[:2] + [{"role": "assistant", "content": "generated 1", "reasoning_content": "r"}, ROW[-1]]
    resumed = _driver("every_turn", "regenerated")  # a new attempt: the committed turn observed again
    resumed.observe(answer)
    assert resumed.next_prompts() == second
    # every_turn cannot answer a tool call: a turn that makes one ends the conversation
    d.observe(_answer(second[0]["sample_id"], calls=[_call(0, '{"city": "Lisbon", "unit": "C"}')]))
    assert d.next_prompts() == []
    ((_, _, w),) = list(d.walks())
    assert [s.end for s in w.samples] == ["answered", "tool_calls"]


def test_folds_leave_unchained_samples_as_their_turns():
    samples = [
        {"sample_id": "a", "steps": ["1", "2"], "prefix_ok": True, "base": 5, "masked": [3, 4], "end": "answered"},
        {"sample_id": "b", "steps": ["3", "4"], "prefix_ok": False, "base": 5, "masked": [], "end": "answered"},
        {"sample_id": "c", "steps": [], "prefix_ok": True, "base": 0, "masked": [], "end": "failed"},
    ]
    folds = trajectory_folds(samples)
    assert folds.rows == {
        "1": FOLDED,
        "2": TrajectoryRecord(
            sample_id="a",
            base=5,
            masked=[3, 4],
            trajectory={"turns": 2, "generated_turns": 2, "end": "answered"},
        ),
        "3": OWN,
        "4": OWN,
    }
    assert folds.counts == {
        "trajectory_samples": 3,
        "trajectory_turns": 4,
        "trajectory_samples_whole": 1,
        "trajectory_samples_unfolded": 1,
        "trajectory_samples_dropped": 1,
        "trajectory_dropped_failed": 1,
    }


def test_a_turns_id_covers_its_prompt_so_diverging_paths_never_share_one():
    """Route `both`: the local and the overflow path walk the same conversation. Where their
    answers differ, the next turns' prompts differ, and so do their ids (the calibration
    compares rows by id: only answers to one prompt)."""
    ids = []
    for content in ("answer A", "answer B", "answer A"):
        d = _driver("every_turn", "regenerated")
        first = d.next_prompts()[0]["sample_id"]
        d.observe(_answer(first, content=content))
        ids.append((first, d.next_prompts()[0]["sample_id"]))
    assert ids[0][0] == ids[1][0] == ids[2][0]  # the first prompt is the row's own on both paths
    assert ids[0][1] != ids[1][1] and ids[0][1] == ids[2][1]


def test_two_conversations_of_one_shape_never_share_a_turn_id():
    """Ids chain from each row's own sample id: two rows with the same message layout, answered
    alike, still ask for their later turns under other ids (one id per turn row of the stage)."""
    other = [dict(m, content=m["content"] + " (other)") if m["role"] == "user" else m for m in ROW]
    d = TurnDriver("every_turn", "regenerated", fmt=None)
    d.start(
        parse_prompts(
            [
                {"sample_id": sid, "dataset": "d", "messages": json.dumps(msgs), "tools": None, "route": "local"}
                for sid, msgs in (("conv-a", ROW), ("conv-b", other))
            ],
            "d",
            None,
        )
    )
    first = d.next_prompts()
    for row in first:
        d.observe(_answer(row["sample_id"], content="same answer"))
    second = d.next_prompts()
    assert len({r["sample_id"] for r in first + second}) == 4


def _recorded_call(call_id: str, args: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}],
    }


# a converted dataset: `call_0` in every turn, each turn's result answering its own turn's call
REUSED_IDS = [
    {"role": "user", "content": "weather in Lisbon?"},
    _recorded_call("call_0", '{"city": "Lisbon"}'),
    {"role": "tool", "tool_call_id": "call_0", "content": "Lisbon 21"},
    {"role": "assistant", "content": "21 in Lisbon."},
    {"role": "user", "content": "and Porto?"},
    _recorded_call("call_0", '{"city": "Porto"}'),
    {"role": "tool", "tool_call_id": "call_0", "content": "Porto 17"},
    {"role": "assistant", "content": "17 in Porto."},
]
# the same call polled in two turns, its two recorded results differing
POLLING = [
    {"role": "user", "content": "is the Lisbon report ready?"},
    _recorded_call("call_0", '{"city": "Lisbon"}'),
    {"role": "tool", "tool_call_id": "call_0", "content": "pending"},
    _recorded_call("call_1", '{"city": "Lisbon"}'),
    {"role": "tool", "tool_call_id": "call_1", "content": "ready"},
    {"role": "assistant", "content": "Ready."},
    {"role": "user", "content": "check again?"},
    _recorded_call("call_2", '{"city": "Lisbon"}'),
    {"role": "tool", "tool_call_id": "call_2", "content": "archived"},
    {"role": "assistant", "content": "Archived."},
]


def _splices(d: TurnDriver, model_calls: list[str], first_turn=0) -> tuple[list[str], object]:
    """Answer a trajectory's turns with one get_weather call each (`model_calls`: its arguments),
    then a plain answer; the results spliced after each call, and the sample."""
    rows = d.next_prompts()
    sid = next(r for r in rows if sum(m["role"] == "user" for m in json.loads(r["messages"])) == first_turn + 1)[
        "sample_id"
    ]
    spliced = []
    for n, args in enumerate(model_calls):
        d.observe(_answer(sid, calls=[_call(n, args)]))
        nxt = [r for r in d.next_prompts() if json.loads(r["messages"])[-1]["role"] == "tool"]
        if not nxt:
            break
        sid = nxt[0]["sample_id"]
        spliced.append(json.loads(nxt[0]["messages"])[-1]["content"])
    else:
        d.observe(_answer(sid, content="done"))
    s = next(w for _, _, w in d.walks() if w.samples[0].user_turn == first_turn).samples[0]
    return spliced, s


def test_a_result_answers_the_call_before_it_when_ids_are_reused_across_turns():
    """`call_0` names the Lisbon call in turn 1 and the Porto call in turn 2: each regenerated call
    gets its own turn's recorded result, never the other's."""
    spliced, s = _splices(_driver("trajectory", "regenerated", row=REUSED_IDS), ['{"city": "Lisbon"}'])
    assert spliced == ["Lisbon 21"] and (s.end, s.hits) == ("answered", 1)
    spliced, s = _splices(_driver("trajectory", "dataset", row=REUSED_IDS), ['{"city": "Porto"}'], first_turn=1)
    assert spliced == ["Porto 17"] and (s.end, s.hits) == ("answered", 1)


def test_a_polled_call_gets_each_recorded_result_once_in_order_then_none():
    """The model polls as the dataset did: the first poll gets the first recorded result, the next
    the next; a poll more than recorded is an unmatched call and ends the trajectory."""
    spliced, s = _splices(_driver("trajectory", "regenerated", row=POLLING), ['{"city": "Lisbon"}'] * 4)
    assert spliced == ["pending", "ready", "archived"]
    assert (s.end, s.hits, s.misses) == ("unmatched_call", 3, 1)
    assert s.unmatched == {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}


def test_a_thread_from_a_later_user_turn_takes_that_turns_results_first():
    """History dataset: the trajectory of user turn 2 starts after turn 1's recorded polls; its first
    poll gets turn 2's recorded result, then the earlier ones (the history it was given)."""
    spliced, s = _splices(_driver("trajectory", "dataset", row=POLLING), ['{"city": "Lisbon"}'] * 2, first_turn=1)
    assert spliced == ["archived", "pending"] and s.hits == 2


def test_a_fold_makes_the_last_usable_turn_its_samples_record_and_counts_every_turn_row():
    samples = [
        {"sample_id": "a", "steps": ["1", "2"], "prefix_ok": True, "base": 2, "masked": [1, 3], "end": "answered"}
    ]
    folds, counts = trajectory_folds(samples), Counter()
    assert folds.apply(TurnRow("1", [5, 6], [7], json.dumps({"engine": "x"})), counts) is None  # in the record's prompt
    record = folds.apply(TurnRow("2", [5, 6, 7, 8, 9], [10, 11], json.dumps({"engine": "x"})), counts)
    assert (record.sample_id, record.prompt_ids, record.output_ids, record.masked) == (
        "a",
        [5, 6],
        [7, 8, 9, 10, 11],
        [1, 3],
    )
    assert json.loads(record.provenance) == {
        "engine": "x",
        "turn_id": "2",
        "trajectory": {"turns": 2, "generated_turns": 2, "end": "answered"},
    }
    plain = TurnRow("other", [1], [2], None)
    assert folds.apply(plain, counts) is plain  # a row of no trajectory: as it is
    assert counts == {"trajectory_turns_folded": 1, "trajectory_turns_record": 1}
