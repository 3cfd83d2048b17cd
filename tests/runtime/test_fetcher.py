"""PlanFetcher with a long-polling fetch: a new plan reaches the leader when it is committed,
not a poll interval later."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import httpx

from agent.runtime.fetcher import PlanFetcher
from agent.runtime.remote import RemoteControlPlane
from contract.agent import PlanOut
from contract.base import PROTOCOL_VERSION
from contract.enums import PlanSource
from tests.harness import LiveServer, wait_placed


def plan_out(version: int) -> PlanOut:
    return PlanOut(
        job_id=1,
        version=version,
        batch_sizes=[4, 4],
        global_batch=8,
        source=PlanSource.AUTOMATIC,
        reason="t",
        created_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


def test_after_a_new_plan_the_long_poll_is_asked_again_at_once() -> None:
    committed = threading.Event()
    calls: list[float] = []

    def fetch() -> PlanOut | None:  # a server holding the request until a plan is committed
        calls.append(time.monotonic())
        if len(calls) == 1:
            committed.wait(10)
            return plan_out(2)
        if len(calls) == 2:
            return plan_out(3)  # committed right after the first
        threading.Event().wait(0.05)  # nothing new: the long-poll times out
        return None

    f = PlanFetcher(fetch, interval_s=60.0, known_version=1)  # a plain poll would wait 60 s
    f.start()
    committed.set()
    deadline = time.monotonic() + 10
    while (latest := f.latest()) is None or latest.version < 3:
        assert time.monotonic() < deadline, "the new plans did not arrive"
        time.sleep(0.01)
    f.close()
    assert f.errors == 0


def test_a_fetch_that_answers_at_once_still_polls_at_the_interval() -> None:
    calls: list[float] = []

    def fetch() -> PlanOut | None:
        calls.append(time.monotonic())
        return plan_out(1)  # unchanged, never newer than the known version

    f = PlanFetcher(fetch, interval_s=0.05, known_version=1)
    f.start()
    time.sleep(0.4)
    f.close()
    assert 2 <= len(calls) <= 12  # about 8: not a busy loop


def test_fetcher_on_the_rest_long_poll_hears_of_an_override_at_once(
    live_server: LiveServer,
) -> None:
    h = {"Authorization": f"Bearer {live_server.admin_token}"}
    with httpx.Client(base_url=live_server.url, headers=h, timeout=10.0) as http:
        devices = [{"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in (0, 1)]
        host = {
            "protocol_version": PROTOCOL_VERSION,
            "name": "h",
            "address": "127.0.0.1",
            "devices": devices,
        }
        http.post("/api/v1/hosts/register", json=host).raise_for_status()
        spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 8, "workers": 2}
        job = int(http.post("/api/v1/jobs", json={**spec, "iterations": 10}).json()["id"])
        wait_placed(http, f"/api/v1/jobs/{job}", job)
        remote = RemoteControlPlane(
            http, live_server.url, live_server.admin_token, job, plan_wait_s=20
        )
        first = remote.fetch_plan()
        assert first is not None and first.version == 1
        f = PlanFetcher(remote.fetch_plan, interval_s=60.0, known_version=1)
        f.start()
        time.sleep(0.3)  # the fetcher's request is now held at the server
        body = {"kind": "set_batches", "batch_sizes": [2, 6], "reason": "now"}
        http.post(f"/api/v1/jobs/{job}/overrides", json=body).raise_for_status()
        deadline = time.monotonic() + 10  # far less than the 20 s wait or the 60 s interval
        while (latest := f.latest()) is None:
            assert time.monotonic() < deadline, "the override did not reach the fetcher"
            time.sleep(0.01)
        assert latest.version == 2 and latest.batch_sizes == [2, 6]
        assert f.fetches == 1  # it came through the held request, not a new poll
        f.close(timeout_s=0.1)
