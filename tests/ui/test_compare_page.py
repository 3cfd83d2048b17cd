"""The compare page in Chromium: jobs picked on the jobs list, side by side (what `make demo`
shows: equal against minmax)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.ui.harness import ARTIFACTS, LiveApp, Page, minmax_batches, sign_in
from tests.ui.simulated import Cluster, emulated_iteration

pytestmark = pytest.mark.browser
PER_SAMPLE = [0.1, 0.1, 0.2, 0.4]  # speeds 4:4:2:1, as in the demo
GLOBAL_BATCH = 256
ITERATIONS = 120


def _run(cluster: Cluster, host: str, policy: str, batches: list[int]) -> dict[str, Any]:
    """A finished-looking history: ITERATIONS iterations of `batches` on emulated workers."""
    h = cluster.register(host, 4)
    job = cluster.submit(4, GLOBAL_BATCH, name=f"digits-{policy}", policy={"name": policy})
    cluster.mark_running(h, job)
    ts = time.time() - 30
    records = []
    for it in range(ITERATIONS):
        rows = emulated_iteration(it, 1, batches, PER_SAMPLE, ts=ts)
        ts += (rows[0]["data_ms"] + rows[0]["compute_ms"] + rows[0]["sync_ms"]) / 1000
        records += rows
    cluster.post_telemetry(job["id"], records)
    return job


def _chart(pg: Any, chart: str, expr: str) -> Any:
    return pg.evaluate(
        f"() => {{ const d = document.querySelector('[data-chart=\"{chart}\"]'); return {expr}; }}"
    )


def test_pick_two_jobs_on_the_list_and_compare_them(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    equal = _run(cluster, "gpu-a", "equal", [64] * 4)
    minmax = _run(cluster, "gpu-b", "minmax", minmax_batches(PER_SAMPLE, GLOBAL_BATCH))
    sign_in(pg, live_app.url, live_app.admin_token)
    button = pg.locator("#compare-selected")
    pg.locator(f'tr[data-job-id="{minmax["id"]}"] input.compare-pick').check()
    assert button.is_disabled(), "one job is nothing to compare"
    pg.locator(f'tr[data-job-id="{equal["id"]}"] input.compare-pick').check()
    assert button.inner_text() == "Compare 2 jobs"
    ARTIFACTS.mkdir(exist_ok=True)
    pg.locator("#jobs-table").screenshot(path=str(ARTIFACTS / "jobs-list-compare.png"))
    button.click()
    pg.wait_for_url(f"{live_app.url}/compare?jobs={equal['id']},{minmax['id']}")
    pg.locator("#compare-table tbody tr").nth(1).wait_for()

    rows = pg.locator("#compare-table tbody tr")
    assert rows.count() == 2
    assert "equal" in rows.nth(0).inner_text() and "minmax" in rows.nth(1).inner_text()
    # equal waits for the slowest (0.4 ms/sample x 64): 4 + 25.6 + 3 ms; minmax balances them.
    speedup = float(rows.nth(1).locator('[data-col="speedup"]').inner_text().rstrip("\u00d7"))
    assert 1.8 < speedup < 2.2, speedup
    equal_idle = int(rows.nth(0).locator('[data-col="idle"]').inner_text().rstrip("%"))
    minmax_idle = int(rows.nth(1).locator('[data-col="idle"]').inner_text().rstrip("%"))
    assert equal_idle > 40 and minmax_idle < 25, (equal_idle, minmax_idle)
    for chart in ("compare-throughput", "compare-iteration-time", "compare-idle"):
        pg.wait_for_function(
            f"document.querySelector('[data-chart=\"{chart}\"]').data?.length === 2"
        )
        names = _chart(pg, chart, "d.data.map(t => t.name)")
        assert names == [
            f"#{equal['id']} digits-equal (equal)",
            f"#{minmax['id']} digits-minmax (minmax)",
        ]
        assert _chart(pg, chart, "d.data.map(t => t.x.length)") == [ITERATIONS, ITERATIONS]
    throughput = _chart(pg, "compare-throughput", "d.data.map(t => t.y[10])")
    assert throughput[1] > 1.8 * throughput[0]
    pg.wait_for_timeout(500)
    pg.screenshot(path=str(ARTIFACTS / "compare-page.png"), full_page=True)


@pytest.mark.parametrize(
    ("query", "shown"),
    [
        ("?jobs=1", "Choose two or more jobs to compare: /compare?jobs=3,4"),
        ("?jobs=1,abc", '"abc" in jobs= is not a job id'),
        ("?jobs=1,999", "Could not compare: job 999 not found"),
    ],
)
def test_compare_says_what_is_wrong_with_its_jobs(
    page: Page, live_app: LiveApp, cluster: Cluster, query: str, shown: str
) -> None:
    pg = page.page
    _run(cluster, "gpu-a", "equal", [64] * 4)
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/compare{query}")
    pg.locator("#banner").wait_for()
    assert pg.locator("#banner").inner_text() == shown
