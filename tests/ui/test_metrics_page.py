"""The job page's training curves in a real browser: the loss chart and the user metrics,
fed through the metrics API as the runtime posts them, refreshed while the job runs."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tests.ui.harness import ARTIFACTS, LiveApp, Page, sign_in
from tests.ui.simulated import Cluster, emulated_iteration

pytestmark = pytest.mark.browser


def _post_metrics(cluster: Cluster, job_id: int, points: list[dict[str, Any]]) -> None:
    r = cluster.client.post(f"/api/v1/jobs/{job_id}/metrics", json={"points": points})
    assert r.status_code == 200, r.text


def _loss(it: int) -> float:
    return 2.3 * math.exp(-it / 25) + 0.05 * math.sin(it / 3) ** 2 + 0.1


def _running_job(cluster: Cluster) -> int:
    host = cluster.register("gpu-a", 2)
    job = cluster.submit(2, 64, name="curves")
    cluster.mark_running(host, job)
    records = []
    for it in range(20):
        records += emulated_iteration(it, 1, [32, 32], [0.1, 0.2], ts=time.time() - 5 + it * 0.1)
    cluster.post_telemetry(job["id"], records)
    return int(job["id"])


def _count(pg: Any, selector: str, expr: str) -> Any:
    return pg.evaluate(
        f"() => {{ const d = document.querySelector('{selector}'); return {expr}; }}"
    )


def test_the_loss_chart_and_user_metrics_show_the_points_and_follow_the_job(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    job_id = _running_job(cluster)
    _post_metrics(
        cluster,
        job_id,
        [{"rank": 0, "iteration": i, "name": "loss", "value": _loss(i)} for i in range(0, 120, 2)],
    )
    _post_metrics(
        cluster,
        job_id,
        [
            {
                "rank": r,
                "iteration": i,
                "name": "accuracy",
                "value": 0.5 + 0.4 * (1 - math.exp(-i / 30)) - 0.02 * r,
            }
            for i in range(0, 120, 10)
            for r in range(2)
        ]
        + [
            {"rank": 0, "iteration": i, "name": "lr", "value": 0.1 * 0.5 ** (i // 40)}
            for i in range(0, 120, 10)
        ],
    )
    pg = page.page
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job_id}")
    loss = '[data-chart="loss"]'
    pg.wait_for_function(f"(document.querySelector('{loss}').data?.[0]?.x.length ?? 0) === 60")
    xs = _count(pg, loss, "Array.from(d.data[0].x)")
    ys = _count(pg, loss, "Array.from(d.data[0].y)")
    assert xs == list(range(0, 120, 2))
    assert all(abs(y - _loss(x)) < 1e-9 for x, y in zip(xs, ys, strict=True))
    assert "Latest 0.1" in pg.locator("#loss-latest").inner_text()
    assert "118" in pg.locator("#loss-latest").inner_text()
    # One small chart per user metric, a trace per rank that logged it.
    pg.wait_for_function("document.querySelectorAll('[data-metric]').length === 2")
    assert _count(pg, '[data-metric="accuracy"]', "d.data.map(t => t.name)") == ["rank 0", "rank 1"]
    assert _count(pg, '[data-metric="lr"]', "d.data.map(t => t.x.length)") == [12]
    # Live: new points reach the chart without a reload.
    _post_metrics(
        cluster,
        job_id,
        [
            {"rank": 0, "iteration": i, "name": "loss", "value": _loss(i)}
            for i in range(120, 160, 2)
        ],
    )
    pg.wait_for_function(
        f"document.querySelector('{loss}').data[0].x.length === 80", timeout=25_000
    )
    ARTIFACTS.mkdir(exist_ok=True)
    pg.locator(loss).scroll_into_view_if_needed()
    pg.screenshot(path=str(ARTIFACTS / "job-page-metrics.png"), full_page=True)
    # The log-scale button switches the loss axis.
    pg.locator(f"{loss} .updatemenu-button", has_text="log").click()
    pg.wait_for_function(f"document.querySelector('{loss}').layout.yaxis.type === 'log'")


def test_a_job_without_metrics_says_how_to_log_them(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    job_id = _running_job(cluster)
    pg = page.page
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job_id}")
    pg.wait_for_selector(".metrics-empty")
    assert "ctx.log" in pg.locator(".metrics-empty").inner_text()
    assert pg.locator('[data-chart="loss"].empty').count() == 1
    _post_metrics(cluster, job_id, [{"rank": 1, "iteration": 3, "name": "loss", "value": 0.7}])
    pg.wait_for_function(
        "document.querySelector('[data-chart=\"loss\"]').dataset.points === '1'", timeout=25_000
    )
    assert pg.locator('[data-chart="loss"].empty').count() == 0
