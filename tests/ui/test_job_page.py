"""The job page in a real browser, fed by simulated workers through the REST API: live charts,
plan markers, straggler events, fitted models, and manual overrides from preview to the
iteration where the workers took them."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.ui.harness import (
    ARTIFACTS,
    INTERCEPT_MS,
    PER_SAMPLE_MS,
    LiveApp,
    Page,
    issue_plan,
    minmax_batches,
    open_page,
    record_straggler,
    sign_in,
    wait_until_live,
)
from tests.ui.simulated import Cluster, Workers, emulated_iteration

pytestmark = pytest.mark.browser
GLOBAL_BATCH = 256
HISTORY = 60


@dataclass
class RunningJob:
    id: int
    workers: Workers
    predicted_ms: float


def _slow_rank_2(rank: int, it: int) -> float:
    return 1.8 if rank == 2 and 100 <= it < 130 else 1.0


@pytest.fixture
def running(live_app: LiveApp, cluster: Cluster) -> Iterator[RunningJob]:
    """An emulated 4-worker job with history: an equal split, then a rebalanced plan with a
    prediction; workers keep posting an iteration every 0.1 s (rank 2 slows at 100-129)."""
    host = cluster.register("gpu-a", 4)
    emulation = [{"per_sample_ms": p, "intercept_ms": INTERCEPT_MS} for p in PER_SAMPLE_MS]
    job = cluster.submit(4, GLOBAL_BATCH, emulation=emulation)
    cluster.mark_running(host, job)
    records = []
    for it in range(HISTORY):
        records += emulated_iteration(it, 1, [64] * 4, PER_SAMPLE_MS, ts=time.time() - 9 + it * 0.1)
    cluster.post_telemetry(job["id"], records)
    batches = minmax_batches(PER_SAMPLE_MS, GLOBAL_BATCH)
    predicted = max(INTERCEPT_MS + p * b for p, b in zip(PER_SAMPLE_MS, batches, strict=True))
    issue_plan(live_app, job["id"], batches, round(predicted, 2))
    workers = Workers(
        cluster, job["id"], PER_SAMPLE_MS, start_iteration=HISTORY, slowdown=_slow_rank_2
    )
    workers.start()
    yield RunningJob(job["id"], workers, predicted)
    workers.stop()


def _points(pg: Any, chart: str) -> list[int]:
    """How many points each trace of a chart holds, read from Plotly's own data."""
    return list(
        pg.evaluate(
            f"() => (document.querySelector('[data-chart=\"{chart}\"]').data || [])"
            ".map(t => (t.x || []).length)"
        )
    )


def _chart(pg: Any, chart: str, expr: str) -> Any:
    return pg.evaluate(
        f"() => {{ const d = document.querySelector('[data-chart=\"{chart}\"]'); return {expr}; }}"
    )


def _wait_state(pg: Any, *states: str) -> str:
    pg.wait_for_function(
        f"{json.dumps(list(states))}.includes(document.querySelector('#override-status').dataset.state)",
        timeout=30_000,
    )
    return str(pg.locator("#override-status").get_attribute("data-state"))


def test_charts_load_history_and_gain_live_points(
    page: Page, live_app: LiveApp, running: RunningJob
) -> None:
    pg = page.page
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{running.id}")
    wait_until_live(pg)
    assert pg.locator(".badge.emulated").is_visible()
    assert pg.locator("#emulated-note").is_visible()
    first_time = _points(pg, "iteration-time")
    first_batch = _points(pg, "batch-size")
    first_idle = _chart(pg, "idle", "d.layout.meta.lastIteration")
    assert len(first_time) == 4 + 3 and min(first_time[:4]) >= HISTORY - 1
    assert len(first_batch) == 4 and min(first_batch) >= HISTORY - 1
    assert _chart(pg, "idle", "d.data.map(t => t.x.length)") == [4, 4]
    # Live: more points in the lines, a newer window in the bars, without reloading.
    pg.wait_for_function(
        "document.querySelector('[data-chart=\"iteration-time\"]').data[0].x.length >= "
        f"{first_time[0] + 10}"
    )
    later_time = _points(pg, "iteration-time")
    later_batch = _points(pg, "batch-size")
    assert all(b > a for a, b in zip(first_time[:5], later_time[:5], strict=True))
    assert later_time[5] > 0, "the plan's prediction is drawn against the measurement"
    assert all(b > a for a, b in zip(first_batch, later_batch, strict=True))
    # The bars redraw on their own cadence (paced by their drawing cost): wait for the newer window.
    pg.wait_for_function(
        f"document.querySelector('[data-chart=\"idle\"]').layout.meta.lastIteration > {first_idle}"
    )
    # The rebalanced plan took effect: marked on both timelines, listed in the history.
    assert "plan-v2" in _chart(pg, "batch-size", "d.layout.shapes.map(s => s.name)")
    assert "plan-v2" in _chart(pg, "iteration-time", "d.layout.shapes.map(s => s.name)")
    assert "iteration" in pg.locator('#plan-history tr[data-version="2"]').inner_text()
    idle, last = _chart(pg, "idle", "[d.data[1].y, d.layout.meta.lastIteration]")
    if last < 100 or last >= 130 + 20:
        assert max(idle) < 6, "balanced: nobody waits much beyond the 3 ms all-reduce"
    else:  # the window holds rank 2's slow iterations (a loaded machine got there first)
        assert idle[2] == min(idle), "the others wait for the straggler"
    assert pg.locator("#job-speed").inner_text().endswith("samples/s")
    assert "ddp · gradients auto" in pg.locator("#job-facts").inner_text()  # the spec's engine
    # A straggler event shows as a marker on the timeline and in the events table.
    record_straggler(live_app, running.id, rank=2, iteration=running.workers.iteration)
    pg.wait_for_function(
        "document.querySelector('[data-chart=\"iteration-time\"]').data[6].x.length === 1"
    )
    assert "slowdown" in pg.locator("#event-table").inner_text()
    # Each worker's fitted model stands next to its batch (the emulated per-sample times).
    assert "ms / sample" in str(pg.locator("#plan-table thead").text_content())
    cells = pg.locator("#plan-table tbody tr td:nth-child(5)").all_inner_texts()
    assert len(cells) == 4 and all(c != "—" for c in cells), cells


def test_job_page_runs_under_its_content_security_policy(
    browser: Any, live_app: LiveApp, running: RunningJob
) -> None:
    context, page = open_page(browser, bypass_csp=False)
    try:
        pg = page.page
        sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{running.id}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and min(_points(pg, "batch-size") or [0]) < HISTORY:
            time.sleep(0.1)
        assert min(_points(pg, "batch-size")) >= HISTORY
        assert pg.locator("#live-state").get_attribute("data-state") == "live"
        assert not page.errors, page.errors  # a CSP violation is logged as a console error
    finally:
        context.close()


def test_each_posted_point_reaches_the_chart_live(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    """Every posted iteration is drawn, pushed without a reload. How fast is measured in
    bench/live.py (target p99 <= 1 s), not asserted here: a shared CI machine is no stopwatch."""
    pg = page.page
    host = cluster.register("gpu-a", 2)
    job = cluster.submit(2, 64)
    cluster.mark_running(host, job)
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job['id']}")
    wait_until_live(pg)
    pg.evaluate(
        "() => { window.__drawn = {}; addEventListener('evenflow:drawn', e => "
        "{ window.__drawn[e.detail.iteration] ??= Date.now(); }); }"
    )
    for it in range(5):
        cluster.post_telemetry(job["id"], emulated_iteration(it, 1, [32, 32], [0.2, 0.3]))
        pg.wait_for_function(f"window.__drawn[{it}] !== undefined", timeout=15000)
    assert _points(pg, "iteration-time")[0] == 5
    assert pg.url.endswith(f"/jobs/{job['id']}"), "no reload"


def test_set_batches_override_from_preview_to_the_iteration_that_took_it(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    pg = page.page
    operator = cluster.token("operator", name="olga")
    sign_in(pg, live_app.url, operator, path=f"/jobs/{running.id}")
    wait_until_live(pg)
    current = cluster.plan(running.id)
    assert pg.locator("#plan-version").inner_text() == f"v{current['version']} · automatic"
    wanted = [96, 72, 56, 32]
    for rank, b in enumerate([96, 72, 56, 40]):  # sums to 264: refused
        pg.fill(f"input[name='batch_sizes.{rank}']", str(b))
    assert "sum 264 of 256" in pg.locator("#batch-sum").inner_text()
    pg.fill("#override-reason", "rank 3 shares its node with a backup job")
    pg.click("#override-preview")
    assert _wait_state(pg, "previewed", "error") == "error"
    assert "sums to 264" in pg.locator('[data-field="batch_sizes"] .field-error').inner_text()
    assert pg.locator("#override-apply").is_disabled()

    pg.fill("input[name='batch_sizes.3']", "32")
    pg.click("#override-preview")
    assert _wait_state(pg, "previewed", "error") == "previewed"
    preview = pg.locator("#override-preview-table tbody tr")
    assert preview.count() == 4
    assert preview.nth(0).locator("td").nth(2).inner_text() == "96"
    assert cluster.plan(running.id)["version"] == current["version"], "a preview changes nothing"
    # Editing after the preview asks for a new preview before applying.
    pg.fill("input[name='batch_sizes.3']", "31")
    assert pg.locator("#override-apply").is_disabled()
    pg.fill("input[name='batch_sizes.3']", "32")
    pg.click("#override-preview")
    _wait_state(pg, "previewed")
    pg.click("#override-apply")
    assert _wait_state(pg, "applied", "effective", "error") in ("applied", "effective")
    new_version = current["version"] + 1
    pg.wait_for_function(
        f"document.querySelector('#plan-version').textContent === 'v{new_version} · manual'"
    )
    assert [pg.locator(f'#plan-table td[data-rank="{r}"]').inner_text() for r in range(4)] == [
        str(b) for b in wanted
    ]
    # Served to the workers, who switch at their next iteration boundary.
    served = cluster.plan(running.id)
    assert served["version"] == new_version and served["batch_sizes"] == wanted
    assert served["source"] == "manual" and served["created_by"] == "olga"
    assert _wait_state(pg, "effective") == "effective"
    took = int(str(pg.locator("#override-status").get_attribute("data-iteration")))
    assert f"took effect at iteration {took:,}" in pg.locator("#override-status").inner_text()
    pg.wait_for_function(
        "document.querySelector('[data-chart=\"batch-size\"]').layout.shapes"
        f".some(s => s.name === 'plan-v{new_version}')"
    )
    shapes = _chart(pg, "batch-size", "d.layout.shapes.map(s => [s.name, s.x0])")
    assert [f"plan-v{new_version}", took] in shapes
    labels = _chart(pg, "batch-size", "d.layout.annotations.map(a => a.text)")
    assert f"v{new_version} override took effect" in labels
    rows = cluster.client.get(
        f"/api/v1/jobs/{running.id}/telemetry?since_iteration={took - 1}&rank=0"
    ).json()["items"]
    assert [(r["iteration"], r["plan_version"]) for r in rows[:2]] == [
        (took - 1, current["version"]),
        (took, new_version),
    ]
    audit = cluster.client.get(f"/api/v1/audit?target=job:{running.id}").json()["items"]
    entry = next(a for a in audit if a["action"] == "override.set_batches")
    assert entry["actor"] == "olga"
    assert entry["detail"]["reason"] == "rank 3 shares its node with a backup job"
    # Rank 2 slows down at iteration 100 (see _slow_rank_2): the detector would say so.
    record_straggler(live_app, running.id, rank=2, iteration=100)
    # Let a few more iterations arrive, then keep a picture of the page for people to judge.
    pg.wait_for_function(
        f"document.querySelector('[data-chart=\"iteration-time\"]').data[0].x.at(-1) >= {took + 15}"
    )
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "job-page.png"), full_page=True)


def test_freeze_and_unfreeze_from_the_page(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    pg = page.page
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{running.id}")
    pg.locator("#plan-table tbody tr").first.wait_for()
    for kind, frozen in (("freeze", True), ("unfreeze", False)):
        pg.select_option("#override-kind", kind)
        pg.fill("#override-reason", f"{kind} while we debug rank 2")
        pg.click("#override-preview")
        assert _wait_state(pg, "previewed", "error") == "previewed"
        assert "No plan change" in pg.locator("#override-preview-area").inner_text()
        pg.click("#override-apply")
        assert _wait_state(pg, "applied", "error") == "applied"
        assert pg.locator(".badge.frozen").count() == (1 if frozen else 0)
        assert cluster.client.get(f"/api/v1/jobs/{running.id}").json()["frozen"] is frozen
    audit = cluster.client.get(f"/api/v1/audit?target=job:{running.id}").json()["items"]
    assert [a["action"] for a in audit[:2]] == ["override.unfreeze", "override.freeze"]


def test_viewers_see_the_override_panel_disabled(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    pg = page.page
    sign_in(pg, live_app.url, cluster.token("viewer"), path=f"/jobs/{running.id}")
    pg.locator("#plan-table tbody tr").first.wait_for()
    assert pg.locator("#override-status").get_attribute("data-state") == "disabled"
    assert "operator role" in pg.locator("#override-status").inner_text()
    assert pg.locator("#override-preview").is_disabled()


def _models_url(job_id: int) -> re.Pattern[str]:
    """GET /models of the job, whatever page it asks for."""
    return re.compile(rf".*/api/v1/jobs/{job_id}/models(\?.*)?$")


def test_fitted_models_are_shown_with_the_plan_when_the_api_has_them(
    page: Page, live_app: LiveApp, running: RunningJob
) -> None:
    pg = page.page
    models = [
        {
            "rank": r,
            "per_sample_ms": p,
            "intercept_ms": INTERCEPT_MS,
            "floor_ms": 0.0,
            "identifiable": r != 3,
            "r2": 0.98,
        }
        for r, p in enumerate(PER_SAMPLE_MS)
    ]
    # Known figures for GET /models (one page), answered in the browser.
    pg.route(
        _models_url(running.id),
        lambda route: route.fulfill(json={"items": models, "total": len(models)}),
    )
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{running.id}")
    pg.locator("#plan-table thead").wait_for()
    assert "ms / sample" in str(pg.locator("#plan-table thead").text_content())
    row0 = pg.locator("#plan-table tbody tr").first.inner_text()
    assert "0.120" in row0 and "0.98" in row0
    assert "0.98 *" in pg.locator("#plan-table tbody tr").nth(3).inner_text()
    assert pg.locator("#models-note").is_hidden()


def test_a_missing_job_shows_the_servers_own_words(page: Page, live_app: LiveApp) -> None:
    pg = page.page
    sign_in(pg, live_app.url, live_app.admin_token, path="/jobs/999")
    pg.locator("#banner").wait_for()
    assert pg.locator("#banner").inner_text() == "Could not load the job: job 999 not found"


@pytest.mark.parametrize(
    ("status", "body", "content_type", "shown"),
    [
        (
            403,
            '{"detail": "viewers may not read models here"}',
            "application/json",
            "viewers may not read models here",
        ),
        # A proxy in between answers with a page, not an ErrorOut: its words, not a guess.
        (
            502,
            "<html><body><h1>upstream went away</h1></body></html>",
            "text/html",
            "HTTP 502 Bad Gateway: upstream went away",
        ),
    ],
)
def test_models_that_cannot_be_loaded_say_why(
    page: Page,
    live_app: LiveApp,
    running: RunningJob,
    status: int,
    body: str,
    content_type: str,
    shown: str,
) -> None:
    """The page once swallowed any failure here and said the server "answered 404"."""
    pg = page.page
    pg.route(
        _models_url(running.id),
        lambda route: route.fulfill(status=status, body=body, content_type=content_type),
    )
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{running.id}")
    pg.locator("#models-note").wait_for()
    assert pg.locator("#models-note").inner_text() == (
        f"Fitted performance models could not be loaded: {shown}"
    )
    assert pg.locator("#plan-table tbody tr").count() == 4, "the plan is shown all the same"


# ------------------------------------------------ overrides that need the rebalancer (main)


def _override(pg: Any, kind: str, rank: int | None = None, batch: int | None = None) -> str:
    pg.select_option("#override-kind", kind)
    if rank is not None:
        pg.select_option("#override-rank", str(rank))
    if batch is not None:
        pg.fill("#override-batch", str(batch))
    pg.fill("#override-reason", f"{kind} from the dashboard test")
    pg.click("#override-preview")
    state = _wait_state(pg, "previewed", "error")
    if state != "previewed":
        return f"preview refused: {pg.locator('#override-status').inner_text()} " + " ".join(
            pg.locator(".field-error").all_inner_texts()
        )
    pg.click("#override-apply")
    return _wait_state(pg, "applied", "effective", "error")


def _open(pg: Any, live_app: LiveApp, job_id: int) -> None:
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job_id}")
    pg.locator("#plan-table tbody tr").first.wait_for()


def test_pin_one_worker_and_let_the_planner_solve_the_rest(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    _open(page.page, live_app, running.id)
    assert _override(page.page, "pin", rank=1, batch=100) in ("applied", "effective")
    plan = cluster.plan(running.id)
    assert plan["batch_sizes"][1] == 100 and sum(plan["batch_sizes"]) == GLOBAL_BATCH


def test_exclude_a_worker_then_readmit_it(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    _open(page.page, live_app, running.id)
    assert _override(page.page, "exclude", rank=3) in ("applied", "effective")
    plan = cluster.plan(running.id)
    assert plan["batch_sizes"][3] == 0 and sum(plan["batch_sizes"]) == GLOBAL_BATCH


def test_readmit_an_excluded_worker(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    r = cluster.client.post(
        f"/api/v1/jobs/{running.id}/overrides",
        json={"kind": "exclude", "rank": 3, "reason": "set up the readmit test"},
    )
    assert r.status_code == 201, r.text  # applied
    _open(page.page, live_app, running.id)
    assert _override(page.page, "readmit", rank=3) in ("applied", "effective")
    assert cluster.plan(running.id)["batch_sizes"][3] > 0


def test_rebalance_now(
    page: Page, live_app: LiveApp, cluster: Cluster, running: RunningJob
) -> None:
    _open(page.page, live_app, running.id)
    assert _override(page.page, "rebalance_now") in ("applied", "effective")
    audit = cluster.client.get(f"/api/v1/audit?target=job:{running.id}").json()["items"]
    assert audit[0]["action"] == "override.rebalance_now"


def test_plan_table_shows_memory_caps_predicted_memory_and_the_fit(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    """A 12 GB and an 80 GB card reporting resnet50-like peaks (4595 + 90.7 b MB): the small
    card's cap is 71 per pass with the 10% headroom, and its share of 100 runs as 2 passes."""
    host = cluster.register("gpu-m", 2)
    emulation = [
        {
            "per_sample_ms": 1.0,
            "memory_mb": mb,
            "memory_base_mb": 4595,
            "memory_per_sample_mb": 90.7,
        }
        for mb in (12_288, 81_920)
    ]
    job = cluster.submit(2, 200, emulation=emulation, name="memory")
    cluster.mark_running(host, job)
    records = []
    for it in range(6):
        batches = [40, 160] if it % 2 else [60, 140]
        for rec in emulated_iteration(it, 1, batches, [1.0, 3.0], ts=time.time() - 6 + it):
            rec["peak_memory_mb"] = 4595 + 90.7 * rec["batch_size"]
            records.append(rec)
    cluster.post_telemetry(job["id"], records)
    pg = page.page
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job['id']}")
    pg.locator('#plan-table td[data-memory-cap="0"]').wait_for()
    head = str(pg.locator("#plan-table thead").text_content())
    assert "memory cap" in head and "memory fit" in head
    assert pg.locator('#plan-table td[data-memory-cap="0"]').inner_text() == "71 (2 passes)"
    row = pg.locator("#plan-table tbody tr").first.inner_text()
    assert "11,035 / 12,288 MB" in row, row  # its largest pass: 4595 + 90.7 * 71
    assert "4,595 + 90.7·b" in row, row
