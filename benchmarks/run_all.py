"""`make bench`: every benchmark in this folder, one after the other, at small sizes by default.

    .venv/bin/python benchmarks/run_all.py                 # small sizes: a few minutes on 2 cores
    .venv/bin/python benchmarks/run_all.py --smoke         # each benchmark's --smoke (what `make test` runs)
    .venv/bin/python benchmarks/run_all.py --full          # each benchmark's own defaults (the RESULTS.md sizes)
    .venv/bin/python benchmarks/run_all.py --only scale merge_memory

Each benchmark runs as its own `nice -n 19` process (the machine is usually shared) and prints its
own table and a `RATIO <benchmark> ...` line (its figure against its baseline); this script only
prints which ones failed and exits 1 if any did. A benchmark that cannot run (a missing venv, a
missing RATIO line) is a failure, never a skip: tests/benchmarks/test_benchmark_smoke.py runs
each one's --smoke in `make test`.
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


# name -> (script, small args, full args, requirement or None); --smoke passes ["--smoke"]
BENCHMARKS: dict[str, tuple[str, list[str], list[str], Path | None]] = {
    "storage_throughput": ("storage_throughput.py", ["--rows", "2000"], [], None),
    "validate_throughput": (
        "validate_throughput.py",
        ["--tokens", "500000", "--small", "100000", "--repeat", "1"],
        [],
        None,
    ),
    "json_decode": ("json_decode.py", ["--repeats", "3"], [], None),
    "nucleus_count": ("nucleus_count.py", ["--tokens", "512", "--repeats", "3"], [], None),
    "extract_throughput": ("extract_throughput.py", ["--samples", "16", "--repeats", "1"], [], None),
    "sglang_client": ("sglang_client.py", ["--requests", "256"], [], None),
    "overflow_client": ("overflow_client.py", ["--requests", "1024"], [], None),
    "merge_memory": ("merge_memory.py", ["--sizes", "500x1195", "2000x1195"], ["--full"], None),
    "scale": ("scale.py", ["--sizes", "100", "400", "--shard-tokens", "65536"], ["--full"], None),
    "prompt_memory": ("prompt_memory.py", ["--sizes", "200", "800"], ["--sizes", "1000", "8000", "16000"], None),
    "export_memory": (
        "export_memory.py",
        ["--sizes", "1000", "5000", "--tokens", "512", "--baseline-max", "5000"],
        [],
        None,
    ),
    "conversation_memory": ("conversation_memory.py", ["--sizes", "1000", "5000"], [], None),
    "stage_startup": ("stage_startup.py", ["--repeats", "2"], [], None),
    # vLLM's own venv (make vllm-venv); the full gpu_extract wants a GPU (benchmarks/gpu_extract.sh)
    "vllm_extract": ("vllm_extract.py", ["--samples", "16", "--repeats", "1"], [], REPO / ".venv-vllm" / ".installed"),
    "gpu_extract": ("gpu_extract.py", ["--smoke"], [], REPO / ".venv-vllm" / ".installed"),
    # the probe: speculators' venv (make speculators-venv); the full gpu_probe wants a GPU (benchmarks/gpu_probe.sh)
    "probe_faults": ("probe_faults.py", [], [], REPO / ".venv-speculators" / "bin" / "python"),
    "probe_resplit": ("probe_resplit.py", [], [], REPO / ".venv-speculators" / "bin" / "python"),
    "gpu_probe": ("gpu_probe.py", ["--smoke"], [], REPO / ".venv-speculators" / "bin" / "python"),
}
NEEDS_TOKENIZER = {"validate_throughput", "stage_startup"}


def command(name: str, mode: str) -> list[str]:
    """The benchmark's command line (without `nice` and the interpreter) in mode small|smoke|full;
    raises FileNotFoundError when what it needs is missing."""
    script, small, full, needs = BENCHMARKS[name]
    if not (HERE / script).exists() or (needs is not None and not needs.exists()):
        raise FileNotFoundError(f"{name}: missing {needs or script}")
    args = {"small": small, "smoke": ["--smoke"], "full": full}[mode]
    extra = ["--tokenizer", _tokenizer()] if name in NEEDS_TOKENIZER else []
    return [str(HERE / script), *args, *extra]


# --smoke (what `make test` runs): one compute thread per process. torch's OpenMP pool (and the
# BLAS libraries') defaults to every core and spins while it waits for work; on make test's two
# shared cores, beside the other pytest process and its engines, the spinning was about half of a
# torch benchmark's CPU at smoke size (extract_throughput: 28.6 -> 15.4 CPU s, RESULTS.md), and a
# smoke's rates are not figures. The other modes keep the libraries' defaults: they measure.
SMOKE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def env(mode: str = "small") -> dict:
    """The benchmark's environment in mode small|smoke|full: this checkout first on PYTHONPATH."""
    return {
        **os.environ,
        **(SMOKE_ENV if mode == "smoke" else {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "include"), str(REPO), os.environ.get("PYTHONPATH")])),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="each benchmark's full sizes instead of the small ones")
    p.add_argument("--smoke", action="store_true", help="each benchmark's --smoke: seconds each (make test)")
    p.add_argument("--only", nargs="*", choices=sorted(BENCHMARKS), help="run these only")
    args = p.parse_args()
    mode = "full" if args.full else "smoke" if args.smoke else "small"
    outcome: dict[str, str] = {}
    for name in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        try:
            cmd = ["nice", "-n", "19", sys.executable, *command(name, mode)]
        except FileNotFoundError as exc:
            outcome[name] = f"FAILED ({exc})"
            continue
        print(f"\n=== {name}: {' '.join(cmd[3:])}", flush=True)
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env(mode), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(done.stdout, end="", flush=True)
        ratio = any(line.startswith(f"RATIO {name} ") for line in done.stdout.splitlines())
        ok = done.returncode == 0 and ratio
        why = f"exit {done.returncode}" if done.returncode else "no RATIO line"
        outcome[name] = f"{'ok' if ok else f'FAILED ({why})'} in {time.perf_counter() - t:.0f} s"
    print("\n=== summary")
    for name, what in outcome.items():
        print(f"  {name:22s} {what}")
    return 1 if any(w.startswith("FAILED") for w in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
