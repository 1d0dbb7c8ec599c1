"""`json_records.fast_loads` gives exactly `json.loads`'s value (the standard library is the
oracle), msgspec's refusals included: what msgspec rejects and `json.loads` accepts falls back."""

from __future__ import annotations

import json

import pytest

from eagle3_data.json_records import JsonRefused, fast_loads, loads

TEXTS = [
    '{"text": "caf\\u00e9 \\ud83d\\ude00", "output_ids": [1, 2, 163839], "meta_info": {"lp": [[-0.5, 7, null]]}}',
    "[NaN, Infinity, -Infinity]",  # msgspec refuses these; json.loads takes them
    '{"big": 123456789012345678901234567890}',  # past 64 bits: an int in both
    '{"lone": "\\ud800"}',  # a lone surrogate escape: msgspec refuses, json.loads makes a str of it
    '{"a": 1, "a": 2}',  # duplicate keys: the last wins in both
    "1e400",
    '"\\u0000"',
]


@pytest.mark.parametrize("text", TEXTS)
def test_fast_loads_equals_json_loads(text):
    want = json.loads(text)
    for data in (text, text.encode()):
        got = fast_loads(data)
        assert json.dumps(got) == json.dumps(want) and type(got) is type(want), (text, got)


def test_invalid_json_is_still_a_value_error_and_loads_still_refuses_what_it_refused():
    for bad in ('{"a": ', "nope", b"\xff\xfe"):
        with pytest.raises(ValueError):
            fast_loads(bad)
    with pytest.raises(JsonRefused, match="lone surrogate"):
        loads('{"lone": "\\ud800"}')
    with pytest.raises(JsonRefused, match="nested deeper"):
        loads("[" * 5000 + "]" * 5000)
