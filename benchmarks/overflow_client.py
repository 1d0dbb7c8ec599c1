"""Overflow client throughput: achieved requests/s over the ideal C/L, against the dev server.

The dev server answers every chat completion after a fixed latency L; with C requests in flight
the ideal rate is C/L. Two measurements in the same run, same server, same prompts:
  baseline  a bare aiohttp loop (C coroutines posting JSON): what this machine allows at all
  stage     `generate_overflow` end to end (openai SDK, retries, budget, journal, S3 checkpoints)
Prints both as ratios of C/L and the stage over the baseline.

    .venv/bin/python benchmarks/overflow_client.py [--concurrency 256] [--latency 0.5] [--requests 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--latency", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=4096)
    args = ap.parse_args()

    import secrets

    from transformers import AutoTokenizer

    from eagle3_data.dev.inference_server import DevServerProcess
    from eagle3_data.dev.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
    from eagle3_data.generation.openrouter import generate_overflow
    from eagle3_data.storage import ArtifactStore, StageRef

    tok_dir = cached_kimi_tokenizer(REPO / ".cache")  # .cache/kimi-tokenizer-<key>, built once
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    C, L, N = args.concurrency, args.latency, args.requests
    ideal = C / L
    with tempfile.TemporaryDirectory() as tmp:
        s3 = start_seaweedfs(Path(tmp) / "s3", access_key="bench", secret_key=secrets.token_hex(16))
        server = DevServerProcess(tok_dir)
        try:
            server.configure({"endpoints": {"chat": {"latency": {"dist": "fixed", "mean": L}}}})
            rows = prompts(N)
            base_s = asyncio.run(bare_client(server.url, rows, C))
            client = s3.client()
            client.create_bucket(Bucket="bench")
            store = ArtifactStore(client=client, bucket="bench", prefix="bench")
            ref = StageRef(run_key="bench", stage="generate_overflow", dataset="bench")
            t = time.perf_counter()
            summary = generate_overflow(store, ref, rows, tok, server.url + "/v1", "bench-key", "m", {}, None,
                                        sampling={"max_new_tokens": 256, "thinking": True}, concurrency=C,
                                        rows_per_part=256, journal_dir=Path(tmp) / "journal")
            stage_s = time.perf_counter() - t
            assert summary["complete"] and summary["counts"]["ok"] == N, summary
            depth = server.stats()["max_in_flight"]["chat"]
        finally:
            server.stop()
            stop_seaweedfs(Path(tmp) / "s3", grace=0.5)
    base_rps, stage_rps = N / base_s, N / stage_s
    print(f"C={C} L={L}s N={N}: ideal {ideal:.0f} req/s")
    print(f"baseline bare aiohttp: {base_rps:7.1f} req/s = {base_rps / ideal:.3f} of ideal")
    print(f"generate_overflow   : {stage_rps:7.1f} req/s = {stage_rps / ideal:.3f} of ideal, "
          f"{stage_rps / base_rps:.3f} of baseline; server max in flight {depth}")


if __name__ == "__main__":
    main()
