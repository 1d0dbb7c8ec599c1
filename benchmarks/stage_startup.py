"""Start-up of a pipeline stage's library call in a fresh process: the HF tokenizer + chat
template (what load_route / generate_* need) vs the verified tiktoken fast start (what
reconstruct / validate / merge take, `output_format(run, store, template=False)`).

    nice -n 19 .venv/bin/python benchmarks/stage_startup.py --tokenizer DIR [--repeats 5]

Each repeat starts one fresh `python` per mode, alternating (a baseline in the same run); the
figure is the whole process: interpreter start, `import eagle3_data.pipeline`, config load,
tokenizer load and the output format bound to it. The verification record is written once first
(into a temporary EAGLE3_DATA_CACHE), as the first bulk stage on a host does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, types
from eagle3_data.config import load_config
from eagle3_data.runs.run import Run, output_format
config = load_config().with_overrides({"tokenizer": {"source": sys.argv[1]}}, where="bench")
run = Run(config=config, run_key="bench", date=None, datasets=config.dataset_names, dry_run=False,
skip_hidden_states=False)
fmt = output_format(run, types.SimpleNamespace(client=None), template=sys.argv[2] == "template")
assert fmt.codec.encode_batch(["warm"])
print(type(getattr(fmt, "tokenizer", None)).__name__)
"""


def _once(tokenizer: str, mode: str, env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tokenizer, mode], env=env, check=True, capture_output=True, text=True
    )
    return time.perf_counter() - t0, out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.repeats = 1
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "EAGLE3_DATA_CACHE": cache, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        _once(args.tokenizer, "bulk", env)  # first bulk start on this host: verifies and records
        times: dict[str, list[float]] = {"template": [], "bulk": []}
        codecs = {}
        for _ in range(args.repeats):
            for mode in times:
                seconds, codecs[mode] = _once(args.tokenizer, mode, env)
                times[mode].append(seconds)
    print(
        f"{'mode':<10} {'tokenizer':<24} {'median s':>9} {'min s':>7} {'max s':>7}  (fresh process, {args.repeats} "
        "repeats)"
    )
    for mode, ts in times.items():
        print(f"{mode:<10} {codecs[mode]:<24} {statistics.median(ts):>9.2f} {min(ts):>7.2f} {max(ts):>7.2f}")
    print(
        f"speed-up of the stage start: {statistics.median(times['template']) / statistics.median(times['bulk']):.1f}x"
    )
    print(
        "RATIO stage_startup template/bulk = "
        f"{statistics.median(times['template']) / statistics.median(times['bulk']):.2f}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "include"))
    main()
