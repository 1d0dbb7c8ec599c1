"""Local in flight sized from the endpoint's reported capacity (SGLang `/server_info`
`max_running_requests`), with the config's `in_flight_per_endpoint` as the override and a
default when the endpoint reports nothing; what was used goes into the stage manifest."""

from __future__ import annotations

import json

import pytest

from eagle3_data.engines.client import DEFAULT_IN_FLIGHT, server_capacity
from eagle3_data.storage import StageRef
from tests.generation_calls import generate_local

SAMPLING = {"temperature": 1.0, "max_new_tokens": 16, "thinking": True}


def prompts(n: int) -> list[dict]:
    return [
        {
            "sample_id": f"c{i:03d}",
            "dataset": "chat",
            "sample_index": i,
            "route": "local",
            "tools": None,
            "messages": json.dumps([{"role": "user", "content": f"Capacity question {i}."}]),
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("config", "override", "expect", "source"),
    [
        ({"max_running_requests": 5}, None, 5, "server_info"),  # the endpoint's capacity
        ({"max_running_requests": 5}, 3, 3, "config"),  # the config overrides what it reports
        ({}, None, DEFAULT_IN_FLIGHT, "default"),  # launched without --max-running-requests: nothing reported
    ],
)
def test_in_flight_per_endpoint_follows_the_reported_capacity(
    store, start_dev_server, kimi_tokenizer, tmp_path, config, override, expect, source
):
    server = start_dev_server({**config, "endpoints": {"generate": {"latency": {"dist": "fixed", "mean": 0.2}}}})
    ref = StageRef(run_key=f"cap-{source}", stage="generate_local", dataset="chat")
    summary = generate_local(
        store,
        ref,
        prompts(16),
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        in_flight_per_endpoint=override,
        journal_dir=tmp_path,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 16, summary
    extra = store.read_manifest(ref)["extra"]
    assert extra["in_flight"] == {server.url: expect} and extra["in_flight_source"] == {server.url: source}
    assert server.stats()["max_in_flight"]["generate"] <= expect  # never more open than that
    assert extra["answered"] == 16 and extra["latency_s_mean"] >= 0.2  # what the next run's balanced routing reads


def test_server_capacity_reads_sglangs_server_info_shapes():
    assert server_capacity({"max_running_requests": 128, "internal_states": [{"max_running_requests": 64}]}) == 128
    # no top-level server arg: the data-parallel ranks' resolved values add up
    assert (
        server_capacity(
            {
                "max_running_requests": None,
                "internal_states": [{"max_running_requests": 48}, {"max_running_requests": 48}],
            }
        )
        == 96
    )
    assert (
        server_capacity({"max_running_requests": None, "internal_states": [{"max_running_requests": 48}, {}]}) is None
    )
    for bad in (None, [], {"max_running_requests": 0}, {"max_running_requests": True}, {"max_running_requests": "64"}):
        assert server_capacity(bad) is None
