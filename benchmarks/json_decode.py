"""JSON decoding of what the generation clients receive: `json_records.fast_loads` (msgspec, with
the standard library's fallback) against `json.loads` on the same bytes, in the same run.

py-spy on generate_local (benchmarks/scale.py, 2026-12-04) put 31% of its request loop in
`json.loads` of the engine's answers since they carry per-token log-probabilities; this measures
the parse alone on the two shapes the clients decode:
- an SGLang `/generate` answer of `--tokens` output ids with `meta_info.output_token_logprobs`
  ([logprob, id, text] per id) and the text (what generate_local decodes per answer);
- `--events` OpenRouter stream chunks joined as one array (what the overflow client's
  `_decode_events` parses per piece of a streamed answer).
Both decoders must give the same value (asserted); the figure is the median of `--repeats`
alternating timings of `--loops` parses each.

    .venv/bin/python benchmarks/json_decode.py [--tokens 1740] [--events 60] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "include"))

from eagle3_data.json_records import fast_loads


def sglang_answer(tokens: int, rng: random.Random) -> bytes:
    ids = [rng.randrange(163_840) for _ in range(tokens)]
    body = {
        "text": "".join(rng.choice("abcdefgh ") for _ in range(tokens * 4)),
        "output_ids": ids,
        "meta_info": {
            "id": "0f3a",
            "finish_reason": {"type": "length", "length": tokens},
            "prompt_tokens": 1200,
            "completion_tokens": tokens,
            "cached_tokens": 0,
            "output_token_logprobs": [[-rng.random() * 8, i, None] for i in ids],
        },
    }
    return json.dumps(body).encode()


def stream_events(events: int, rng: random.Random) -> bytes:
    chunk = {
        "id": "gen-1764800000-abc",
        "provider": "Moonshot AI",
        "model": "moonshotai/kimi-k2.5",
        "object": "chat.completion.chunk",
        "created": 1764800000,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }
    out = []
    for _ in range(events):
        chunk["choices"][0]["delta"]["content"] = "".join(rng.choice("abcdefgh ") for _ in range(24))
        out.append(json.dumps(chunk).encode())
    return b"[" + b",".join(out) + b"]"


def timed(decode, data: bytes, loops: int) -> float:
    t0 = time.perf_counter()
    for _ in range(loops):
        decode(data)
    return (time.perf_counter() - t0) / loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1740, help="output ids per SGLang answer (scale.py's mean)")
    ap.add_argument("--events", type=int, default=60, help="stream chunks per decoded piece")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--loops", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.repeats, args.loops = 1, 10
    rng = random.Random(33)
    shapes = {"sglang answer": sglang_answer(args.tokens, rng), "stream events": stream_events(args.events, rng)}
    print("| shape | bytes | json.loads ms | fast_loads ms | ratio |\n|---|---|---|---|---|")
    ratios = {}
    for name, data in shapes.items():
        assert fast_loads(data) == json.loads(data), name
        std, fast = [], []
        for _ in range(args.repeats):  # alternating: the machine's noise hits both alike
            std.append(timed(json.loads, data, args.loops))
            fast.append(timed(fast_loads, data, args.loops))
        s, f = statistics.median(std), statistics.median(fast)
        ratios[name] = s / f
        print(f"| {name} | {len(data):,} | {s * 1e3:.3f} | {f * 1e3:.3f} | {s / f:.2f} |")
    print(
        "RATIO json_decode json.loads/fast_loads: " + ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items())
    )


if __name__ == "__main__":
    main()
