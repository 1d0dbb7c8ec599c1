"""Hidden states (stage `hidden_states`, the CLI's `extract`): the target model over the merged ids,
EAGLE-3 aux states stored in shards, then the trainers' exports.

`extract` (batches, shards, the log-probability check), `backends` / `engines` / `vllm_*` (the
forward passes), `layers` (which layers), `pixels` (image inputs), `export`, `stage` (the stage as
the DAG and CLI run it), `cli` (`eagle3-data extract`). The shard format and the trainers'
readers are `eagle3_data.exports`; the target's head (final norm, log-probabilities) is
`eagle3_data.target_head`.
"""
