"""Generation (stages `generate_local` and `generate_overflow`): the local engine's exact ids and
the overflow provider's text, checkpointed, priced and never paid twice.

`local` (the local engines' run), `openrouter*` (the overflow run: HTTP, rows, pricing, budget,
breaker), `checkpoint` (resumable parts and the journal), `provider_answers` and
`provider_identity` (what the provider's answers are and who gave them), `contracts` (the rows
and summaries both write), `progress`, `alarm`, `stage` (the stages as the DAG and CLI run them),
`cli` (`eagle3-data generate`). The engines' wire protocol is `eagle3_data.engines`.
"""
