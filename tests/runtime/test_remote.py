"""The REST adapter, against httpx.MockTransport (no sockets)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import httpx
import pytest

from agent.runtime.remote import RemoteControlPlane
from contract.agent import TelemetryBatch, TelemetryRecord

PLAN = {
    "job_id": 7,
    "version": 3,
    "batch_sizes": [10, 22],
    "global_batch": 32,
    "source": "automatic",
    "reason": "rebalance",
    "created_at": datetime(2025, 1, 1, tzinfo=UTC).isoformat(),
}


def test_fetch_plan_sends_token_and_honours_etag() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get("If-None-Match") == '"v3"':
            return httpx.Response(304)
        return httpx.Response(200, json=PLAN, headers={"ETag": '"v3"'})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        remote = RemoteControlPlane(client, "http://cp:8000/", "s3cret", 7)
        plan = remote.fetch_plan()
        assert plan is not None and plan.version == 3 and plan.batch_sizes == [10, 22]
        assert remote.fetch_plan() is None  # unchanged
    assert [str(r.url) for r in seen] == [
        "http://cp:8000/api/v1/jobs/7/plan",
        "http://cp:8000/api/v1/jobs/7/plan?known_version=3",
    ]
    assert all(r.headers["Authorization"] == "Bearer s3cret" for r in seen)
    assert "If-None-Match" not in seen[0].headers


def test_fetch_plan_long_polls_with_the_known_version_and_a_longer_read_timeout() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.params.get("known_version") == "3":
            return httpx.Response(304)
        return httpx.Response(200, json=PLAN)

    with httpx.Client(transport=httpx.MockTransport(handler), timeout=5.0) as client:
        remote = RemoteControlPlane(client, "http://cp", "t", 7, plan_wait_s=12.5)
        assert remote.fetch_plan() is not None  # the first fetch answers at once
        assert remote.fetch_plan() is None
    assert dict(seen[0].url.params) == {}
    assert dict(seen[1].url.params) == {"known_version": "3", "wait_s": "12.5"}
    assert seen[1].extensions["timeout"]["read"] == 5.0 + 12.5  # outlasts the server's wait
    with pytest.raises(ValueError, match="plan_wait_s"):
        RemoteControlPlane(client, "http://cp", "t", 7, plan_wait_s=31)


def test_fetch_plan_raises_on_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"detail": "down"})

    with (
        httpx.Client(transport=httpx.MockTransport(handler)) as client,
        pytest.raises(httpx.HTTPStatusError),
    ):
        RemoteControlPlane(client, "http://cp", "t", 1).fetch_plan()


def test_post_telemetry_sends_the_batch_and_parses_the_ack() -> None:
    bodies: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "POST"
        assert request.url.path == "/api/v1/jobs/7/telemetry"
        assert request.headers["Authorization"] == "Bearer tok"
        bodies.append(json.loads(request.content))
        if len(bodies) == 1:
            return httpx.Response(502)
        return httpx.Response(200, json={"accepted": 1, "duplicates": 0})

    record = TelemetryRecord(
        rank=1,
        iteration=5,
        plan_version=2,
        batch_size=8,
        data_ms=0.5,
        compute_ms=3.0,
        sync_ms=1.0,
        ts=1.7e9,
    )
    batch = TelemetryBatch(records=[record])
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        remote = RemoteControlPlane(client, "http://cp", "tok", 7)
        with pytest.raises(httpx.HTTPStatusError):
            remote.post_telemetry(batch)
        ack = remote.post_telemetry(batch)
    assert (ack.accepted, ack.duplicates) == (1, 0)
    sent = TelemetryBatch.model_validate(bodies[1])
    assert sent.columns is not None and sent.records is None  # posted as arrays
    assert sent.all_records() == [record]
