"""Overflow client throughput: achieved requests/s over the ideal C/L, against the dev server.

The dev server answers every chat completion after a fixed latency L; with C requests in flight
the ideal rate is C/L. Measured in the same run, same server, same prompts, rounds alternating the
order so machine-load drift hits every variant:
  bare        a bare aiohttp loop (C coroutines posting JSON): what this machine allows at all
  stage       `generate_overflow` end to end as shipped (`openrouter.SdkPost`: SDK-built client,
              auth and errors over aiohttp; retries, budget, journal, S3 checkpoints; uvloop)
  stage-asyncio  the same on the stdlib event loop
  stage-gc    the same with the interpreter's default garbage-collection thresholds (the stage
              raises them while it runs: `openrouter.fewer_gc_pauses`)
  sdk-post    the same stage, requests sent through the SDK's generic `AsyncOpenAI.post` over its
              `DefaultAioHttpClient` transport, stdlib loop (what the stage did before)
Each line: req/s, fraction of ideal, fraction of the bare baseline of that round, and CPU ms per
request of the client (this process) and of the dev server (its process), the load-independent
figures. `--server minimal` swaps the dev server for `MinimalChatServer` (canned answer, ~10x
less server CPU per request) to measure the client where the dev server is the limit.

    .venv/bin/python benchmarks/overflow_client.py [--concurrency 256] [--latency 0.5] [--requests 4096]
        [--rounds 3] [--variants bare stage stage-gc sdk-post] [--server dev|minimal]
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


def prompts(n: int) -> list[dict]:
    return [{"sample_id": f"b{i:06d}", "dataset": "bench", "sample_index": i, "route": "overflow", "tools": None,
             "messages": json.dumps([{"role": "user", "content": f"Benchmark prompt {i % 64}."}])} for i in range(n)]


async def bare_client(url: str, rows: list[dict], concurrency: int) -> float:
    """The fastest plain client on this box (aiohttp): C coroutines posting and parsing JSON."""
    import aiohttp

    it = iter(rows)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8)) as http:
        async def worker():
            for r in it:
                async with http.post(f"{url}/v1/chat/completions", headers={"X-Eagle3-Sample-Id": "base-" + r["sample_id"]},
                                     json={"model": "m", "messages": json.loads(r["messages"]), "max_tokens": 256}) as resp:
                    await resp.json()
        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t


class SdkGenericPost:
    """The previous transport, for the A/B: the SDK's generic `post` (its whole request pipeline:
    option models, httpx2 request/headers/URL, the vendored aiohttp transport), same interface as
    `openrouter.SdkPost`."""

    def __init__(self, base_url: str, api_key: str, concurrency: int, timeout_s: float):
        import httpx2
        from openai import AsyncOpenAI, DefaultAioHttpClient

        limits = httpx2.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
        self.sdk = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                               http_client=DefaultAioHttpClient(limits=limits, timeout=timeout_s))

    async def post(self, body: dict, headers: dict) -> object:
        return await self.sdk.post("/chat/completions", cast_to=object, body=body, options={"headers": headers})

    async def close(self) -> None:
        await self.sdk.close()


def _cpu() -> float:
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--latency", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["bare", "stage", "stage-gc", "stage-asyncio", "sdk-post"],
                    choices=["bare", "stage", "stage-gc", "stage-asyncio", "sdk-post"])
    ap.add_argument("--server", choices=["dev", "minimal"], default="dev")
    args = ap.parse_args()

    import psutil

    from minimal_server import MinimalServerProcess

    from eagle3_data.dev.inference_server import DevServerProcess
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
    from eagle3_data.generation import openrouter
    from eagle3_data.storage import ArtifactStore, StageRef
    from eagle3_data.tokenizer import load_tokenizer

    tok_dir = cached_kimi_tokenizer(REPO / ".cache")  # .cache/kimi-tokenizer-<key>, built once
    tok = load_tokenizer(str(tok_dir))
    C, L, N = args.concurrency, args.latency, args.requests
    ideal = C / L
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        s3 = start_seaweedfs(Path(tmp) / "s3", access_key="bench", secret_key=secrets.token_hex(16), die_with_parent=True)
        server = DevServerProcess(tok_dir) if args.server == "dev" else MinimalServerProcess(latency_s=L)
        server_proc = psutil.Process(server.proc.pid)
        try:
            if args.server == "dev":
                server.configure({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": L}}}})
            client = s3.client()
            client.create_bucket(Bucket="bench")
            store = ArtifactStore(client=client, bucket="bench", prefix="bench")
            asyncio.run(bare_client(server.url, prompts(256), 64))  # warm the server's caches
            # and the client's first-use costs (imports, template compile, S3 writer): not per request
            openrouter.generate_overflow(store, StageRef(run_key="warm", stage="generate_overflow", dataset="w"),
                                         [{**row, "sample_id": "w" + row["sample_id"]} for row in prompts(64)], tok,
                                         server.url + "/v1", "bench-key", "m", {}, None,
                                         sampling={"max_new_tokens": 256, "thinking": True}, concurrency=64,
                                         journal_dir=Path(tmp) / "journal")
            for r in range(args.rounds):
                order = args.variants if r % 2 == 0 else args.variants[::-1]
                this_round = []
                for v in order:
                    rows = [{**row, "sample_id": f"r{r}{v}-{row['sample_id']}"} for row in prompts(N)]
                    load = os.getloadavg()[0]
                    s0, c0 = sum(server_proc.cpu_times()[:2]), _cpu()
                    if v == "bare":
                        seconds = asyncio.run(bare_client(server.url, rows, C))
                    else:
                        saved = openrouter.SdkPost, openrouter.run_event_loop, openrouter.fewer_gc_pauses
                        if v == "sdk-post":
                            openrouter.SdkPost = SdkGenericPost
                        if v in ("sdk-post", "stage-asyncio"):
                            openrouter.run_event_loop = asyncio.run
                        if v == "stage-gc":
                            openrouter.fewer_gc_pauses = contextlib.nullcontext
                        ref = StageRef(run_key=f"bench-{r}", stage="generate_overflow", dataset=v)
                        t = time.perf_counter()
                        try:
                            summary = openrouter.generate_overflow(
                                store, ref, rows, tok, server.url + "/v1", "bench-key", "m", {}, None,
                                sampling={"max_new_tokens": 256, "thinking": True}, concurrency=C, rows_per_part=256,
                                journal_dir=Path(tmp) / "journal")
                        finally:
                            openrouter.SdkPost, openrouter.run_event_loop, openrouter.fewer_gc_pauses = saved
                        seconds = time.perf_counter() - t
                        assert summary["complete"] and summary["counts"]["ok"] == N, summary
                    rps = N / seconds
                    row = {"rps": rps, "client_ms": (_cpu() - c0) / N * 1e3,
                           "server_ms": (sum(server_proc.cpu_times()[:2]) - s0) / N * 1e3, "load": load}
                    results[v].append(row)
                    this_round.append(row)
                    print(f"round {r} {v:9s} {rps:7.1f} req/s = {rps / ideal:.3f} of ideal"
                          + f"; CPU ms/request client {row['client_ms']:.2f}, server {row['server_ms']:.2f}; load {load:.1f}",
                          flush=True)
                base = results["bare"][-1]["rps"] if "bare" in results else None
                for row in this_round:
                    row["vs_bare"] = row["rps"] / base if base else None
        finally:
            server.stop()
            stop_seaweedfs(Path(tmp) / "s3", grace=0.5)
    print(f"\nC={C} L={L}s N={N} server={args.server}: ideal {ideal:.0f} req/s; {args.rounds} round(s), min-max")
    print("| client | req/s | / ideal | / bare (same round) | client CPU ms/req | server CPU ms/req | load avg |")
    print("|---|---|---|---|---|---|---|")

    def span(vals, fmt="{:.3f}"):
        vals = [x for x in vals if x is not None]
        if not vals:
            return "—"
        lo, hi = min(vals), max(vals)
        return fmt.format(lo) if len(vals) == 1 or fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"

    for v, rows in results.items():
        print(f"| {v} | {span([x['rps'] for x in rows], '{:.0f}')} | {span([x['rps'] / ideal for x in rows])} | "
              f"{span([x['vs_bare'] for x in rows if v != 'bare'])} | {span([x['client_ms'] for x in rows], '{:.2f}')} | "
              f"{span([x['server_ms'] for x in rows], '{:.2f}')} | {span([x['load'] for x in rows], '{:.1f}')} |")


if __name__ == "__main__":
    main()
