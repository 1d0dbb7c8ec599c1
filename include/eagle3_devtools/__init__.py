"""Launchers for a source checkout: `make demo`, `make airflow`, `make cluster`.

Not part of the `eagle3-data` wheel (pyproject packages `eagle3_data*` only): these modules start
Airflow, find the repo's dags/ and plugins/, and read the sample data, so they only make sense
next to a checkout. The Makefile and pytest put `include/` on sys.path to reach them. The library
(`eagle3_data`) never imports from here, and never imports Airflow.
"""

import sys
from pathlib import Path

# The DAG's Airflow names (plugins/eagle3_airflow.py) and the hooks, importable as Airflow makes
# them for the DAG: it puts its plugins folder on sys.path.
PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
if str(PLUGINS) not in sys.path:
    sys.path.append(str(PLUGINS))
