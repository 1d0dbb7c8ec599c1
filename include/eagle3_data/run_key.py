"""The run key: the one name under which a DAG run's artifacts live (`runs/{run_key}/...`).

The DAG derives it when a run starts and the report view derives it again from the same DAG run
to find that run's artifacts, so both call this one function.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from eagle3_data.errors import UserError
from eagle3_data.storage.refs import check_name


def run_key_for(params: Mapping[str, Any] | None, logical_date: datetime | None, run_id: str | None = None) -> str:
    """The run key of a DAG run: its `run_name` param (a manual run's conf), else
    `date=YYYY-MM-DD` of the logical date in UTC (a scheduled run keys on the day it covers
    wherever the scheduler's clock is), else its run id made a safe key segment (a REST trigger
    without a logical date: `manual__2026-12-01T10:00:00+00:00` -> `manual__2026-12-01T10-00-00+00-00`)."""
    run_name = (params or {}).get("run_name")
    if run_name:
        return check_name(run_name, "run_name")
    if logical_date is not None:
        if logical_date.tzinfo is not None:
            logical_date = logical_date.astimezone(timezone.utc)
        return f"date={logical_date:%Y-%m-%d}"
    if run_id:
        key = re.sub(r"[^A-Za-z0-9._=+-]", "-", run_id).lstrip("._=+-")[:128]
        return check_name(key or "run", "run key")
    raise UserError("dag run: no conf.run_name, no logical_date and no run id; a manual run needs a run_name")
