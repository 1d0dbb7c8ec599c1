"""The probe (stage `probe`): the drafter's verdict on the extraction, a short speculators training
run on the export and its simulated acceptance.

`drafter` (the probe), `speculators_probe` (the script run in the speculators venv), `stage` (the
stage as the DAG and CLI run it), `cli` (`eagle3-data probe`).
"""
