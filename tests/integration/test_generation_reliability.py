"""Generation under injected faults, kills, budgets and credit exhaustion (dev server + SeaweedFS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_data.storage import StageRef
from tests.generation_calls import MODEL, generate_local, generate_overflow
from tests.integration.test_generation import SAMPLING, SECRET, prompts

PRICE = {"prompt": 1e-6, "completion": 1e-5}
FAULTS_20 = {  # 20% of requests fail one way or another
    "rate_limit": 0.05,
    "retry_after_s": 0.05,
    "server_error": 0.05,
    "timeout": 0.02,
    "timeout_sleep_s": 3,
    "malformed_json": 0.03,
    "empty_content": 0.03,
    "bad_request": 0.02,
    "latency": {"dist": "uniform", "low": 0.0, "high": 0.02},
}


def rows_by_id(store, ref) -> dict[str, dict]:
    rows = store.read_table(ref).to_pylist()
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicated sample_ids"
    return {r["sample_id"]: r for r in rows}


def test_overflow_with_20pct_faults_settles_every_sample(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"seed": 7, "price_per_token": PRICE, "endpoints": {"chat": FAULTS_20}})
    ref = StageRef(run_key="faults", stage="generate_overflow", dataset="tool_calls")
    todo = prompts(50)
    summaries = []
    for _ in range(3):  # failures that may heal are retried by the next attempt, final after two
        s = generate_overflow(
            store,
            ref,
            todo,
            kimi_tokenizer,
            server.url + "/v1",
            SECRET,
            MODEL,
            {},
            10.0,
            sampling=SAMPLING,
            concurrency=16,
            max_attempts=6,
            request_timeout_s=1.0,
            journal_dir=tmp_path,
        )
        summaries.append(s)
        if s["complete"]:
            break
    assert summaries[-1]["complete"], summaries
    rows = rows_by_id(store, ref)
    assert sorted(rows) == sorted(p["sample_id"] for p in todo)  # none lost, none duplicated
    failed = [r for r in rows.values() if r["status"] == "failed"]
    assert all(r["status"] == "ok" or r["error"] for r in rows.values())
    assert all(
        r["content"] or r["tool_calls"] or r["finish_reason"] == "length" for r in rows.values() if r["status"] == "ok"
    )
    stats = server.stats()
    assert sum(stats["faults"]["chat"].values()) >= 10, stats["faults"]  # faults really happened
    reasons = {r["error"].split(":")[0] for r in failed}
    assert reasons <= {"HTTP 400", "malformed answer", "empty answer", "gave up after 6 attempts"}, reasons
    # permanent 400s are never retried: one request each
    for r in failed:
        if r["error"].startswith("HTTP 400"):
            assert stats["requests"]["chat"][r["sample_id"]] == 1


def test_local_with_faults_settles_every_sample(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server(
        {
            "seed": 3,
            "endpoints": {
                "generate": {
                    "server_error": 0.1,
                    "timeout": 0.03,
                    "timeout_sleep_s": 3,
                    "malformed_json": 0.07,
                    "latency": {"dist": "fixed", "mean": 0.05},
                }
            },
        }
    )
    ref = StageRef(run_key="faults", stage="generate_local", dataset="tool_calls")
    todo = prompts(60)
    s = generate_local(
        store,
        ref,
        todo,
        kimi_tokenizer,
        [server.url],
        SAMPLING,
        in_flight_per_endpoint=8,
        rows_per_part=16,
        request_timeout_s=1.0,
        journal_dir=tmp_path,
    )
    if not s["complete"]:
        s = generate_local(
            store,
            ref,
            todo,
            kimi_tokenizer,
            [server.url],
            SAMPLING,
            in_flight_per_endpoint=8,
            rows_per_part=16,
            request_timeout_s=1.0,
            journal_dir=tmp_path,
        )
    assert s["complete"], s
    rows = rows_by_id(store, ref)
    assert sorted(rows) == sorted(p["sample_id"] for p in todo)
    assert all(r["output_ids"] for r in rows.values() if r["status"] == "ok")
    assert server.stats()["max_in_flight"]["generate"] >= 6  # requests really run 8 deep, not one by one


def test_budget_cap_holds_and_resume_pays_nothing_twice(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server(
        {"price_per_token": PRICE, "endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 0.02}}}}
    )
    ref = StageRef(run_key="budget", stage="generate_overflow", dataset="chat")
    todo = prompts(60, "chat")
    args = (store, ref, todo, kimi_tokenizer, server.url + "/v1", SECRET, MODEL, {})
    first = generate_overflow(*args, 0.02, sampling=SAMPLING, concurrency=8, rows_per_part=7, journal_dir=tmp_path)
    assert first["stopped_reason"] == "budget" and not first["complete"], first
    assert 0 < first["cost_usd"] <= 0.02
    second = generate_overflow(*args, 1.0, sampling=SAMPLING, concurrency=8, rows_per_part=7, journal_dir=tmp_path)
    assert second["complete"], second
    assert second["spent_before_usd"] == pytest.approx(first["cost_usd"])
    rows = rows_by_id(store, ref)
    assert len(rows) == 60
    answered = server.stats()["answered"]["chat"]
    assert set(answered) == set(rows) and set(answered.values()) == {1}  # nobody paid twice
    assert sum(r["usage"]["cost_usd"] for r in rows.values()) == pytest.approx(first["cost_usd"] + second["cost_usd"])


def test_credits_exhausted_stops_cleanly(store, start_dev_server, kimi_tokenizer, tmp_path):
    server = start_dev_server({"price_per_token": PRICE, "endpoints": {"chat": {"credits_after": 13}}})
    ref = StageRef(run_key="credits", stage="generate_overflow", dataset="chat")
    s = generate_overflow(
        store,
        ref,
        prompts(40, "chat"),
        kimi_tokenizer,
        server.url + "/v1",
        SECRET,
        MODEL,
        {},
        None,
        sampling=SAMPLING,
        concurrency=4,
        rows_per_part=5,
        journal_dir=tmp_path,
    )
    assert s["stopped_reason"] == "credits" and not s["complete"] and s["counts"]["ok"] == 13, s
    assert not store.is_complete(ref)
    assert len(store.committed_sample_ids(ref)) == 13  # what was paid for is committed, not just buffered
    assert sum(server.stats()["faults"]["chat"].values()) <= 4  # dispatch stopped at the first 402s


@pytest.mark.slow
def test_sigkill_mid_stage_then_resume_cli(store, s3_server, start_dev_server, kimi_tokenizer_dir, tmp_path):
    """The CLI end to end; a SIGKILL mid-stage; resume: 0 lost, 0 duplicated; journaled answers are
    replayed, not requested again, so only answers in transit at the kill can be paid twice."""
    # 0.15 s per answer at 4 in flight: ~27 answers/s, so the 4-row kill window below lasts ~0.15 s,
    # several polls even on a loaded machine (at 0.05 s a busy CI machine polled past every window)
    server = start_dev_server(
        {"price_per_token": PRICE, "endpoints": {"chat": {"latency": {"dist": "fixed", "mean": 0.15}}}}
    )
    src = tmp_path / "chat.jsonl"
    with src.open("w") as f:
        for i in range(100):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me about number {i}."}]}) + "\n")
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
        AWS_DEFAULT_REGION="us-east-1",
        OPENROUTER_API_KEY=SECRET,
        EAGLE3_JOURNAL_DIR=str(tmp_path / "journal"),
    )
    cmd = [
        str(Path(sys.executable).parent / "eagle3-data"),
        "generate",
        "overflow",
        "--dataset",
        "chat",
        "--prompts",
        str(src),
        "--run-key",
        "kill",
        "--bucket",
        store.bucket,
        "--prefix",
        store.prefix,
        "--endpoint-url",
        s3_server.endpoint_url,
        "--overflow-fraction",
        "1",
        "--tokenizer",
        str(kimi_tokenizer_dir),
        "--base-url",
        server.url + "/v1",
        "--concurrency",
        "4",
        "--rows-per-part",
        "10",
        "--max-usd",
        "5",
    ]
    ref = StageRef(run_key="kill", stage="generate_overflow", dataset="chat")
    logs = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    journal = tmp_path / "journal"

    def journaled() -> int:  # answers, not the records of requests opened (journal_attempt)
        return sum(
            not line.startswith('{"attempt"') for p in journal.glob("*.jsonl") for line in p.read_text().splitlines()
        )

    # kill mid-part: at least 30 answers committed and 3-6 more journaled but not committed. The
    # upper bound keeps the kill away from a part upload: with 10 journaled past the last commit
    # the next part may already be on its way, and would land before the kill
    while time.time() < deadline and proc.poll() is None:
        committed = len(store.committed_sample_ids(ref))
        if committed >= 30 and committed + 3 <= journaled() <= committed + 6:
            break
        time.sleep(0.02)
    assert proc.poll() is None, (
        f"the CLI ended before the kill window (exit {proc.returncode}): {proc.communicate()[0][-2000:]}"
    )
    os.kill(proc.pid, signal.SIGKILL)
    logs.append(proc.communicate()[0])
    killed_at = len(store.committed_sample_ids(ref))
    assert 30 <= killed_at < 100
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    logs += [done.stdout, done.stderr]
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert store.is_complete(ref) and summary["counts"]["replayed"] > 0, summary
    rows = rows_by_id(store, ref)
    assert len(rows) == 100 and all(r["status"] == "ok" for r in rows.values())
    answered = server.stats()["answered"]["chat"]
    assert set(answered) == set(rows)
    # Only answers in transit at the instant of the kill (sent by the server, not yet read and
    # journaled by the client) can be paid twice: at most one per concurrency slot.
    paid_twice = {k for k, v in answered.items() if v > 1}
    assert max(answered.values()) <= 2 and len(paid_twice) <= 4, paid_twice
    # and each was counted before it was asked again: the killed process had journaled its stream
    # as open, the resume priced it from OpenRouter's record of the generation
    lost = {r["sample_id"]: json.loads(r["provenance"]).get("lost_attempts") or [] for r in rows.values()}
    assert all(lost[k] and lost[k][0]["cost_source"] == "generation_lookup" for k in paid_twice), lost
    assert summary["counts"]["lost_attempts"] == sum(map(len, lost.values())) >= len(paid_twice)
    for text in logs:
        assert SECRET not in text
    for obj in store.client.list_objects_v2(Bucket=store.bucket)["Contents"]:
        assert SECRET.encode() not in store.client.get_object(Bucket=store.bucket, Key=obj["Key"])["Body"].read()
