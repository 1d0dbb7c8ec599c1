"""SGLang client in-flight depth: does `generate_local` keep every endpoint N requests deep?

The dev server answers `/generate` after a fixed latency L, so an endpoint kept N deep serves N/L
requests/s; the ratio achieved/(N/L) is the share of time the slots were full. Baseline in the same
run: a bare aiohttp loop with N coroutines against the same server (what this machine allows).

    .venv/bin/python benchmarks/sglang_client.py [--in-flight 64] [--latency 0.5] [--requests 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


async def bare_client(url: str, prompt_ids: list[int], n: int, depth: int) -> float:
    import aiohttp

    it = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=depth + 8)) as http:

        async def worker():
            for i in it:
                body = {
                    "input_ids": prompt_ids + [i % 64],
                    "sampling_params": {"max_new_tokens": 256},
                    "rid": f"base-{i}",
                }
                async with http.post(f"{url}/generate", json=body) as resp:
                    await resp.json()

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(depth)))
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--latency", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.in_flight, args.latency = 64, 16, 0.1

    from transformers import AutoTokenizer

    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer
    from eagle3_data.chat_format import get_output_format
    from eagle3_data.config import LocalGenerationConfig
    from eagle3_data.dev.inference_server import DevServerProcess
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
    from eagle3_data.engines import wire_for
    from eagle3_data.stages.generate import local
    from eagle3_data.stages.generate.checkpoint import StageSetup
    from eagle3_data.storage import ArtifactStore, StageRef

    tok_dir = cached_kimi_tokenizer(REPO / ".cache")  # .cache/kimi-tokenizer-<key>, built once
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    N, L, D = args.requests, args.latency, args.in_flight
    ideal = D / L
    rows = [
        {
            "sample_id": f"b{i:06d}",
            "dataset": "bench",
            "sample_index": i,
            "route": "local",
            "tools": None,
            "messages": json.dumps([{"role": "user", "content": f"Benchmark prompt {i % 64}."}]),
        }
        for i in range(N)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        s3 = start_seaweedfs(
            Path(tmp) / "s3", access_key="bench", secret_key=secrets.token_hex(16), die_with_parent=True
        )
        server = DevServerProcess(tok_dir)
        try:
            server.configure({"endpoints": {"generate": {"latency": {"dist": "fixed", "mean": L}}}})
            base_s = asyncio.run(bare_client(server.url, tok.encode("Benchmark prompt"), N, D))
            server.configure({"endpoints": {"generate": {"latency": {"dist": "fixed", "mean": L}}}})
            client = s3.client()
            client.create_bucket(Bucket="bench")
            store = ArtifactStore(client=client, bucket="bench", prefix="bench")
            ref = StageRef(run_key="bench", stage="generate_local", dataset="bench")
            t = time.perf_counter()
            summary = local.generate_local(
                store,
                ref,
                rows,
                get_output_format(tok, thinking=True),
                [server.url],
                {"max_new_tokens": 256},
                wire=wire_for("sglang"),
                config=LocalGenerationConfig(in_flight_per_endpoint=D, rows_per_part=256),
                setup=StageSetup(journal_dir=Path(tmp) / "journal"),
            )
            stage_s = time.perf_counter() - t
            assert summary["complete"] and summary["counts"]["ok"] == N, summary
            depth = server.stats()["max_in_flight"]["generate"]
        finally:
            server.stop()
            stop_seaweedfs(Path(tmp) / "s3", grace=0.5)
    base_rps, stage_rps = N / base_s, N / stage_s
    print(f"in_flight={D} L={L}s N={N}: ideal {ideal:.0f} req/s")
    print(f"baseline bare aiohttp: {base_rps:7.1f} req/s = {base_rps / ideal:.3f} of ideal")
    print(
        f"generate_local       : {stage_rps:7.1f} req/s = {stage_rps / ideal:.3f} of ideal (mean depth "
        f"{stage_rps * L:.1f} of {D}), {stage_rps / base_rps:.3f} of baseline; server max in flight {depth}"
    )
    print(f"RATIO sglang_client generate_local/bare = {stage_rps / base_rps:.3f}; /ideal = {stage_rps / ideal:.3f}")


if __name__ == "__main__":
    main()
