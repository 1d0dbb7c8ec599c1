"""Merge (stage `merge`): prompt ids + output ids of every dataset whose gate passed, loss masks,
dedupe, shuffled shards.

`datasets` (records, buckets, shards), `stage` (the stage as the DAG and CLI run it), `cli`
(`eagle3-data merge`).
"""
