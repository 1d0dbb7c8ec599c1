"""Shared pieces of the scale and memory benchmarks.

- `seaweedfs()`: a real SeaweedFS on free ports for the benchmark's lifetime (stopped by PID).
- `write_generations(...)`: N synthetic generations rows of ~L tokens each, built from numpy buffers
  (never Python lists: the writer of a 10^8-token input must not need 10 GB itself).
- `measure(code, env)`: runs `code` in a fresh Python process, as an Airflow task runs its library
  call, and returns its own work seconds (wall and CPU, timed inside, after imports) and peak RSS
  (that process's own high-water mark, VmHWM; see MEASURE_EPILOGUE).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parent.parent
VOCAB = 163_840


@contextlib.contextmanager
def seaweedfs():
    """Yields (handle, env): env holds what a child needs to reach it (endpoint + keys)."""
    from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs

    with tempfile.TemporaryDirectory(prefix="bench-s3-") as root:
        handle = start_seaweedfs(
            root, access_key="b-" + secrets.token_hex(4), secret_key=secrets.token_hex(16), die_with_parent=True
        )
        try:
            env = {
                "AWS_ENDPOINT_URL_S3": handle.endpoint_url,
                "AWS_ACCESS_KEY_ID": handle.access_key,
                "AWS_SECRET_ACCESS_KEY": handle.secret_key,
                "AWS_REGION": "us-east-1",
            }
            yield handle, env
        finally:
            stop_seaweedfs(root, grace=0.5)


def store_for(handle, bucket: str):
    from eagle3_data.storage import ArtifactStore

    client = handle.client()
    with contextlib.suppress(Exception):
        client.create_bucket(Bucket=bucket)
    return ArtifactStore(client=client, bucket=bucket, prefix="eagle3-datagen")


def synthetic_ids(rng: np.random.Generator, n: int, mean_tokens: int, prompt_share: float = 0.25):
    """(prompt ListArray, output ListArray) of n rows, lengths around mean_tokens (+-50%)."""
    total = rng.integers(max(2, mean_tokens // 2), max(3, mean_tokens * 3 // 2) + 1, n)
    prompt = np.maximum(1, (total * prompt_share).astype(np.int64))
    output = np.maximum(1, total - prompt)

    def lists(lengths: np.ndarray) -> pa.ListArray:
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    return lists(prompt), lists(output)


def write_generations(
    store,
    ref,
    n: int,
    mean_tokens: int,
    *,
    source: str = "sglang",
    seed: int = 0,
    chunk: int = 4096,
    rows_per_part: int = 1024,
    id_prefix: str = "s",
) -> int:
    """Write n synthetic generations rows to `ref` (committed). Returns the token count."""
    from eagle3_data.schemas import GENERATIONS
    from eagle3_data.storage.writer import StageWriter

    rng = np.random.default_rng(seed)
    tokens = 0
    with StageWriter(
        store, ref, "generations", rows_per_part=rows_per_part, tokenizer_sha256="tok", template_sha256="tpl"
    ) as w:
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            prompt, output = synthetic_ids(rng, m, mean_tokens)
            tokens += len(prompt.values) + len(output.values)
            cols = {
                "sample_id": pa.array([f"{id_prefix}{i}" for i in range(start, start + m)]),
                "dataset": pa.array([ref.dataset] * m),
                "messages": pa.array(["[]"] * m),
                "prompt_ids": prompt,
                "output_ids": output,
                "source": pa.array([source] * m),
                "status": pa.array(["ok"] * m),
                "finish_reason": pa.array(["stop"] * m),
                "provenance": pa.array(['{"model": "synthetic"}'] * m),
            }
            arrays = [cols[f.name].cast(f.type) if f.name in cols else pa.nulls(m, f.type) for f in GENERATIONS]
            w.write(pa.Table.from_arrays(arrays, schema=GENERATIONS))
        w.commit()
    return tokens


MEASURE_PRELUDE = """
import json, os, resource, sys, time
sys.path.insert(0, {repo!r})
"""

# Peak RSS is the process's own VmHWM, not `ru_maxrss`: Linux carries the spawning process's
# high-water mark across fork/vfork + exec into the child's ru_maxrss, so a benchmark parent that
# held 1 GiB (scale.py's 83k prompts file) made every stage child report >= 1 GiB.
MEASURE_EPILOGUE = """
__work = time.perf_counter() - __t0
__ru = resource.getrusage(resource.RUSAGE_SELF)
try:
    __hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
except (OSError, StopIteration):
    __hwm = __ru.ru_maxrss
print("@@RESULT@@" + json.dumps({"work_s": __work, "cpu_s": __ru.ru_utime + __ru.ru_stime - __cpu0,
                                 "peak_rss_mib": __hwm / 1024, "result": globals().get("RESULT")}))
"""


IN_PROCESS = False  # --smoke: stages run in this process (no interpreter start and imports per stage)


def measure(setup: str, work: str, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run `setup` (imports, not timed) then `work` (timed) in a fresh `nice -n 19` Python process.

    `work` may set RESULT (JSON-able) to pass something back. Raises with the child's stderr on failure.
    With IN_PROCESS (a benchmark's --smoke) both run in this process with `env` set meanwhile:
    seconds, not figures (peak RSS is then this process's high-water mark, not the stage's).
    """
    if IN_PROCESS:
        return _measure_here(setup, work, env or {})
    code = (
        MEASURE_PRELUDE.format(repo=str(REPO))
        + textwrap.dedent(setup)
        + "\n__t0 = time.perf_counter()\n__cpu0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])\n"
        + textwrap.dedent(work)
        + MEASURE_EPILOGUE
    )
    proc = subprocess.run(
        ["nice", "-n", "19", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@") :])
    raise RuntimeError(f"benchmark child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def _measure_here(setup: str, work: str, env: dict) -> dict:
    import resource
    import time

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        scope: dict = {"__name__": "__bench__"}
        exec(compile("import json, os, sys\n" + textwrap.dedent(setup), "<setup>", "exec"), scope)
        cpu0, t0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), time.perf_counter()
        exec(compile(textwrap.dedent(work), "<work>", "exec"), scope)
        work_s, cpu_s = time.perf_counter() - t0, sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with open("/proc/self/status") as status:
        hwm = next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    return {
        "work_s": work_s,
        "cpu_s": cpu_s,
        "peak_rss_mib": hwm / 1024,
        "result": json.loads(json.dumps(scope.get("RESULT"), default=str)),
    }


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table: columns are (key, header); floats get 3 significant figures."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    out = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(out)


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x."""
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float("nan")
    return float(np.polyfit(x, y, 1)[0])


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
