"""The streamed client's SSE reader (openrouter_http._read_events, then `Received.answer()` for the
piece that ends the stream): whatever pieces the socket cuts the body into (mid-line,
mid-character), it reads the events one line-by-line parse of the whole body reads, decodes them
in batches, and still names the generation from the events before one that is not JSON."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from eagle3_data.dev.inference_server.openrouter_answers import sse_events
from eagle3_data.stages.generate.openrouter_http import AttemptLost, Received, StreamAnswer, _read_events

ANSWER = {
    "id": "gen-1",
    "provider": "P",
    "model": "moonshotai/kimi-k2.5",
    "object": "chat.completion",
    "created": 5,
    "usage": {"prompt_tokens": 3, "completion_tokens": 9, "cost": 1e-6},
    "choices": [
        {
            "finish_reason": "tool_calls",
            "native_finish_reason": "tool_calls",
            "message": {
                "content": "héllo wörld ✓ \\ud83d " * 4,
                "reasoning": "think " * 12,
                "reasoning_details": [{"type": "reasoning.text", "text": "x", "index": 0}],
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "ü"}'}}],
            },
        }
    ],
}


class Pieces:
    def __init__(self, body: bytes, cuts: list[int]):
        self.parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]

    async def iter_any(self):
        for p in self.parts:
            yield p


def read(body: bytes, cuts: list[int]):
    """What the client has once the body is read, and once `answer()` decoded its last piece."""
    answer, names = StreamAnswer(), []
    done, last = asyncio.run(_read_events(Pieces(body, cuts), answer, names.append))
    named_on_the_wire = list(names)  # before the request's slot is handed on
    Received(None, stream=answer, events=last, done=done).answer()
    return done, answer, named_on_the_wire


def by_line(body: bytes) -> list:
    events, data = [], []
    for line in body.decode().split("\n"):
        line = line.rstrip("\r")
        if not line:
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
    return [json.loads(e) for e in events if e != "[DONE]"]


@pytest.mark.parametrize("seed", range(6))
def test_any_cut_of_the_body_reads_the_same_answer(seed):
    body = b": OPENROUTER PROCESSING\r\n\r\n" + b"".join(sse_events(ANSWER))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(body)), [1, 3, 40, 400, len(body) // 2, len(body) - 1][seed]))
    whole = StreamAnswer()
    for chunk in by_line(body):
        whole.add(chunk)
    done, answer, names = read(body, cuts)
    assert done and answer.completion() == whole.completion()
    assert answer.completion()["choices"][0]["message"]["content"] == ANSWER["choices"][0]["message"]["content"]
    assert names[0] == "gen-1"


def test_a_stream_whose_done_has_no_blank_line_after_it_is_complete():
    """The body may end right after `data: [DONE]` (the SSE spec dispatches an event at a blank
    line, but the stream's end closes it too): read as done, nothing malformed."""
    body = b"".join(sse_events(ANSWER)).rstrip(b"\n")
    assert body.endswith(b"data: [DONE]")
    done, answer, _names = read(body, [len(body) // 2])
    assert (
        done and answer.completion()["choices"][0]["message"]["content"] == ANSWER["choices"][0]["message"]["content"]
    )


@pytest.mark.parametrize("last_piece", [False, True])
def test_events_before_one_that_is_not_json_are_added_and_name_the_generation(last_piece):
    """Mid-stream, a piece is decoded as it arrives (ValueError there); the piece that ends the
    stream (`[DONE]`) is decoded by `Received.answer()`, and its first event names the generation
    on the wire all the same."""
    body = b'data: {"id": "gen-2", "choices": [{"delta": {"content": "a"}}]}\n\ndata: {not json\n\n'
    answer, names = StreamAnswer(), []
    if not last_piece:
        with pytest.raises(ValueError):
            asyncio.run(_read_events(Pieces(body, []), answer, names.append))
        assert names == ["gen-2"] and answer.chunks == 1 and answer.content == ["a"]
        return
    done, last = asyncio.run(_read_events(Pieces(body + b"data: [DONE]\n\n", []), answer, names.append))
    assert done and names == ["gen-2"] and answer.chunks == 0  # named, nothing decoded yet
    with pytest.raises(AttemptLost, match="malformed stream event") as lost:
        Received(None, stream=answer, events=last, done=done).answer()
    assert lost.value.generation_id == "gen-2" and answer.chunks == 1 and answer.content == ["a"]


@pytest.mark.parametrize("end", [b"", b"data: [DONE]\n\n"])
def test_a_lone_surrogate_escape_is_refused_as_before(end):
    """Refused on the wire mid-stream, by `answer()` in the piece that ends the stream."""
    body = b'data: {"id": "g", "choices": []}\n\ndata: {"choices": [{"delta": {"content": "\\ud800"}}]}\n\n'
    with pytest.raises(AttemptLost if end else ValueError, match="surrogate"):
        read(body + end, [])
