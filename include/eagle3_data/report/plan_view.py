"""The run report of a dry run: its plan (plan), which publish writes instead of a
validation report, so the report tab of a dry run shows the plan rather than answering 404."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle3_data.storage.store import ArtifactStore

PLAN_NAME = "plan.json"


def load_plan(store: ArtifactStore, run_key: str) -> tuple[str, dict[str, Any]] | None:
    """(URI, plan) of the run key's dry-run plan (`runs/{run_key}/plan/run/plan.json`); None
    when there is none, or only an older plan without the run's figures."""
    from eagle3_data.stages import PLAN, RUN_DATASET
    from eagle3_data.storage import StageRef

    ref = StageRef(run_key, PLAN, RUN_DATASET)
    if store.head_object(ref, PLAN_NAME) is None:
        return None
    plan = store.get_json(ref, PLAN_NAME)
    if not isinstance(plan, dict) or "storage" not in plan:
        return None
    return store.uri(ref, PLAN_NAME), plan


def render_plan_html(plan: dict[str, Any], uri: str, *, title: str) -> str:
    """The plan as a page: its warnings first, then the table `eagle3-data plan` prints."""
    from eagle3_data.plan import format_plan
    from eagle3_data.report.render import _env

    return _env().get_template("plan.html.jinja").render(title=title, plan=plan, uri=uri, text=format_plan(plan))
