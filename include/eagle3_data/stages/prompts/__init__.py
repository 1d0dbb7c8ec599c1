"""Prompts (stage `prompts`, the DAG's `load_route`): each dataset's prompt files loaded, validated
and normalised, then routed to the local engine, the overflow provider or both.

`load` (files -> prompt rows), `routing` (which prompt goes where), `stage` (the stage as the DAG
and CLI run it: load, route, commit), `cli` (`eagle3-data prompts`).
"""
