"""Overflow client throughput: achieved requests/s over the ideal C/L, against the dev server.

The dev server answers every chat completion after a fixed latency L; with C requests in flight
the ideal rate is C/L. Measured in the same run, same server, same prompts, rounds alternating the
order so machine-load drift hits every variant:
  bare          a bare aiohttp loop (C coroutines posting JSON, `resp.json()`): what this machine
                and this server allow at all for plain requests
  bare-stream   the same loop asking `stream: true`, reading the SSE body whole and decoding its
                data events: what the machine and the server allow for streamed requests (the dev
                server's own cost of streaming, ~60 events per answer, is in this baseline too)
  stage         `generate_overflow` end to end as shipped (streamed: `generation.overflow.stream`, the
                default; `openrouter_http.SdkPost.stream`; retries, budget, journal, S3
                checkpoints; uvloop)
  stage-plain   the same with `stream=False` (`SdkPost.post`)
  stage-previous the same as `stage` with the streamed send as it was before issue 33 (a line
                iterator, and a new connection per request: `previous_transport`), for the A/B
  stage-decode-on-send the same as `stage` with each answer decoded before its worker sends
                again (`decode_on_send`: the order before the answers were handed on undecoded)
  stage-asyncio the same as `stage` on the stdlib event loop
  stage-gc      the same as `stage` with the interpreter's default garbage-collection thresholds
                (the stage raises them while it runs: `openrouter.fewer_gc_pauses`)
Each line: req/s, fraction of ideal, fraction of the bare baseline of its own kind in that round
(`stage` and the stage-* streamed variants against `bare-stream`, `stage-plain` against `bare`),
and CPU ms per request of the client (this process) and of the server (its process), the
load-independent figures. `--server minimal` swaps the dev server for `MinimalChatServer` (one
canned answer, plain or as the dev server's SSE events in one write; ~10x less server CPU per
request) to measure the client where the dev server, one Python process, is the limit.

    .venv/bin/python benchmarks/overflow_client.py [--concurrency 256] [--latency 0.5] [--requests 4096]
        [--rounds 3] [--variants bare bare-stream stage stage-plain] [--server dev|minimal]
    .venv/bin/python benchmarks/overflow_client.py --smoke      # make test: seconds, checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "moonshotai/kimi-k2.5"  # the dev server's model: a request for another is a 400, as on OpenRouter
VARIANTS = [
    "bare",
    "bare-stream",
    "stage",
    "stage-plain",
    "stage-previous",
    "stage-decode-on-send",
    "stage-asyncio",
    "stage-gc",
]
BASELINE = {
    "stage": "bare-stream",
    "stage-decode-on-send": "bare-stream",
    "stage-previous": "bare-stream",
    "stage-asyncio": "bare-stream",
    "stage-gc": "bare-stream",
    "stage-plain": "bare",
}


def prompts(n: int) -> list[dict]:
    return [
        {
            "sample_id": f"b{i:06d}",
            "dataset": "bench",
            "sample_index": i,
            "route": "overflow",
            "tools": None,
            "messages": json.dumps([{"role": "user", "content": f"Benchmark prompt {i % 64}."}]),
        }
        for i in range(n)
    ]


async def bare_client(url: str, rows: list[dict], concurrency: int, stream: bool = False) -> float:
    """The fastest plain client on this box (aiohttp): C coroutines posting and parsing JSON; with
    `stream`, the body read whole and its `data:` events decoded."""
    import aiohttp

    it = iter(rows)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8)) as http:

        async def worker():
            for r in it:
                body = {"model": MODEL, "messages": json.loads(r["messages"]), "max_tokens": 256}
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                async with http.post(
                    f"{url}/v1/chat/completions", headers={"X-Eagle3-Sample-Id": "base-" + r["sample_id"]}, json=body
                ) as resp:
                    if not stream:
                        await resp.json()
                        continue
                    raw = await resp.read()
                for line in raw.split(b"\n"):
                    if line.startswith(b"data: {"):
                        json.loads(line[6:])

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t


class Decoded:
    """An answer decoded on the wire, as the client's `Received` stands for one: `answer()` gives it."""

    def __init__(self, data: dict):
        self.data = data

    def answer(self) -> dict:
        return self.data


def decode_on_send():
    """`stage-decode-on-send`: the shipped send, its answer decoded before the worker goes on."""
    from eagle3_data.stages.generate import openrouter_http as h

    class DecodeOnSend(h.SdkPost):
        async def stream(self, body, headers, on_open=None):
            return Decoded((await super().stream(body, headers, on_open)).answer())

    return DecodeOnSend


def previous_transport():
    """`stage-previous`: the streamed send as it was before issue 33 (openrouter_http at 509c5d3),
    for the A/B in one run: aiohttp's line iterator (an await per SSE line), and the response left
    after `[DONE]` without reading the body's end, so aiohttp closed the connection (a new TCP
    connection per streamed request)."""
    import aiohttp
    import openai

    from eagle3_data import json_records
    from eagle3_data.stages.generate import openrouter_http as h

    async def read_events_by_line(content, answer, named) -> bool:
        data: list[str] = []

        def dispatch() -> bool:
            text = "\n".join(data)
            data.clear()
            if text == "[DONE]":
                return True
            chunk = json_records.loads(text)
            if isinstance(chunk, dict):
                named(chunk.get("id") if isinstance(chunk.get("id"), str) else None)
            answer.add(chunk)
            return False

        async for raw in content:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line:
                if data and dispatch():
                    return True
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
        return bool(data) and dispatch()

    class PreviousSdkPost(h.SdkPost):
        async def stream(self, body, headers, on_open=None):
            answer, opened, gid = h.StreamAnswer(), False, None

            def named(value):
                nonlocal opened, gid
                if not opened:
                    opened, gid = True, value
                    if on_open is not None:
                        on_open(value)

            try:
                async with self.http.post(
                    self.url, data=body, headers={**self.headers, **headers}, timeout=self.stream_timeout
                ) as r:
                    if r.status >= 300:
                        self._raise_status(r.status, r.raw_headers, await r.read())
                    if r.headers.get(h.GENERATION_HEADER):
                        named(r.headers[h.GENERATION_HEADER])
                    done = await read_events_by_line(r.content, answer, named)
            except asyncio.TimeoutError as exc:
                raise openai.APITimeoutError(request=self._request()) from exc
            except aiohttp.ClientError as exc:
                raise openai.APIConnectionError(request=self._request()) from exc
            if not done and not answer.finished:
                raise h.AttemptLost("stream ended without its last chunk", gid or answer.id)
            return Decoded(answer.completion())

    return PreviousSdkPost


def _cpu() -> float:
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])


def run_stage(store, ref, rows, fmt, url: str, concurrency: int, journal_dir: Path, *, stream: bool = True) -> dict:
    from eagle3_data.config import OverflowGenerationConfig
    from eagle3_data.stages.generate import openrouter
    from eagle3_data.stages.generate.checkpoint import StageSetup

    return openrouter.generate_overflow(
        store,
        ref,
        rows,
        fmt,
        url + "/v1",
        "bench-key",
        {"max_new_tokens": 256},
        config=OverflowGenerationConfig(model=MODEL, concurrency=concurrency, rows_per_part=256, stream=stream),
        runtime=openrouter.OverflowRuntime(capped=False),
        setup=StageSetup(journal_dir=journal_dir),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--latency", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["bare", "bare-stream", "stage", "stage-plain"], choices=VARIANTS)
    ap.add_argument("--server", choices=["dev", "minimal"], default="dev")
    ap.add_argument("--smoke", action="store_true", help="C=32 N=128 L=0.2, one round: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.requests, args.latency, args.rounds = 32, 128, 0.2, 1

    import psutil
    from minimal_server import MinimalServerProcess

    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.dev.inference_server import DevServerProcess
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
    from eagle3_data.stages.generate import openrouter
    from eagle3_data.storage import ArtifactStore, StageRef
    from eagle3_data.tokenizer import load_tokenizer

    tok_dir = cached_kimi_tokenizer(REPO / ".cache")  # .cache/kimi-tokenizer-<key>, built once
    fmt = get_output_format(load_tokenizer(str(tok_dir)), thinking=True)
    C, L, N = args.concurrency, args.latency, args.requests
    ideal = C / L
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        s3 = start_seaweedfs(
            Path(tmp) / "s3", access_key="bench", secret_key=secrets.token_hex(16), die_with_parent=True
        )
        server = None
        try:
            server = DevServerProcess(tok_dir) if args.server == "dev" else MinimalServerProcess(latency_s=L)
            server_proc = psutil.Process(server.proc.pid)
            if args.server == "dev":
                server.configure({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": L}}}})
            client = s3.client()
            client.create_bucket(Bucket="bench")
            store = ArtifactStore(client=client, bucket="bench", prefix="bench")
            asyncio.run(bare_client(server.url, prompts(64), 32))  # warm the server's caches
            # and the client's first-use costs (imports, template compile, S3 writer): not per request
            run_stage(
                store,
                StageRef(run_key="warm", stage="generate_overflow", dataset="w"),
                [{**row, "sample_id": "w" + row["sample_id"]} for row in prompts(32)],
                fmt,
                server.url,
                32,
                Path(tmp) / "journal",
            )
            for r in range(args.rounds):
                order = args.variants if r % 2 == 0 else args.variants[::-1]
                for v in order:
                    rows = [{**row, "sample_id": f"r{r}{v}-{row['sample_id']}"} for row in prompts(N)]
                    load = os.getloadavg()[0]
                    s0, c0 = sum(server_proc.cpu_times()[:2]), _cpu()
                    if v.startswith("bare"):
                        seconds = asyncio.run(bare_client(server.url, rows, C, stream=v == "bare-stream"))
                    else:
                        saved = openrouter.run_event_loop, openrouter.fewer_gc_pauses, openrouter.SdkPost
                        if v == "stage-previous":
                            openrouter.SdkPost = previous_transport()
                        if v == "stage-decode-on-send":
                            openrouter.SdkPost = decode_on_send()
                        if v == "stage-asyncio":
                            openrouter.run_event_loop = asyncio.run
                        if v == "stage-gc":
                            openrouter.fewer_gc_pauses = contextlib.nullcontext
                        ref = StageRef(run_key=f"bench-{r}", stage="generate_overflow", dataset=v)
                        t = time.perf_counter()
                        try:
                            summary = run_stage(
                                store, ref, rows, fmt, server.url, C, Path(tmp) / "journal", stream=v != "stage-plain"
                            )
                        finally:
                            openrouter.run_event_loop, openrouter.fewer_gc_pauses, openrouter.SdkPost = saved
                        seconds = time.perf_counter() - t
                        assert summary["complete"] and summary["counts"]["ok"] == N, summary
                    rps = N / seconds
                    row = {
                        "round": r,
                        "rps": rps,
                        "client_ms": (_cpu() - c0) / N * 1e3,
                        "server_ms": (sum(server_proc.cpu_times()[:2]) - s0) / N * 1e3,
                        "load": load,
                    }
                    results[v].append(row)
                    print(
                        f"round {r} {v:13s} {rps:7.1f} req/s = {rps / ideal:.3f} of ideal"
                        + f"; CPU ms/request client {row['client_ms']:.2f}, server {row['server_ms']:.2f}; load "
                        f"{load:.1f}",
                        flush=True,
                    )
                for v in args.variants:  # against the baseline of its kind measured in the same round
                    base = BASELINE.get(v)
                    if base in results and results[v]:
                        results[v][-1]["vs_bare"] = results[v][-1]["rps"] / results[base][-1]["rps"]
        finally:
            if server is not None:
                server.stop()
            stop_seaweedfs(Path(tmp) / "s3", grace=0.5)
    print(f"\nC={C} L={L}s N={N} server={args.server}: ideal {ideal:.0f} req/s; {args.rounds} round(s), min-max")
    print(
        "| client | req/s | / ideal | / bare of its kind (same round) | client CPU ms/req | server CPU ms/req | load "
        "avg |"
    )
    print("|---|---|---|---|---|---|---|")

    def span(vals, fmt="{:.3f}"):
        vals = [x for x in vals if x is not None]
        if not vals:
            return "—"
        lo, hi = min(vals), max(vals)
        return (
            fmt.format(lo)
            if len(vals) == 1 or fmt.format(lo) == fmt.format(hi)
            else f"{fmt.format(lo)}-{fmt.format(hi)}"
        )

    for v, rows in results.items():
        print(
            f"| {v} | {span([x['rps'] for x in rows], '{:.0f}')} | {span([x['rps'] / ideal for x in rows])} | "
            f"{span([x.get('vs_bare') for x in rows])} | {span([x['client_ms'] for x in rows], '{:.2f}')} | "
            f"{span([x['server_ms'] for x in rows], '{:.2f}')} | {span([x['load'] for x in rows], '{:.1f}')} |"
        )
    for v, rows in results.items():
        if BASELINE.get(v) in results:
            print(f"RATIO overflow_client {v}/{BASELINE[v]} = {span([x.get('vs_bare') for x in rows])}")


if __name__ == "__main__":
    main()
