"""Property: whatever agents report, jobs are cancelled, hosts lost and devices let go on
silence, no device is ever free while a rank that may still run is placed on it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from contract.enums import DeviceStatus
from server.db import transaction
from server.models import Device
from server.services import hosts, releases
from tests.harness import Api

STATES = ["running", "succeeded", "failed", "stopped"]
OPS = st.one_of(
    st.tuples(st.just("heartbeat"), st.integers(0, 1)),
    st.tuples(st.just("report"), st.integers(0, 2), st.integers(0, 1), st.sampled_from(STATES)),
    st.tuples(st.just("cancel"), st.integers(0, 2)),
    st.tuples(st.just("submit")),
    st.tuples(st.just("lost")),
    st.tuples(st.just("silence")),
)


def _free_while_held(api: Api) -> list[tuple[int, int | None]]:
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        free = s.scalars(select(Device).where(Device.status == DeviceStatus.FREE.value))
        return [
            (d.id, held)
            for d in free
            if (held := releases.job_still_running_on(s, d.id)) is not None
        ]


def _apply(
    api: Api, op: tuple[Any, ...], host_rows: list[dict[str, Any]], job_ids: list[int]
) -> None:
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    kind = op[0]
    if kind == "heartbeat":
        h = host_rows[op[1]]
        api.client.post(
            f"/api/v1/hosts/{h['id']}/heartbeat", json={}, headers=api.headers(h["_token"])
        )
    elif kind == "report" and op[1] < len(job_ids):
        job = api.client.get(f"/api/v1/jobs/{job_ids[op[1]]}", headers=api.headers()).json()
        w = next((w for w in job["workers"] if w["rank"] == op[2]), None)
        if w is not None:
            body = {"workers": [{"job_id": job["id"], "rank": op[2], "state": op[3]}]}
            # As its host's agent (the admin may act for any host: the job may have been
            # placed on a host of an earlier example).
            api.client.post(
                f"/api/v1/hosts/{w['host_id']}/heartbeat", json=body, headers=api.headers()
            )
    elif kind == "cancel" and op[1] < len(job_ids):
        api.client.post(f"/api/v1/jobs/{job_ids[op[1]]}/cancel", headers=api.headers())
    elif kind == "submit":
        job_ids.append(int(api.submit(workers=2)["id"]))  # type: ignore[call-overload]
    elif kind == "lost":
        with transaction(sessions) as s:
            hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=31), after_s=30)
    elif kind == "silence":
        with transaction(sessions) as s:
            hosts.release_silent(s, datetime.now(UTC) + timedelta(seconds=41), after_s=30)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, min_size=1, max_size=14))
def test_no_device_is_free_while_a_rank_may_run_on_it(api: Api, ops: list[tuple[Any, ...]]) -> None:
    tag = uuid.uuid4().hex[:6]
    host_rows = [api.register(f"{tag}-{i}", devices=1) for i in range(2)]
    job_ids = [int(api.submit(workers=2)["id"])]  # type: ignore[call-overload]
    for op in ops:
        _apply(api, op, host_rows, job_ids)
        assert _free_while_held(api) == [], op
    for job_id in job_ids:  # no pending job of this example takes the next one's devices
        api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers())
