"""Publish (stage `publish`): the run's summary and report, from every stage's committed outputs
(read through `eagle3_data.runs.upstream`).

`stage` (the stage as the DAG and CLI run it), `cli` (`eagle3-data publish`).
"""
