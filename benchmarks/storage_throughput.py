"""What checkpointing and verification cost, measured against plain boto3 + pyarrow in the same run.

Writes N generation rows through `ArtifactStore.writer` (a part + progress record every
`rows_per_part` rows, manifest last) and reads them back with `iter_batches` (sha256 per part);
the baseline writes the same table as one Parquet object with `put_object` and reads it with one
`get_object`. Runs against a fresh embedded SeaweedFS on 127.0.0.1.

    .venv/bin/python benchmarks/storage_throughput.py [--rows 20000] [--tokens 400] [--rows-per-part 256]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.dev.seaweedfs import start_seaweedfs, stop_seaweedfs
from eagle3_data.schemas import schema_for
from eagle3_data.storage import ArtifactStore, StageRef
from eagle3_data.storage.writer import StageWriter


def make_rows(n: int, tokens: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "sample_id": f"{i:032x}",
            "dataset": "bench",
            "source": "sglang",
            "status": "ok",
            "prompt_ids": rng.integers(0, 163840, 64).tolist(),
            "output_ids": rng.integers(0, 163840, tokens).tolist(),
            "content": "x" * 200,
        }
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--rows-per-part", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="make test's size: seconds, checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.rows = 500
    rows = make_rows(args.rows, args.tokens)

    with tempfile.TemporaryDirectory() as d:
        handle = start_seaweedfs(d, die_with_parent=True)
        try:
            client = handle.client()
            client.create_bucket(Bucket="bench")
            store = ArtifactStore(client, "bench")
            ref = StageRef("bench", "generate_local", "bench")

            t = time.perf_counter()  # the baseline converts the same Python rows, once, in one object
            sink = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows, schema=schema_for("generations")), sink, compression="zstd")
            client.put_object(Bucket="bench", Key="baseline.parquet", Body=sink.getvalue())
            base_write = time.perf_counter() - t

            t = time.perf_counter()
            with StageWriter(store, ref, "generations", rows_per_part=args.rows_per_part) as w:
                for i in range(0, len(rows), 64):  # a generation stage hands over rows as they complete
                    w.write(rows[i : i + 64])
                manifest = w.commit()
            store_write = time.perf_counter() - t

            t = time.perf_counter()
            body = client.get_object(Bucket="bench", Key="baseline.parquet")["Body"].read()
            n_base = pq.read_table(io.BytesIO(body)).num_rows
            base_read = time.perf_counter() - t

            t = time.perf_counter()
            n_store = sum(b.num_rows for b in store.iter_batches(ref))
            store_read = time.perf_counter() - t
            assert n_base == n_store == args.rows
        finally:
            stop_seaweedfs(d, grace=0.5)

    mb = sum(p["bytes"] for p in manifest["parts"]) / 2**20
    print(
        f"rows={args.rows} tokens/row={args.tokens} rows_per_part={args.rows_per_part} "
        f"parts={len(manifest['parts'])} parquet={mb:.1f} MiB"
    )
    print(
        f"write: baseline {base_write:.2f}s  store {store_write:.2f}s  ratio store/baseline "
        f"{store_write / base_write:.2f}"
    )
    print(
        f"read:  baseline {base_read:.2f}s  store {store_read:.2f}s  ratio store/baseline {store_read / base_read:.2f}"
    )
    print(f"store write {args.rows / store_write:,.0f} rows/s, read {args.rows / store_read:,.0f} rows/s")
    print(
        f"RATIO storage_throughput baseline/store write = {base_write / store_write:.2f}, read = "
        f"{base_read / store_read:.2f}"
    )


if __name__ == "__main__":
    main()
