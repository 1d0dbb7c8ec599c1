"""`make bench`: every benchmark in this folder, one after the other, at small sizes by default.

    .venv/bin/python benchmarks/run_all.py                 # small sizes: a few minutes on 2 cores
    .venv/bin/python benchmarks/run_all.py --full          # each benchmark's own defaults (the RESULTS.md sizes)
    .venv/bin/python benchmarks/run_all.py --only scale merge_memory

Each benchmark runs as its own `nice -n 19` process (the machine is usually shared) and prints its
own table; this script only prints which ones failed and exits 1 if any did. Benchmarks that need
something this checkout lacks (the vLLM venv) are reported as skipped, not failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _tokenizer() -> str:
    sys.path.insert(0, str(REPO / "include"))
    from eagle3_data.builds.kimi_tokenizer import cached_kimi_tokenizer

    return str(cached_kimi_tokenizer(REPO / ".cache"))


# name -> (script, small args, full args, requirement or None)
BENCHMARKS: dict[str, tuple[str, list[str], list[str], Path | None]] = {
    "storage_throughput": ("storage_throughput.py", ["--rows", "2000"], [], None),
    "validate_throughput": ("validate_throughput.py", ["--tokens", "500000", "--small", "100000", "--repeat", "1"], [], None),
    "extract_throughput": ("extract_throughput.py", ["--samples", "16", "--repeats", "1"], [], None),
    "sglang_client": ("sglang_client.py", ["--requests", "256"], [], None),
    "overflow_client": ("overflow_client.py", ["--requests", "1024"], [], None),
    "merge_memory": ("merge_memory.py", ["--sizes", "500x1195", "2000x1195"], ["--full"], None),
    "scale": ("scale.py", ["--sizes", "100", "400", "--shard-tokens", "65536"], ["--full"], None),
    "prompt_memory": ("prompt_memory.py", ["--sizes", "200", "800"], ["--sizes", "1000", "8000", "16000"], None),
    "stage_startup": ("stage_startup.py", ["--repeats", "2"], [], None),
    # vLLM's own venv (make vllm-venv); the full gpu_extract wants a GPU (benchmarks/gpu_extract.sh)
    "vllm_extract": ("vllm_extract.py", ["--samples", "16", "--repeats", "1"], [], REPO / ".venv-vllm" / ".installed"),
    "gpu_extract": ("gpu_extract.py", ["--smoke"], [], REPO / ".venv-vllm" / ".installed"),
}
NEEDS_TOKENIZER = {"validate_throughput", "stage_startup"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="each benchmark's full sizes instead of the small ones")
    p.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), help="run these only")
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "include"), os.environ.get("PYTHONPATH")]))}
    outcome: dict[str, str] = {}
    for name, (script, small, full, needs) in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        if not (HERE / script).exists() or (needs is not None and not needs.exists()):
            outcome[name] = "skipped (missing " + str(needs or script) + ")"
            continue
        extra = ["--tokenizer", _tokenizer()] if name in NEEDS_TOKENIZER else []
        cmd = ["nice", "-n", "19", sys.executable, str(HERE / script), *(full if args.full else small), *extra]
        print(f"\n=== {name}: {' '.join(cmd[3:])}", flush=True)
        t = time.perf_counter()
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        outcome[name] = f"{'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t:.0f} s"
    print("\n=== summary")
    for name, what in outcome.items():
        print(f"  {name:22s} {what}")
    return 1 if any(w.startswith("FAILED") for w in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
