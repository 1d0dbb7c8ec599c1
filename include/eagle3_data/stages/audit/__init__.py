"""The tokenizer audit (stage `audit`): the audited ids of the run's tokenizer and template, before
anything is generated.

`tokenizer_audit` (the checks), `stage` (the stage as the DAG and CLI run it), `cli` (`eagle3-data
tokenizer audit`).
"""
