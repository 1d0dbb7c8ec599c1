"""The overflow client under bursts: when a whole wave of answers arrives at once, the workers'
next requests leave before the wave's rows are built and journaled (else the last request of a
wave waits behind all of them: 0.74-0.77 of C/L at C=256, benchmarks/overflow_client.py), and the client
runs with rarer garbage collections, restored after it."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import ClassVar

from eagle3_data.stages.generate import openrouter
from eagle3_data.stages.generate.checkpoint import StageRun
from eagle3_data.stages.generate.openrouter_http import Received
from eagle3_data.storage import StageRef
from tests.generation_calls import MODEL, generate_overflow
from tests.integration.test_generation import SAMPLING, SECRET, prompts

C = 4  # workers; 3 waves of C answers each


def answer(sid: str) -> dict:
    return {
        "id": f"gen-{sid}",
        "model": MODEL,
        "provider": "Moonshot AI",
        "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": f"answer {sid}"}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "cost": 1e-6},
    }


class WaveServer:
    """Stands in for `SdkPost`: holds every request until C are out, then answers them all at
    once (a fixed provider latency), logging each send and each journaled row in order."""

    events: ClassVar[list[tuple[str, str]]] = []  # shared: the code under test makes its own instances
    thresholds: ClassVar[list[tuple[int, int, int]]] = []

    def __init__(self, *args, **kwargs):
        self.waiting: list[tuple[asyncio.Future, str]] = []

    async def post(self, body, headers, on_open=None):
        sid = headers["X-Eagle3-Sample-Id"]
        assert json.loads(body)["messages"], "the body is the encoded request"
        WaveServer.events.append(("send", sid))
        WaveServer.thresholds.append(gc.get_threshold())
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((done, sid))
        if len(self.waiting) == C:
            for fut, s in self.waiting:
                fut.set_result(Received(f"gen-{s}", body=json.dumps(answer(s)).encode()))
            self.waiting = []
        return await done

    stream = post  # a stream's answer is read off the wire the same way

    async def check_reachable(self, within_s):
        pass  # in-process: nothing to connect to

    async def get_json(self, path, params=None):
        return {"data": [{"id": MODEL}]} if path == "models" else None

    async def close(self):
        pass


def test_a_waves_next_requests_leave_before_its_rows_are_journaled(store, kimi_tokenizer, tmp_path, monkeypatch):
    journal = StageRun.journal

    def logged_journal(self, row, **kw):
        WaveServer.events.append(("journal", row["sample_id"]))
        return journal(self, row, **kw)

    monkeypatch.setattr(openrouter, "SdkPost", WaveServer)
    monkeypatch.setattr(StageRun, "journal", logged_journal)
    WaveServer.events, WaveServer.thresholds = [], []
    before = gc.get_threshold()
    summary = generate_overflow(
        store,
        StageRef("bursts", "generate_overflow", "w"),
        prompts(3 * C, "w"),
        kimi_tokenizer,
        "http://unused/v1",
        SECRET,
        MODEL,
        {},
        None,
        sampling=SAMPLING,
        concurrency=C,
        rows_per_part=64,
        journal_dir=tmp_path,
    )
    assert summary["complete"] and summary["counts"]["ok"] == 3 * C, summary
    kinds = [kind for kind, _ in WaveServer.events]
    # wave 1 is answered at once: its C next requests (wave 2) leave with at most one of its rows
    # journaled between them (the settler takes one row per pass of the event loop); recording
    # each row before the next send would journal C - 1 rows before the last of them
    last_send_of_wave_2 = [i for i, k in enumerate(kinds) if k == "send"][2 * C - 1]
    assert kinds[:last_send_of_wave_2].count("journal") <= 1, WaveServer.events
    assert sorted(sid for kind, sid in WaveServer.events if kind == "journal") == [f"s{i:04d}" for i in range(3 * C)]
    # while the client runs, garbage collection is rarer; afterwards the process's thresholds are back
    assert set(WaveServer.thresholds) == {(50_000, 20, 1000)} != {before}
    assert gc.get_threshold() == before


def test_rarer_gc_leaves_a_host_freeze_as_it_was():
    """A host process may have frozen objects itself (Airflow's Celery worker calls gc.freeze()
    at start-up, celery_executor_utils): the client's own freeze/unfreeze must not thaw them."""
    gc.freeze()
    try:
        held = gc.get_freeze_count()
        with openrouter.fewer_gc_pauses():
            assert gc.get_threshold() == (50_000, 20, 1000)
        # not `== held`: a frozen object whose last reference goes (another thread's, say) leaves
        # the permanent generation, so the count may fall by a few; a thaw empties it
        assert gc.get_freeze_count() > held // 2 > 0
    finally:
        gc.unfreeze()
