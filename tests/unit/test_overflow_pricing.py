"""What an error body says about its bill (`provider_answers.cost_unknown`): OpenRouter's mid-stream
`error` event carries no usage, and its errors page warns that prompt processing may be charged
when no content came back, so only a cost in the body settles it (issue 55)."""

from __future__ import annotations

from eagle3_data.stages.generate.openrouter_http import StreamAnswer
from eagle3_data.stages.generate.provider_answers import body_error, cost_unknown

ERROR = {"code": 502, "message": "Provider disconnected mid-stream"}


def _stream(*chunks: dict) -> dict:
    answer = StreamAnswer()
    for c in chunks:
        answer.add(c)
    return answer.completion()


def test_an_error_event_without_usage_leaves_the_bill_unknown():
    event = {
        "id": "gen-1",
        "object": "chat.completion.chunk",
        "error": ERROR,
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
    }
    before_output = _stream(event)  # OpenRouter's documented shape: no output, no usage
    after_output = _stream({"id": "gen-1", "choices": [{"index": 0, "delta": {"content": "partial"}}]}, event)
    for body in (before_output, after_output):
        verdict = body_error(body)
        assert verdict is not None and verdict.action == "retry", body
        assert cost_unknown(body) and body["id"] == "gen-1"
    assert "nothing billed" not in body_error(after_output).reason


def test_a_cost_in_the_error_body_settles_it():
    free = {"id": "gen-2", "error": ERROR, "choices": [], "usage": {"prompt_tokens": 40, "cost": 0}}
    assert body_error(free) is not None and not cost_unknown(free)
    counted = {"id": "gen-3", "error": ERROR, "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 0}}
    assert cost_unknown(counted)  # tokens, no cost: only the record says what was charged
