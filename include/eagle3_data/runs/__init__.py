"""A run as every stage sees it: its resolution (`run`), the reuse rule (`reuse`), the typed
results (`results`), the time budgets (`timeouts`) and what a stage reads of another stage's
committed outputs (`upstream`).
"""
