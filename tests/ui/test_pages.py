"""Signing in and out in a real browser; anonymous visitors see only the login page."""

from __future__ import annotations

import httpx
import pytest

from tests.ui.harness import LiveApp, Page, sign_in
from tests.ui.simulated import Cluster

pytestmark = pytest.mark.browser


def test_anonymous_visitors_get_the_login_page_and_no_data(page: Page, live_app: LiveApp) -> None:
    pg = page.page
    for path in ("/", "/jobs", "/cluster", "/audit", "/jobs/1"):
        pg.goto(live_app.url + path)
        assert pg.url.startswith(f"{live_app.url}/login?next="), path
        assert pg.locator("input[name=token]").is_visible()
        assert pg.locator("table").count() == 0
    assert httpx.get(live_app.url + "/api/v1/jobs").status_code == 401
    assert httpx.get(live_app.url + "/api/v1/jobs/1/stream?max_s=1").status_code == 401


def test_sign_in_with_a_token_then_out(page: Page, live_app: LiveApp, cluster: Cluster) -> None:
    pg = page.page
    viewer = cluster.token("viewer", name="vera")
    pg.goto(live_app.url + "/login")
    pg.fill("input[name=token]", "ef_not-a-token")
    pg.click("button[type=submit]")
    assert "unknown token" in pg.locator(".form-error").inner_text()
    assert not pg.context.cookies()
    sign_in(pg, live_app.url, viewer, path="/cluster")
    assert pg.locator(".who .user").inner_text() == "vera"
    cookie = next(c for c in pg.context.cookies() if c["name"] == "evenflow_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    # The page's JavaScript cannot read the token.
    assert "evenflow_session" not in pg.evaluate("document.cookie")
    pg.click("text=Log out")
    pg.wait_for_url(f"{live_app.url}/login")
    pg.goto(live_app.url + "/jobs")
    assert pg.url.startswith(f"{live_app.url}/login?next=/jobs")


def test_cluster_and_audit_pages_show_hosts_jobs_and_who_did_what(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    host = cluster.register("gpu-07", 2, model="NVIDIA H100")
    job = cluster.submit(2, 64, name="bert-base")
    cluster.mark_running(host, job)
    sign_in(pg, live_app.url, live_app.admin_token, path="/cluster")
    row = pg.locator('[data-host="gpu-07"] tr[data-device]').first
    row.locator("a").wait_for()
    assert "H100" in row.inner_text() and f"#{job['id']} bert-base" in row.inner_text()
    assert "rank 0 (running)" in row.inner_text()
    assert "last heartbeat" in pg.locator('[data-host="gpu-07"] header').inner_text()
    pg.click("nav >> text=Audit log")
    pg.locator('tr[data-action="job.create"]').wait_for()
    assert "bootstrap-admin" in pg.locator('tr[data-action="job.create"]').inner_text()
    pg.fill("#audit-target", f"job:{job['id']}")
    pg.click("#audit-filter button")
    pg.wait_for_function("!document.querySelector('tr[data-action=\"host.register\"]')")
    assert pg.locator('tr[data-action="job.placed"]').count() == 1


def test_a_pending_job_page_says_why_it_waits(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    cluster.register("gpu-01", 2)
    running = cluster.submit(2, 64, name="first")
    assert running["status"] == "starting"
    waiting = cluster.submit(2, 64, name="second")
    assert waiting["status"] == "pending"
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{waiting['id']}")
    note = pg.locator("#pending-note")
    note.wait_for(state="visible")
    assert note.inner_text() == (
        f"Waiting for devices: needs 2 devices, 0 free, 2 busy with job {running['id']}."
    )
    pg.goto(f"{live_app.url}/jobs/{running['id']}")
    pg.locator("#job-name").filter(has_text="first").wait_for()
    assert not pg.locator("#pending-note").is_visible()


def test_a_failed_job_page_shows_the_reason_traceback_and_each_ranks_log(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    host = cluster.register("gpu-02", 2)
    job = cluster.submit(2, 64, name="doomed", max_restarts=0)  # fails, not restarts
    cluster.mark_running(host, job)
    tb = 'Traceback (most recent call last):\n  File "train.py", line 7\nRuntimeError: boom'
    reports = [
        {
            "job_id": job["id"],
            "rank": 1,
            "state": "failed",
            "exit_code": 1,
            "error": tb,
            "log_tail": "step 41 loss 0.31\n" + tb,
        },
        {
            "job_id": job["id"],
            "rank": 0,
            "state": "stopped",
            "exit_code": -15,
            "log_tail": "step 41 loss 0.30\nstep 42 loss 0.29",
        },
    ]
    r = cluster.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": reports},
        headers={"Authorization": f"Bearer {host['token']}"},
    )
    assert r.status_code == 200, r.text
    sign_in(pg, live_app.url, live_app.admin_token, path=f"/jobs/{job['id']}")
    pg.locator("#failure").wait_for(state="visible")
    assert "rank 1 failed" in pg.locator("#failure-reason").inner_text()
    assert "RuntimeError: boom" in pg.locator("#failure-traceback").inner_text()
    pg.locator('#failure-logs details[data-rank="0"]').wait_for()
    failed = pg.locator('#failure-logs details[data-rank="1"]')
    assert "exit 1" in failed.locator("summary").inner_text()
    assert "step 41 loss 0.31" in failed.locator("pre").inner_text()  # open: the failed rank
    stopped = pg.locator('#failure-logs details[data-rank="0"]')
    stopped.locator("summary").click()
    assert "step 42 loss 0.29" in stopped.locator("pre").inner_text()
