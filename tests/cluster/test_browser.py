"""A person's view of a failed run: signed in through Airflow's login page in headless Chromium,
on the run's *Validation report* tab, with the page rendered (the plugin's HTML inside the UI's
frame), and a screenshot kept as a test artifact (test-artifacts/, or $EAGLE3_TEST_ARTIFACTS)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import pytest
from eagle3_airflow import DAG_ID

from tests.cluster.browser import Browser
from tests.cluster.conftest import KILLED_RUN, REPO

ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS") or REPO / "test-artifacts")
REPORT = "(() => { const f = document.querySelector('iframe'); return f && f.contentDocument })()"


@pytest.fixture
def browser():
    b = Browser()
    try:
        yield b
    finally:
        b.close()


def open_report_tab(browser: Browser, cluster) -> None:
    """Sign in through Airflow's login page and wait for the failed run's report inside its tab."""
    browser.goto(f"{cluster.base}/dags/{DAG_ID}/runs/{quote(KILLED_RUN)}/plugin/eagle3_validation_report")
    browser.wait_for("document.querySelector('input[name=username]')", "the sign-in form")  # not signed in yet
    browser.type_into("input[name=username]", cluster.env.get("EAGLE3_UI_USER", "admin"))
    browser.type_into("input[name=password]", cluster.password)
    browser.click("button[type=submit]")
    browser.wait_for(f"{REPORT} && {REPORT}.querySelector('table.overview tbody tr')", "the report inside the tab")


def test_failed_run_report_tab_in_a_browser(cluster, killed_run, browser):
    from eagle3_data.storage import StageRef

    expected = killed_run["store"].get_json(
        StageRef(f"date={killed_run['date']}", "validate", "tool_calls"), "report.json"
    )
    open_report_tab(browser, cluster)
    shot = browser.screenshot(ARTIFACTS / "cluster-failed-run-report.png")
    assert shot.stat().st_size > 10_000

    page = browser.js(f"""(() => {{
      const d = {REPORT};
      const heads = [...d.querySelectorAll('table.overview thead th')].map(th => th.innerText.trim());
      const rows = [...d.querySelectorAll('table.overview tbody tr')]
        .map(tr => [...tr.cells].map(td => td.innerText.trim()));
      const badges = Object.fromEntries([...d.querySelectorAll('table.overview tbody tr')].map(tr => {{
        const b = tr.querySelector('span.gate');
        return [tr.cells[0].innerText.trim(), [b.innerText.trim(), getComputedStyle(b).backgroundColor]];
      }}));
      return {{heads, rows, badges,
               reasons: [...d.querySelectorAll('.gatebox li')].map(li => li.innerText.trim()),
               tab: [...document.querySelectorAll('a, button')].some(e => e.innerText.trim() === 'Validation report')}};
    }})()""")
    assert page["tab"], "the run page shows no 'Validation report' tab"
    row = dict(zip(page["heads"], next(r for r in page["rows"] if r[0] == "tool_calls")))
    for cls, n in expected["counts"].items():
        assert row[cls].replace(",", "") == str(n), (cls, row)
    assert row["samples"].replace(",", "") == str(expected["samples"])
    assert page["badges"]["tool_calls"] == ["failed", "rgb(198, 40, 40)"], page  # the red badge
    assert page["badges"]["code"][0] == "passed" and page["badges"]["code"][1] != "rgb(198, 40, 40)"
    # The page says where each reason comes from ("local round trip: ..."); the report's own words follow.
    assert expected["gate"]["reasons"] and all(
        any(r in shown for shown in page["reasons"]) for r in expected["gate"]["reasons"]
    ), page["reasons"]
    (ARTIFACTS / "cluster-failed-run-report.json").write_text(json.dumps(page, indent=1))


@pytest.mark.parametrize("width", [1280, 1400])
def test_report_tab_shows_everything_at_laptop_widths(cluster, killed_run, width):
    """At a 1280 (and 1400) px window nothing of the report is clipped inside the tab: neither the
    page nor its overview table scrolls sideways (at 1400 px the overview once did, its gate
    column out of sight), and every chart label lies inside its chart ('unreconstructable' was
    cut to 'nreconstructable'). The screenshot is kept for a person to look at."""
    browser = Browser(window=(width, 1000))
    try:
        open_report_tab(browser, cluster)
        browser.screenshot(ARTIFACTS / f"cluster-report-tab-{width}px.png")
        fit = browser.js(f"""(() => {{
          const d = {REPORT}, root = d.documentElement, t = d.querySelector('table.overview');
          const cut = [...d.querySelectorAll('svg text')].filter(x => {{
            const s = x.ownerSVGElement.getBoundingClientRect(), r = x.getBoundingClientRect();
            return r.left < s.left - 0.5 || r.right > s.right + 0.5 || r.top < s.top - 0.5 || r.bottom > s.bottom + 0.5;
          }}).map(x => x.textContent);
          return {{frame: root.clientWidth, page_scroll: root.scrollWidth, table_right: t.getBoundingClientRect().right,
                   table_scroll: t.scrollWidth, table_client: t.clientWidth,
                   labels: d.querySelectorAll('svg text').length, cut,
                   ui: [document.documentElement.clientWidth, document.documentElement.scrollWidth]}};
        }})()""")
    finally:
        browser.close()
    (ARTIFACTS / f"cluster-report-tab-{width}px.json").write_text(json.dumps(fit, indent=1))
    assert fit["page_scroll"] <= fit["frame"] and fit["table_right"] <= fit["frame"], fit
    assert fit["table_scroll"] <= fit["table_client"], fit
    assert fit["ui"][1] <= fit["ui"][0], fit  # the Airflow page around the frame does not scroll sideways either
    assert fit["labels"] > 0 and not fit["cut"], fit


# The verdict block's box, where the page ends at the default window (Browser's 1400 x 1300): in
# the tab's frame and in the Airflow page around it (the frame's top plus the block's bottom),
# and each verdict line's dataset, check, state and badge colour.
VERDICT = f"""(() => {{
  const d = {REPORT}, frame = document.querySelector('iframe'), v = d.querySelector('section#verdict');
  const r = v.getBoundingClientRect();
  return {{first: d.querySelector('h1').nextElementSibling.id, bottom: r.bottom,
           frame_top: frame.getBoundingClientRect().top, frame_inner: frame.contentWindow.innerHeight,
           inner: window.innerHeight,
           lines: [...v.querySelectorAll('tr[data-state]')].map(tr => [tr.dataset.dataset, tr.dataset.check,
             tr.dataset.state, getComputedStyle(tr.querySelector('span.state')).backgroundColor])}};
}})()"""
GREEN, RED = "rgb(46, 125, 50)", "rgb(198, 40, 40)"


def test_the_verdict_block_is_the_first_thing_and_above_the_fold(cluster, killed_run, browser):
    """A person opening the failed run's tab sees the verdict without scrolling: the block is the
    page's first element after its title, its bottom inside the window (DOM, not a guess from the
    screenshot), one line per dataset per check, the failed dataset's gate red, the passing one's
    green. The screenshot is kept for a person to look at."""
    open_report_tab(browser, cluster)
    browser.wait_for(f"{REPORT} && {REPORT}.querySelector('section#verdict tr[data-state]')", "the verdict block")
    shot = browser.screenshot(ARTIFACTS / "cluster-report-verdict.png")
    got = browser.js(VERDICT)
    (ARTIFACTS / "cluster-report-verdict.json").write_text(json.dumps(got, indent=1))
    assert shot.stat().st_size > 10_000
    assert got["first"] == "verdict", got
    assert got["bottom"] <= got["frame_inner"], got  # above the fold inside the tab's frame
    assert got["frame_top"] + got["bottom"] <= got["inner"], got  # and in the window around it
    pairs = [(ds, check) for ds, check, _, _ in got["lines"]]
    assert len(pairs) == len(set(pairs)), pairs  # one line per dataset per check
    states = {(ds, check): (state, color) for ds, check, state, color in got["lines"]}
    for ds in ("tool_calls", "code"):
        assert {check for d, check in pairs if d == ds} >= {"gate (bulk mismatch validation)", "policy check"}, pairs
    assert states[("tool_calls", "gate (bulk mismatch validation)")] == ("fail", RED), states
    assert states[("code", "gate (bulk mismatch validation)")] == ("pass", GREEN), states
