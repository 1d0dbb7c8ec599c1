"""The run key: the one name under which a DAG run's artifacts live (`runs/{run_key}/...`).

The DAG derives it when a run starts and the report view derives it again from the same DAG run
to find that run's artifacts, so both call this one function.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from eagle3_data.errors import UserError
from eagle3_data.storage.refs import check_name


def run_key_for(params: Mapping[str, Any] | None, logical_date: datetime | None) -> str:
    """The run key of a DAG run: its `run_name` param (a manual run's conf), else
    `date=YYYY-MM-DD` of the logical date in UTC, so a scheduled run keys on the day it covers
    wherever the scheduler's clock is."""
    run_name = (params or {}).get("run_name")
    if run_name:
        return check_name(run_name, "run_name")
    if logical_date is None:
        raise UserError("dag run: no conf.run_name and no logical_date; a manual run needs a run_name")
    if logical_date.tzinfo is not None:
        logical_date = logical_date.astimezone(timezone.utc)
    return f"date={logical_date:%Y-%m-%d}"
