"""Reconstruction (stage `reconstruct`): the overflow provider's text back into the ids the model
would have produced. The text -> ids rules are `eagle3_data.reconstruction` (the gate rebuilds
local answers through the same path).

`stage` (the stage as the DAG and CLI run it), `cli` (`eagle3-data reconstruct`).
"""
