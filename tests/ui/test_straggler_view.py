"""Seeing the straggler on the job page: the per-rank heatmap, a measured line that never steps
back when the page opens as a job starts, and plan-change labels that do not overlap."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.ui.harness import ARTIFACTS, LiveApp, Page, issue_plan, sign_in, wait_until_live
from tests.ui.simulated import Cluster, emulated_iteration

pytestmark = pytest.mark.browser
PER_SAMPLE = [0.2, 0.2, 0.2, 0.2]


def _chart(pg: Any, chart: str, expr: str) -> Any:
    return pg.evaluate(
        f"() => {{ const d = document.querySelector('[data-chart=\"{chart}\"]'); return {expr}; }}"
    )


def _running_job(cluster: Cluster, workers: int = 4) -> dict[str, Any]:
    host = cluster.register("gpu-a", workers)
    job = cluster.submit(workers, 64 * workers)
    cluster.mark_running(host, job)
    return job


def _rank_2_slow(rank: int, it: int) -> float:
    return 3.0 if rank == 2 and 30 <= it < 70 else 1.0


def _post(cluster: Cluster, job_id: int, its: range, version: int = 1, ranks: Any = None) -> None:
    records = []
    start = time.time() - 0.05 * len(its)
    for i, it in enumerate(its):
        rows = emulated_iteration(
            it, version, [64] * 4, PER_SAMPLE, slowdown=_rank_2_slow, ts=start + 0.05 * i
        )
        records += [r for r in rows if ranks is None or r["rank"] in ranks]
    cluster.post_telemetry(job_id, records)


def test_heatmap_makes_the_slow_rank_obvious(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    job = _running_job(cluster)
    _post(cluster, job["id"], range(0, 60))
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job['id']}")
    wait_until_live(pg)
    # Before any live row: the speed and idle share from what the page loaded.
    assert pg.locator("#job-speed").inner_text() == "5,120 samples/s"  # 256 per 0.05 s
    assert pg.locator("#idle-summary").inner_text().endswith("% of worker time is idle.")
    heat = _chart(pg, "heatmap", "({z: d.data[0].z, x: d.data[0].x, type: d.data[0].type})")
    assert heat["type"] == "heatmap" and len(heat["z"]) == 4 and heat["x"][-1] == 59
    slow = [[v for v in row[30:] if v is not None] for row in heat["z"]]
    assert min(slow[2]) > 2 * max(max(slow[r]) for r in (0, 1, 3)), "rank 2 is the hot row"
    # Live iterations reach the heatmap too (it redraws about once a second).
    _post(cluster, job["id"], range(60, 80))
    pg.wait_for_function(
        "document.querySelector('[data-chart=\"heatmap\"]').data[0].x.at(-1) === 79",
        timeout=30_000,
    )
    # Idle: everyone else waits for rank 2, which never waits.
    pg.select_option("#heatmap-metric", "idle")
    pg.wait_for_function(
        "document.querySelector('[data-chart=\"heatmap\"]').layout.meta.metric === 'idle'"
    )
    idle = _chart(pg, "heatmap", "d.data[0].z")
    window = [sum(row[30:60]) / 30 for row in idle]
    assert window[2] < min(window[r] for r in (0, 1, 3)) / 3
    pg.select_option("#heatmap-metric", "busy")
    ARTIFACTS.mkdir(exist_ok=True)
    pg.wait_for_timeout(1500)
    pg.screenshot(path=str(ARTIFACTS / "job-page-straggler.png"), full_page=True)


def test_measured_line_never_steps_back_when_the_page_opens_as_a_job_starts(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    """Each rank's agent posts its telemetry every ~2 s on its own clock, so a page opened as a
    job starts sees rank 0 ahead of the others. The measured line used to draw those iterations
    from the history and then again from the stream, stepping back: a false diagonal."""
    pg = page.page
    job = _running_job(cluster)
    _post(cluster, job["id"], range(0, 8), ranks={0})
    _post(cluster, job["id"], range(0, 3), ranks={1, 2, 3})
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job['id']}")
    wait_until_live(pg)
    _post(cluster, job["id"], range(3, 8), ranks={1, 2, 3})
    _post(cluster, job["id"], range(8, 12))
    measured = "d.data[4].x"  # 4 ranks, then the measured line
    pg.wait_for_function(
        f"(() => {{ const d = document.querySelector('[data-chart=\"iteration-time\"]'); "
        f"return {measured}.at(-1) === 11; }})()"
    )
    xs = _chart(pg, "iteration-time", measured)
    assert xs == sorted(set(xs)), f"the measured line steps back: {xs}"
    assert xs == list(range(12))
    ys = _chart(pg, "iteration-time", "d.data[4].y")
    busy = (4.0 + 0.2 * 64) * 1.0 + 3.0
    assert all(abs(y - busy) < 0.01 for y in ys), "every rank's time counted, none missing"


def test_plan_labels_close_together_do_not_overlap(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    job = _running_job(cluster)
    for batches in ([70, 62, 62, 62], [72, 60, 62, 62], [74, 60, 60, 62]):
        issue_plan(live_app, job["id"], batches, 20.0)
    starts = {1: 0, 2: 200, 3: 204, 4: 208}
    now = time.time()
    records = []
    for it in range(300):
        version = max(v for v, s in starts.items() if s <= it)
        records += emulated_iteration(it, version, [64] * 4, PER_SAMPLE, ts=now - 30 + it * 0.1)
    cluster.post_telemetry(job["id"], records)
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job['id']}")
    wait_until_live(pg)
    labels = _chart(
        pg,
        "iteration-time",
        "d.layout.annotations.map(a => ({name: a.name, y: a.y}))",
    )
    assert {a["name"] for a in labels} == {"plan-v2", "plan-v3", "plan-v4"}
    assert len({a["y"] for a in labels}) == 3, f"staggered over rows: {labels}"
    # And on screen: no two label boxes intersect.
    boxes = pg.evaluate(
        "() => [...document.querySelectorAll('[data-chart=\"iteration-time\"] .annotation')]"
        ".map(n => { const r = n.getBoundingClientRect(); "
        "return [r.left, r.top, r.right, r.bottom]; })"
    )
    assert len(boxes) == 3
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            apart = a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
            assert apart, f"labels overlap: {a} {b}"
    ARTIFACTS.mkdir(exist_ok=True)
    pg.locator("[data-chart='iteration-time']").screenshot(
        path=str(ARTIFACTS / "job-page-plan-labels.png")
    )
