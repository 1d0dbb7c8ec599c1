"""Generation pieces that need no server: backoff, budget, routing, prompt checks, stop-id normalisation."""

from __future__ import annotations

import json
import logging
import random
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from eagle3_data.config import RoutingConfig
from eagle3_data.errors import UserError
from eagle3_data.retry import backoff_s, parse_retry_after
from eagle3_data.stages.generate.checkpoint import parse_prompts, sampling_for
from eagle3_data.stages.generate.openrouter_budget import Budget
from eagle3_data.stages.generate.openrouter_pricing import Prices
from eagle3_data.stages.generate.progress import LogProgress, Progress, TqdmProgress
from eagle3_data.stages.prompts.routing import assign_routes, local_capacity
from eagle3_data.stages.validate.consistency import consistency_report


def test_backoff_honours_retry_after_and_grows():
    rng = random.Random(0)
    assert backoff_s(1, retry_after="7", rng=rng) >= 7
    assert parse_retry_after("1.5") == 1.5 and parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=30), usegmt=True)
    assert 25 < parse_retry_after(later) <= 30
    early = [backoff_s(1, base_s=1, rng=rng) for _ in range(200)]
    late = [backoff_s(6, base_s=1, cap_s=60, rng=rng) for _ in range(200)]
    assert max(early) <= 1 and sum(late) / 200 > 10 and max(late) <= 60


def test_budget_stops_before_the_cap():
    b = Budget(1.0, spent_usd=0.2, first_estimate_usd=0.1, max_new_tokens=100)
    for _ in range(7):
        assert b.allows(b.estimate(10))
        b.reserve(b.estimate(10))
    assert b.allows(0.1 - 1e-12) and not b.allows(0.1 + 1e-9)  # 0.2 + 8 x 0.1 = 1.0 is the cap
    b.release(0.1)
    assert b.allows(0.2 - 1e-9)
    assert not Budget(0.0).allows(0.01) and Budget(None).allows(10.0**6)


PRICES = Prices(prompt=6e-7, completion=2.5e-6)  # USD per token, as OpenRouter's model list gives them


def test_a_long_prompt_with_a_short_answer_is_estimated_from_prices_not_a_cost_ratio():
    """The measured bug: a 30k-token trajectory prompt with a 40-token tool call, its whole cost
    divided by 40 and times max_new_tokens, estimated ~$0.93 a request, so max_usd 10 held 256
    in flight to ~10. Priced per kind of token it costs 30000 p + 4096 c at most."""
    b = Budget(10.0, max_new_tokens=4096, prices=PRICES)
    answer = {"prompt_tokens": 30_000, "completion_tokens": 40}
    b.add(30_000 * PRICES.prompt + 40 * PRICES.completion, answer)
    bound = 30_000 * 6e-7 + 4096 * 2.5e-6
    assert b.estimate(30_000) == pytest.approx(bound)
    in_flight = 0
    while b.allows(b.estimate(30_000)):
        b.reserve(b.estimate(30_000))
        in_flight += 1
    assert in_flight == int((10.0 - b.spent) / bound) >= 256


def test_prices_are_learned_from_an_answers_cost_split():
    b = Budget(10.0, max_new_tokens=1000)
    assert b.estimate(500) == pytest.approx(0.01)  # the first estimate until an answer is priced
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 100,
        "cost_details": {
            "upstream_inference_prompt_cost": 1000 * 6e-7,
            "upstream_inference_completions_cost": 100 * 2.5e-6,
        },
    }
    b.add(1000 * 6e-7 + 100 * 2.5e-6, usage)
    assert b.estimate(500) == pytest.approx(500 * 6e-7 + 1000 * 2.5e-6)


def test_without_prices_the_estimate_stays_an_upper_bound():
    """Learned only from whole costs, each price is at most an answer's cost over its tokens of
    that kind: the estimate never falls below what a request can cost."""
    rng = random.Random(3)
    b = Budget(None, max_new_tokens=512)
    for _ in range(50):
        p_tok, c_tok = rng.randint(1, 20_000), rng.randint(1, 512)
        b.add(p_tok * PRICES.prompt + c_tok * PRICES.completion, {"prompt_tokens": p_tok, "completion_tokens": c_tok})
        for prompt in (10, 1000, 30_000):
            assert b.estimate(prompt) >= prompt * PRICES.prompt + 512 * PRICES.completion - 1e-12


def rows(n: int) -> list[dict]:
    return [
        {
            "sample_id": f"id{i}",
            "dataset": "d",
            "messages": json.dumps([{"role": "user", "content": str(i)}]),
            "tools": None,
        }
        for i in range(n)
    ]


def routed(rows: list[dict], **routing) -> list[dict]:
    return [
        {**r, "route": route}
        for r, route in zip(rows, assign_routes([r["sample_id"] for r in rows], RoutingConfig(**routing)))
    ]


def test_routes_are_exact_deterministic_and_order_free():
    a = routed(rows(1000), strategy="fraction", overflow_fraction=0.25, calibration_samples=10)
    counts = {r: sum(x["route"] == r for x in a) for r in ("local", "overflow", "both")}
    assert counts == {"local": 740, "overflow": 250, "both": 10}
    b = routed(list(reversed(rows(1000))), strategy="fraction", overflow_fraction=0.25, calibration_samples=10)
    assert {x["sample_id"]: x["route"] for x in a} == {x["sample_id"]: x["route"] for x in b}
    cap = routed(rows(100), strategy="capacity", local_capacity=local_capacity(50.0, 60.0, 100.0))
    assert sum(x["route"] == "local" for x in cap) == 30
    with pytest.raises(UserError, match="strategy"):
        assign_routes(["a", "b", "c"], RoutingConfig.model_construct(strategy="random"))


def test_balanced_routes_split_by_the_given_rates():
    """balanced: the local share is the local side's share of the rates the caller measured."""
    from eagle3_data.balance import Rates

    ids = [r["sample_id"] for r in rows(100)]
    balanced = RoutingConfig(strategy="balanced")
    assert assign_routes(ids, balanced, Rates(local=3.0, overflow=1.0)).count("local") == 75
    assert assign_routes(ids, balanced, Rates(local=1.0, overflow=1.0)).count("local") == 50
    with pytest.raises(ValueError, match="rates"):
        assign_routes(ids, balanced)


def test_prompt_rows_are_checked_with_record_and_field():
    with pytest.raises(UserError, match=r"prompt 1 \(sample_id 'id0'\).*'sample_id' is duplicated"):
        parse_prompts(rows(1) + rows(1), "d", None)
    bad = rows(2)
    bad[1]["messages"] = "{not json"
    with pytest.raises(UserError, match=r"prompt 1 \(sample_id 'id1'\).*not valid JSON"):
        parse_prompts(bad, "d", None)
    local = parse_prompts(routed(rows(40), overflow_fraction=0.5, calibration_samples=3), "d", ("local", "both"))
    assert len(local) == 20 and sum(p.route == "both" for p in local) == 3
    both = next(p for p in local if p.route == "both")
    assert sampling_for(both, {"temperature": 1.0, "top_p": 0.9})["temperature"] == 0.0


def test_sglang_answers_are_recorded_as_given_and_checked():
    """SGLang's output_ids run through the matched stop token and its finish_reason names it: the
    client keeps both as given (the validator judges a wrong stop id), and refuses an answer whose
    ids are not as many as meta_info.completion_tokens."""
    from eagle3_data.engines.client import PromptCut, error_message
    from eagle3_data.engines.sglang import check_answer
    from tests.fixtures.kimi import CHAS, IM_END

    stop = {"type": "stop", "matched": IM_END}
    assert check_answer({"output_ids": [1, IM_END], "meta_info": {"finish_reason": stop, "completion_tokens": 2}})[
        :2
    ] == ([1, IM_END], stop)
    chas = {"type": "stop", "matched": CHAS}  # a server told to stop on "chas": recorded, not repaired
    assert check_answer({"output_ids": [1, CHAS], "meta_info": {"finish_reason": chas}})[:2] == ([1, CHAS], chas)
    assert check_answer([{"output_ids": [1], "meta_info": {"finish_reason": "length"}}])[1] == {"type": "length"}
    with pytest.raises(ValueError, match="completion_tokens = 3"):
        check_answer({"output_ids": [1, IM_END], "meta_info": {"finish_reason": stop, "completion_tokens": 3}})
    with pytest.raises(ValueError, match="not a list of ints"):
        check_answer({"output_ids": [1, True], "meta_info": {"finish_reason": stop}})
    # a server started with --allow-auto-truncate cuts the prompt's tail and reports the cut length
    assert check_answer({"output_ids": [1], "meta_info": {"finish_reason": stop, "prompt_tokens": 3}}, [5, 6, 7])
    with pytest.raises(PromptCut, match="3 prompt ids sent, meta_info.prompt_tokens = 2"):
        check_answer({"output_ids": [1], "meta_info": {"finish_reason": stop, "prompt_tokens": 2}}, [5, 6, 7])
    assert (
        error_message('{"object": "error", "message": "The request queue is full.", "code": 503}')
        == "The request queue is full."
    )
    assert error_message('{"error": "unknown field `seed`"}') == "unknown field `seed`"
    assert (
        error_message('{"error": {"message": "Duplicate request ID detected: a.0"}}')
        == "Duplicate request ID detected: a.0"
    )
    assert error_message("plain") == "plain"


def test_sampling_params_are_checked_against_sglangs_keys():
    from eagle3_data.engines.sglang import SAMPLING_KEYS, check_sampling_params

    check_sampling_params({"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 10, "sampling_seed": 1})
    with pytest.raises(
        UserError, match=r"'seed' is not an SGLang sampling parameter \(SGLang's key is 'sampling_seed'\)"
    ):
        check_sampling_params({"temperature": 1.0, "seed": 3})
    assert "stop_token_ids" in SAMPLING_KEYS and "thinking" not in SAMPLING_KEYS


def test_consistency_report_finds_the_first_difference(kimi_fmt):
    from tests.fixtures.kimi import REFERENCE_IDS, REFERENCE_TEXT

    ids = kimi_fmt.codec.encode_batch([REFERENCE_TEXT])[0]
    assert ids == REFERENCE_IDS
    local = [
        {"sample_id": "a", "status": "ok", "output_ids": ids},
        {"sample_id": "b", "status": "ok", "output_ids": ids},
    ]
    over = [
        {
            "sample_id": "a",
            "status": "ok",
            "reasoning": "Let me think.",
            "content": "The answer is 42.",
            "tool_calls": None,
            "finish_reason": "stop",
            "messages": "[]",
        },
        {
            "sample_id": "b",
            "status": "ok",
            "reasoning": "Let me think.",
            "content": "The answer is 43.",
            "tool_calls": None,
            "finish_reason": "stop",
            "messages": "[]",
        },
    ]
    report = consistency_report(kimi_fmt, local, over, first_n=64)
    by = {s["sample_id"]: s for s in report["per_sample"]}
    assert by["a"]["first_diff"] is None and by["a"]["compared"] == len(ids)
    assert ids[9] == 5512 and by["b"]["first_diff"] == 9 and not by["b"]["same_text"]  # "42" is id 5512
    assert report["agreement"] == 0.5
    assert report["text_disagreements"] == ["b"] and report["missing"] == []


def test_consistency_report_with_thinking_off_has_no_think_end(kimi_fmt, kimi_fmt_off):
    """Calibration used the default (thinking on) whatever the run said: a thinking-off engine id
    sequence never agreed with its provider's text, by one `</think>`."""
    from tests.fixtures.kimi import IM_END, THINK_END

    ids = kimi_fmt_off.codec.encode_batch(["The answer is 42.<|im_end|>"])[0]
    assert THINK_END not in ids and ids[-1] == IM_END
    local = [{"sample_id": "a", "status": "ok", "output_ids": ids}]
    over = [
        {
            "sample_id": "a",
            "status": "ok",
            "reasoning": None,
            "content": "The answer is 42.",
            "tool_calls": None,
            "finish_reason": "stop",
            "messages": "[]",
        }
    ]
    assert consistency_report(kimi_fmt_off, local, over)["agreement"] == 1.0
    assert consistency_report(kimi_fmt, local, over)["agreement"] == 0.0  # the wrong mode shows as a difference


def test_consistency_report_compares_only_the_calibration_samples(kimi_tokenizer, kimi_fmt):
    """The pipeline passes whole stages and the ids routed "both": others are ignored, a calibration
    sample that failed on one path is named, and a non-canonical split (same text) is told apart."""
    text = "Let me think.</think>The answer is 42.<|im_end|>"
    ids = kimi_tokenizer.encode(text, add_special_tokens=False)
    split = (
        ids[:9]
        + kimi_tokenizer.encode("4", add_special_tokens=False)
        + kimi_tokenizer.encode("2", add_special_tokens=False)
        + ids[10:]
    )
    assert kimi_tokenizer.decode(split) == text and split != ids
    over = {
        "status": "ok",
        "reasoning": "Let me think.",
        "content": "The answer is 42.",
        "tool_calls": None,
        "finish_reason": "stop",
        "messages": "[]",
    }
    local = [
        {"sample_id": s, "status": "ok", "output_ids": split if s == "bpe" else ids}
        for s in ("same", "bpe", "lost", "cut", "local-only")
    ]
    provider = [{**over, "sample_id": s} for s in ("same", "bpe", "overflow-only")] + [
        {**over, "sample_id": "lost", "status": "failed"}
    ]
    # cut at the token limit with tools offered: the text cannot determine the ids, so no comparison
    provider.append(
        {
            **over,
            "sample_id": "cut",
            "finish_reason": "length",
            "status": "unreconstructable",
            "tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        }
    )
    report = consistency_report(
        kimi_fmt, iter(local), iter(provider), first_n=64, sample_ids={"same", "bpe", "lost", "cut"}
    )
    by = {s["sample_id"]: s for s in report["per_sample"]}
    assert sorted(by) == ["bpe", "same"] and report["missing"] == ["lost"] and report["unreconstructable"] == ["cut"]
    assert by["same"]["first_diff"] is None and by["bpe"]["first_diff"] == 9 and by["bpe"]["same_text"]
    assert report["agreement"] == 0.5 and report["text_agreement"] == 1.0 and report["text_disagreements"] == []
    assert "same weights" in report["cannot_prove"]
    empty = consistency_report(kimi_fmt, local, provider, sample_ids=set())
    assert empty["samples"] == 0 and empty["agreement"] is None and empty["missing"] == []


def test_log_progress_writes_steady_lines(caplog):
    caplog.set_level(logging.INFO)
    p = LogProgress(logging.getLogger("t"), interval_s=0.0)
    p.start(100, already_done=10, label="gen")
    p.update(ok=30, failed=2, tokens=3000, cost_usd=0.5)
    p.tick()
    p.close()
    line = caplog.records[-2].getMessage()
    assert "42/100 done, 2 failed" in line and "$0.5000" in line and "ETA" in line


@pytest.mark.parametrize("kind", [Progress, LogProgress, TqdmProgress])
def test_progress_close_is_safe_before_start_and_twice(kind):
    """`generate local --regenerate trajectory` with nothing routed local ended in
    `AttributeError: 'LogProgress' object has no attribute '_base'`: no round, so no start, then close."""
    p = kind()
    p.close()
    p.start(3, label="x")
    p.close()
    p.close()


@pytest.mark.parametrize("engine", ["openrouter", "sglang", "vllm"])
def test_the_generation_mode_comes_only_from_the_bound_format(engine, kimi_tokenizer):
    """`thinking` decides the prompt's ending and how every answer is parsed and rebuilt, so it is
    bound once into the output format the clients take; a sampling dict that carries it anyway is
    refused before any request (a client reading it there could mix modes)."""
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.config import OverflowGenerationConfig
    from eagle3_data.engines import wire_for
    from eagle3_data.stages.generate import local, openrouter
    from eagle3_data.storage import StageRef

    class NothingCommitted:
        def is_complete(self, ref):
            return False

    fmt, ref, sampling = (
        get_output_format(kimi_tokenizer, thinking=True),
        StageRef("r", "generate", "chat"),
        {"temperature": 1.0, "thinking": True},
    )
    if engine == "openrouter":
        call = lambda: openrouter.generate_overflow(
            NothingCommitted(),
            ref,
            [],
            fmt,
            "http://127.0.0.1:9/v1",
            "key",
            sampling,
            config=OverflowGenerationConfig(model="m"),
        )
    else:
        call = lambda: local.generate_local(
            NothingCommitted(), ref, [], fmt, ["http://127.0.0.1:9"], sampling, wire=wire_for(engine)
        )
    with pytest.raises(UserError, match="'thinking' is not a"):
        call()


def _one_prompt():
    return next(iter(parse_prompts([{"sample_id": "s1", "messages": [{"role": "user", "content": "hi"}]}], "d", None)))


def test_the_one_row_builder_makes_the_generations_schemas_columns():
    """`GenerationRow` and the rows both clients build have the columns the stage's writer stores
    (the Parquet schema is the oracle), ok or failed alike."""
    from eagle3_data.schemas import schema_for
    from eagle3_data.stages.generate.checkpoint import generation_row
    from eagle3_data.stages.generate.contracts import GenerationRow

    columns = schema_for("generations").names
    assert list(GenerationRow.__annotations__) == columns
    ok, failed = (
        generation_row(_one_prompt(), [1, 2], "sglang"),
        generation_row(_one_prompt(), None, "vllm", failed="why"),
    )
    # every column; `images` only for an image prompt (a text row's is the column's default, null)
    assert set(ok) == set(failed) == set(columns) - {"images"}
    assert (ok["status"], ok["error"], failed["status"], failed["error"]) == ("ok", None, "failed", "why")


def test_a_fresh_and_a_reused_stage_summary_have_one_shape(tmp_path):
    """What `pipeline.generate` reads is there whichever way the stage ended."""
    from eagle3_data.stages.generate.checkpoint import StageRun, StageSetup, reused_summary
    from eagle3_data.stages.generate.contracts import StageSummary
    from eagle3_data.storage import StageRef

    class Manifests:  # the two calls a reused stage's summary makes of the store
        def uri(self, ref, name=""):
            return f"s3://b/{ref.path}/{name}"

        def read_manifest(self, ref):
            return {"extra": {"counts": {"ok": 1, "total": 1}}}

    ref = StageRef("r", "generate_local", "d")
    prompts = parse_prompts([{"sample_id": "s1", "messages": [{"role": "user", "content": "hi"}]}], "d", None)
    fresh = StageRun(Manifests(), ref, prompts, {}, {}, StageSetup(journal_dir=tmp_path), rows_per_part=4).summary(None)
    reused = reused_summary(Manifests(), ref)
    assert set(fresh) == set(reused) == set(StageSummary.__annotations__)
    assert (fresh["reused"], fresh["complete"], reused["reused"], reused["complete"]) == (False, False, True, True)


def test_stop_reasons_are_their_strings():
    """Summaries, logs and manifests hold the plain strings (JSON, f-strings), as before the enum."""
    from eagle3_data.stages.generate.contracts import StopReason

    for reason in StopReason:
        assert json.loads(json.dumps({"r": reason})) == {"r": reason.value} and f"{reason}" == reason.value == reason
