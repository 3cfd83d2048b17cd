"""/metrics counts and times every request by its route template and status, whatever raw path
it came by; what a process remembers of raw paths to name them is bounded."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from opentelemetry import trace

from server import metrics as metrics_module
from server.app import create_app
from server.context import context_of
from tests.harness import Api, driven, make_settings


def _count(text: str, method: str, route: str, status: int) -> float:
    line = f'evenflow_http_requests_total{{method="{method}",route="{route}",status="{status}"}}'
    found = re.search(re.escape(line) + r" ([\d.e+]+)", text)
    return float(found.group(1)) if found else 0.0


def test_requests_are_counted_by_template_and_status_across_raw_paths(sqlite_api: Api) -> None:
    api = sqlite_api
    for job_id in (1, 2, 3, 1, 2, 1):  # three raw paths of one template, none of them a job
        assert api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers()).status_code == 404
    api.register("h", devices=1)
    api.submit(workers=1, global_batch=8, place=False)
    assert api.client.get("/api/v1/jobs/1", headers=api.headers()).status_code == 200
    assert api.client.get("/no/such/page").status_code == 404
    text = api.client.get("/metrics").text
    assert _count(text, "GET", "/api/v1/jobs/{job_id}", 404) == 6
    assert _count(text, "GET", "/api/v1/jobs/{job_id}", 200) == 1
    assert _count(text, "GET", "unmatched", 404) == 1
    timed = 'evenflow_http_request_seconds_count{route="/api/v1/jobs/{job_id}"} 7.0'
    assert timed in text


def test_the_paths_remembered_are_bounded_and_still_named_right_past_it(
    sqlite_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = context_of(sqlite_api.client.app).metrics  # type: ignore[arg-type]
    monkeypatch.setattr(metrics_module, "REMEMBERED", 8)
    names = [metrics.route_name(f"/api/v1/hosts/{i}/heartbeat") for i in range(50)]
    assert set(names) == {"/api/v1/hosts/{host_id}/heartbeat"}
    assert metrics.route_name("/api/v1/jobs/7/plan") == "/api/v1/jobs/{job_id}/plan"
    assert metrics.route_name("/api/v1/jobs/7/nothing") == "unmatched"
    assert len(metrics._names) <= 8


@pytest.mark.parametrize("enabled", [False, True])
def test_fastapis_opentelemetry_is_asked_about_only_when_enabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    """Off by default: a request does not ask OpenTelemetry for its providers (which reads the
    environment each time); ``EVENFLOW_OPENTELEMETRY`` turns FastAPI's own telemetry on."""
    asked: list[str] = []
    real = trace.get_tracer_provider
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: asked.append("trace") or real())
    if enabled:
        monkeypatch.setenv("EVENFLOW_OPENTELEMETRY", "true")
    settings = make_settings(f"sqlite:///{tmp_path / 'e.db'}")
    assert settings.opentelemetry is enabled
    with TestClient(create_app(settings)) as client:
        asked.clear()
        api = driven(client)
        assert api.client.get("/api/v1/jobs", headers=api.headers()).status_code == 200
    assert bool(asked) is enabled


def test_metrics_say_whose_turn_the_controller_is_and_how_many_there_were(api: Api) -> None:
    """The app's own controller took the lock at its start: the first turn of this database's,
    taken by this process (a fail-over shows as one more)."""
    holder = f"{socket.gethostname()}:{os.getpid()}"
    line = f'evenflow_controller_epoch{{holder="{holder}"}} 1.0'
    deadline = time.monotonic() + 10
    text = ""
    while line not in text:
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
        text = api.client.get("/metrics").text
    since = re.search(r"^evenflow_controller_since_seconds ([\d.e+]+)$", text, re.M)
    assert since is not None and abs(float(since.group(1)) - time.time()) < 60
