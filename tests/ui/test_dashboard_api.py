"""The dashboard's server side without a browser: downsampled series, throughput, the live
stream, the session cookie and the pages' redirects. Runs on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

from contract.enums import Role
from tests.harness import SAME_ORIGIN, Api
from tests.ui.simulated import emulated_iteration


def _job(api: Api, workers: int = 2, global_batch: int = 64) -> int:
    api.register("h", devices=workers)
    return int(api.submit(workers=workers, global_batch=global_batch)["id"])  # type: ignore[call-overload]


def _post(api: Api, job: int, records: list[dict[str, Any]]) -> None:
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
    )
    assert r.status_code == 200, r.text


def _iterations(api: Api, job: int, its: range, version: int, batches: list[int]) -> None:
    records = []
    for it in its:
        records += emulated_iteration(it, version, batches, [0.5, 1.0], ts=1000.0 + it * 0.1)
    _post(api, job, records)


def test_series_is_bucketed_to_at_most_n_points_per_worker(api: Api) -> None:
    job = _job(api)
    _iterations(api, job, range(0, 600), 1, [32, 32])
    _iterations(api, job, range(600, 1000), 2, [40, 24])
    r = api.client.get(f"/api/v1/jobs/{job}/series?points=100", headers=api.headers())
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["bucket"] == 10 and s["world_size"] == 2
    assert (s["first_iteration"], s["last_iteration"]) == (0, 999)
    assert [len(rank["iteration"]) for rank in s["ranks"]] == [100, 100]
    assert len(s["measured"]["iteration"]) == 100
    rank0 = s["ranks"][0]
    assert rank0["iteration"][:3] == [0, 10, 20]
    assert rank0["batch_size"][0] == 32 and rank0["batch_size"][-1] == 40
    # Every rank waits for the slowest: the measured iteration is the slowest rank's total.
    assert s["measured"]["iteration_ms"][0] == max(
        r["data_ms"][0] + r["compute_ms"][0] + r["sync_ms"][0] for r in s["ranks"]
    )
    assert s["plan_effects"] == [{"version": 1, "iteration": 0}, {"version": 2, "iteration": 600}]
    assert [w["batch_size"] for w in s["window"]] == [40, 24]
    stored = api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1", headers=api.headers())
    assert stored.json()["total"] == 2000 and s["last_id"] > 0


def test_series_of_a_job_without_telemetry_is_empty(api: Api) -> None:
    job = _job(api)
    s = api.client.get(f"/api/v1/jobs/{job}/series", headers=api.headers()).json()
    assert s["ranks"] == [] and s["last_id"] == 0 and s["last_iteration"] is None
    assert api.client.get("/api/v1/jobs/999/series", headers=api.headers()).status_code == 404
    assert api.client.get(f"/api/v1/jobs/{job}/series").status_code == 401


def test_throughput_from_rank_zero_timestamps(api: Api) -> None:
    job = _job(api, global_batch=64)
    _iterations(api, job, range(0, 50), 1, [32, 32])  # one iteration per 0.1 s
    r = api.client.get(f"/api/v1/dashboard/throughput?ids={job}", headers=api.headers())
    assert r.status_code == 200, r.text
    assert r.json() == [{"job_id": job, "samples_per_s": 640.0, "iteration": 49}]
    bad = api.client.get("/api/v1/dashboard/throughput?ids=1,x", headers=api.headers())
    assert bad.status_code == 422 and bad.json()["field"] == "ids"


def _read_stream(api: Api, path: str, **headers: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    kind = None
    with api.client.stream("GET", path, headers={**api.headers(), **headers}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                out.append((str(kind), json.loads(line[6:])))
    return out


def test_stream_sends_new_telemetry_plans_and_job_state(sqlite_api: Api) -> None:
    api = sqlite_api
    job = _job(api)
    _iterations(api, job, range(0, 5), 1, [32, 32])
    last_id = api.client.get(f"/api/v1/jobs/{job}/series", headers=api.headers()).json()["last_id"]
    _iterations(api, job, range(5, 8), 1, [32, 32])
    body = {"kind": "set_batches", "batch_sizes": [40, 24], "reason": "test"}
    assert (
        api.client.post(
            f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers()
        ).status_code
        == 201
    )
    messages = _read_stream(
        api, f"/api/v1/jobs/{job}/stream?after={last_id}&plan_version=1&event_after=0&max_s=0.5"
    )
    kinds = [k for k, _ in messages]
    assert kinds == ["telemetry", "plan", "job"], kinds
    telemetry = messages[0][1]
    its = [row[telemetry["columns"].index("iteration")] for row in telemetry["rows"]]
    assert its == [5, 5, 6, 6, 7, 7]
    assert messages[1][1]["version"] == 2 and messages[1][1]["batch_sizes"] == [40, 24]
    # set_batches freezes automatic rebalancing so the planner does not undo it
    assert messages[2][1] == {
        "status": "starting",
        "frozen": True,
        "plan_version": 2,
        "pending_reason": None,
    }


def test_stream_resumes_from_last_event_id_and_ends_with_the_job(sqlite_api: Api) -> None:
    api = sqlite_api
    job = _job(api)
    _iterations(api, job, range(0, 3), 1, [32, 32])
    cancel = api.client.post(f"/api/v1/jobs/{job}/cancel", headers=api.headers())
    assert cancel.status_code == 200
    # Resuming after the first two rows sends only the rest, then says the job has ended.
    rows = api.client.get(f"/api/v1/jobs/{job}/telemetry", headers=api.headers()).json()["items"]
    assert len(rows) == 6
    first_ids = _read_stream(api, f"/api/v1/jobs/{job}/stream?after=0&max_s=5")
    assert [k for k, _ in first_ids] == ["telemetry", "job", "end"]
    resumed = _read_stream(api, f"/api/v1/jobs/{job}/stream?max_s=5", **{"Last-Event-ID": "2.1.0"})
    telemetry = resumed[0][1]
    assert len(telemetry["rows"]) == 4


def test_stream_needs_a_viewer_and_a_job(sqlite_api: Api) -> None:
    api = sqlite_api
    job = _job(api)
    assert api.client.get(f"/api/v1/jobs/{job}/stream?max_s=0.1").status_code == 401
    r = api.client.get("/api/v1/jobs/999/stream?max_s=0.1", headers=api.headers())
    assert r.status_code == 404 and r.json()["detail"] == "job 999 not found"
    viewer = api.token(Role.VIEWER)
    api.client.cookies.set("evenflow_session", viewer)
    try:
        with api.client.stream("GET", f"/api/v1/jobs/{job}/stream?max_s=0.2") as r:
            assert r.status_code == 200
    finally:
        api.client.cookies.clear()


def test_login_sets_an_httponly_strict_cookie_and_logout_clears_it(sqlite_api: Api) -> None:
    client = sqlite_api.client
    viewer = sqlite_api.token(Role.VIEWER, name="vera")
    r = client.post(
        "/login",
        content=f"token={viewer}&next=/jobs/3",
        headers={"Content-Type": "application/x-www-form-urlencoded", **SAME_ORIGIN},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == "/jobs/3"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"evenflow_session={viewer};")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    page = client.get("/jobs", follow_redirects=False)
    assert page.status_code == 200 and 'data-user="vera"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/api/v1/jobs").status_code == 200  # the cookie is the token
    out = client.post("/logout", headers=SAME_ORIGIN, follow_redirects=False)
    assert out.status_code == 303 and 'evenflow_session=""' in out.headers["set-cookie"]
    client.cookies.clear()
    assert client.get("/jobs", follow_redirects=False).headers["location"] == "/login?next=/jobs"


def test_bad_logins_and_redirects(sqlite_api: Api) -> None:
    client = sqlite_api.client
    form = {"Content-Type": "application/x-www-form-urlencoded", **SAME_ORIGIN}
    r = client.post("/login", content="token=ef_nope", headers=form, follow_redirects=False)
    assert r.status_code == 401 and "unknown token" in r.text and "set-cookie" not in r.headers
    r = client.post("/login", content="", headers=form, follow_redirects=False)
    assert r.status_code == 401
    # Never an open redirect.
    r = client.post(
        "/login",
        content=f"token={sqlite_api.token(Role.VIEWER)}&next=//evil.example/x",
        headers=form,
        follow_redirects=False,
    )
    assert r.headers["location"] == "/jobs"
    client.cookies.clear()
    for path in ("/", "/cluster", "/jobs", "/jobs/1", "/audit"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/login?next="), path
    assert client.get("/login").status_code == 200


def test_static_files_and_plotly_are_served_without_a_session(sqlite_api: Api) -> None:
    client = sqlite_api.client
    r = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    assert "plotly.js" in r.text[:200] and len(r.content) > 1_000_000
    again = client.get("/vendor/plotly.min.js", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304
    for name in ("api.js", "charts.js", "job.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200, name
    assert client.get("/static/nope.js").status_code == 404
