"""Peak RSS of the ids-only speculators export (`speculators_export.save_rows`) against N samples.

    nice -n 19 .venv/bin/python benchmarks/export_memory.py                          # 1k, 10k, 50k x ~1k tokens
    nice -n 19 .venv/bin/python benchmarks/export_memory.py --smoke       # 200, 1000 x ~256 tokens: make test

Each export runs in its own process (benchmarks/_harness.measure: peak RSS is that process's
VmHWM, imports included); the rows are generated one at a time as Python lists (as the merged
rows reach it), so the input holds nothing. `previous` is the former save_rows (4096-row chunks
of Python dicts built into `Dataset.from_list`, every chunk held until one concatenate), run in
the same benchmark up to `--baseline-max` samples (it needs GBs beyond that). The figure: peak RSS
per size, and the slope in MiB per 1k samples (flat: ~0).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import measure, slope, table

SETUP = """
import numpy as np
from eagle3_data.exports import speculators_export

def rows(n, tokens):
    rng = np.random.default_rng(0)
    for i in range(n):
        t = int(rng.integers(tokens // 2, tokens * 3 // 2 + 1))
        yield f"s{{i}}", rng.integers(0, 163840, t).tolist(), [0] * (t // 4) + [1] * (t - t // 4)

def previous(samples, out_dir):
    import datasets, json
    from pathlib import Path
    out = Path(out_dir); out.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({{"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")}})
    chunks, chunk, index = [], [], []
    for sample_id, ids, mask in samples:
        index.append({{"row": len(index), "sample_id": sample_id}})
        chunk.append({{"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}})
        if len(chunk) == 4096:
            chunks.append(datasets.Dataset.from_list(chunk, features=features)); chunk = []
    if chunk:
        chunks.append(datasets.Dataset.from_list(chunk, features=features))
    table = datasets.concatenate_datasets(chunks)
    table.set_format(type="torch")
    table.save_to_disk(str(out))
    with open(out / "index.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\\n" for r in index)
    return len(index)
import datasets  # imports outside the timed work, for both variants
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 50000])
    p.add_argument("--tokens", type=int, default=1024, help="mean tokens per sample (+-50%)")
    p.add_argument("--baseline-max", type=int, default=10000, help="run `previous` up to this N")
    p.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.tokens, args.baseline_max = [200, 1000], 256, 1000
    rows = []
    for n in args.sizes:
        for variant in ("save_rows", "previous"):
            if variant == "previous" and n > args.baseline_max:
                continue
            with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
                call = "speculators_export.save_rows" if variant == "save_rows" else "previous"
                r = measure(SETUP.format(), f"RESULT = {call}(rows({n}, {args.tokens}), {str(Path(tmp) / 'out')!r})")
            assert r["result"] == n, r
            rows.append({"variant": variant, "n": n, "work_s": r["work_s"], "peak": r["peak_rss_mib"]})
            print(f"{variant:9s} N={n:6d}: {r['work_s']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    print(f"\n~{args.tokens} tokens per sample")
    print(table(rows, [("variant", "export"), ("n", "samples"), ("work_s", "work s"), ("peak", "peak RSS MiB")]))
    for variant in ("save_rows", "previous"):
        pts = [(r["n"] / 1000, r["peak"]) for r in rows if r["variant"] == variant]
        if len(pts) >= 2:
            print(
                f"RATIO export_memory {variant} peak RSS slope = {slope(pts):.2f} MiB per 1k samples "
                f"({pts[0][1]:.0f} -> {pts[-1][1]:.0f} MiB from {pts[0][0]:g}k to {pts[-1][0]:g}k)"
            )


if __name__ == "__main__":
    main()
