"""Placement by the planner's integer program: fast devices, fewer hosts, elastic counts,
measured speeds over priors, explicit devices."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select, update

from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceStatus, HostStatus, Role
from contract.spec import JobSpec
from server.app import create_app
from server.context import context_of
from server.db import ReadChanged, transaction
from server.models import PENDING_REASON_LENGTH, Device, Host, Worker
from server.services import scheduler
from tests.harness import Api, driven, make_settings


def _host(api: Api, name: str, models: list[str], kind: str = "cuda") -> dict[str, Any]:
    tok = api.token(Role.AGENT, host=name)
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": name,
        "address": "10.0.0.1",
        "devices": [
            {"index": i, "kind": kind, "model": m, "memory_mb": 40_000}
            for i, m in enumerate(models)
        ],
    }
    r = api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(tok))
    assert r.status_code == 201, r.text
    data: dict[str, Any] = r.json()
    data["_token"] = tok
    return data


def _devices_of(api: Api, job: dict[str, Any]) -> set[int]:
    j = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    return {w["device_id"] for w in j["workers"]}


def _ids(host: dict[str, Any], *indices: int) -> set[int]:
    return {d["id"] for d in host["devices"] if d["index"] in indices}


def test_fast_gpus_are_chosen_from_the_published_figures(api: Api) -> None:
    old = _host(api, "old", ["Tesla K80", "Tesla K80"])
    new = _host(api, "new", ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"])
    job = api.submit(workers=2)
    assert _devices_of(api, job) == _ids(new, 0, 1)
    assert not _devices_of(api, job) & _ids(old, 0, 1)
    audit = api.client.get(f"/api/v1/audit?target=job:{job['id']}", headers=api.headers()).json()[
        "items"
    ]
    placed = next(a for a in audit if a["action"] == "job.placed")
    assert placed["detail"]["status"] in ("optimal", "feasible") and placed["detail"]["hosts"] == 1


def test_fewer_hosts_among_equal_devices(api: Api) -> None:
    a = _host(api, "a", ["NVIDIA V100-SXM2-16GB"] * 2)
    b = _host(api, "b", ["NVIDIA V100-SXM2-16GB"] * 3)
    job = api.submit(workers=3)
    assert _devices_of(api, job) == _ids(b, 0, 1, 2), "three on one host beat two plus one"
    assert a["devices"]


def test_max_workers_takes_what_pays(api: Api) -> None:
    _host(api, "a", ["NVIDIA V100-SXM2-16GB"] * 4)
    job = api.submit(workers=2, max_workers=4)
    assert len(_devices_of(api, job)) == 4
    plan = api.client.get(f"/api/v1/jobs/{job['id']}/plan", headers=api.headers()).json()
    assert plan["batch_sizes"] == [16, 16, 16, 16]
    r = api.client.post(
        "/api/v1/jobs",
        headers=api.headers(),
        json={
            "name": "bad",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "iterations": 1,
            "workers": 3,
            "max_workers": 2,
        },
    )
    assert r.status_code == 422 and "max_workers" in r.json()["detail"]


def test_measured_speeds_beat_the_prior(api: Api) -> None:
    host = _host(
        api, "h", ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"]
    )
    first = api.submit(workers=3)
    # Device of rank 2 turned out 4x slower on this workload (a throttled card).
    records = [
        {
            "rank": r,
            "iteration": i,
            "plan_version": 1,
            "batch_size": 21,
            "data_ms": 0.1,
            "compute_ms": 40.0 if r == 2 else 10.0,
            "sync_ms": 1.0,
            "ts": 1.0 + i,
        }
        for i in range(5)
        for r in range(3)
    ]
    api.client.post(
        f"/api/v1/jobs/{first['id']}/telemetry", json={"records": records}, headers=api.headers()
    )
    slow = next(
        w["device_id"]
        for w in api.client.get(f"/api/v1/jobs/{first['id']}", headers=api.headers()).json()[
            "workers"
        ]
        if w["rank"] == 2
    )
    api.client.post(f"/api/v1/jobs/{first['id']}/cancel", headers=api.headers())
    second = api.submit(workers=2)
    assert slow not in _devices_of(api, second)
    assert host["devices"]


def test_explicit_devices_wait_until_all_are_free(api: Api) -> None:
    host = _host(api, "h", ["NVIDIA A100-SXM4-80GB"] * 2)
    d0, d1 = sorted(_ids(host, 0, 1))
    blocker = api.submit(workers=None, devices=[d1])
    wants = api.submit(workers=None, devices=[d0, d1])
    assert wants["status"] == "pending"
    assert wants["pending_reason"] == (
        "first in the queue: the free device it can use is kept for it until 2 are; "
        f"needs devices {[d0, d1]}, 1 of them free, 1 busy with job {blocker['id']}"
    )
    api.client.post(f"/api/v1/jobs/{blocker['id']}/cancel", headers=api.headers())
    api.place()
    assert (
        api.client.get(f"/api/v1/jobs/{wants['id']}", headers=api.headers()).json()["status"]
        == "starting"
    )
    assert _devices_of(api, wants) == {d0, d1}


@settings(max_examples=60, deadline=None)
@given(
    holdings=st.lists(st.integers(1, 300), min_size=0, max_size=120),
    free=st.integers(0, 10_000),
    offline=st.integers(0, 50),
    workers=st.integers(1, 512),
)
def test_a_pending_reason_fits_its_column_and_names_the_largest_holders(
    holdings: list[int], free: int, offline: int, workers: int
) -> None:
    """At fleet scale (120 jobs holding devices among 10,000) a reason naming every busy job
    overflowed jobs.pending_reason and failed the submission with a 500: a reason names the
    jobs holding the most devices, sums the rest, and tells busy devices only when too few
    are free."""
    rows: list[tuple[int, int | None, bool]] = []
    for job_id, n in enumerate(holdings, start=1):
        rows += [(len(rows), job_id, False) for _ in range(n)]
    rows += [(len(rows), None, True) for _ in range(free)]
    rows += [(len(rows), None, False) for _ in range(offline)]
    spec = JobSpec.model_validate(
        {
            "name": "w",
            "workload": {"builtin": "mlp"},
            "global_batch": 1024,
            "workers": workers,
            "iterations": 10,
        }
    )
    reason = scheduler.explain(spec, scheduler.Landscape(tuple(rows)), tried=True)
    assert len(reason) <= PENDING_REASON_LENGTH
    assert reason.startswith(f"needs {workers} device{'s' if workers > 1 else ''}, {free} free")
    assert (f"{offline} offline" in reason) == (offline > 0)
    if free >= workers:
        assert "busy" not in reason and reason.endswith("no placement fits them")
        return
    ranked = sorted(enumerate(holdings, start=1), key=lambda jn: (-jn[1], jn[0]))
    for job_id, n in ranked[: scheduler.REASON_HOLDERS]:
        assert f"{n} busy with job {job_id}," in reason + ","
    rest = ranked[scheduler.REASON_HOLDERS :]
    if rest:
        assert f"{sum(n for _, n in rest)} busy with {len(rest)} other jobs" in reason


def test_a_submissions_pending_reason_is_what_the_device_list_would_say(api: Api) -> None:
    """A submission's first reason comes from counts the database takes (no device list):
    on an inventory with free, busy (several holders) and offline devices it says exactly
    what ``explain`` says from the whole list, for jobs that fit, do not, and name devices."""
    for name in ("a", "b", "c"):
        api.register(name, devices=4)
    for workers in (3, 2, 2):
        assert api.submit(workers=workers)["status"] == "starting"
    context = context_of(api.client.app)  # type: ignore[arg-type]
    with context.write_lock, transaction(context.sessions) as s:
        lost = s.scalars(select(Host).where(Host.name == "c")).one()
        lost.status = HostStatus.LOST
        s.flush()
        landscape = scheduler.Landscape.read(s)
        assert {(j, f) for _, j, f in landscape.rows} >= {(None, True), (None, False)}
        ids = [i for i, _, _ in landscape.rows]
        for extra in (
            ({"workers": n} for n in (1, 2, 5, 12)),
            ({"devices": d, "workers": None} for d in (ids[:2], ids[-3:], [ids[0], 9999])),
        ):
            for more in extra:
                spec = JobSpec.model_validate(
                    {
                        "name": "w",
                        "workload": {"builtin": "mlp"},
                        "global_batch": 64,
                        "iterations": 5,
                        **more,
                    }
                )
                said = scheduler.explain_submitted(s, spec)
                assert said == scheduler.explain(spec, landscape, tried=False), more


# ------------------------------------------------------------ the head of the queue keeps devices


def _job(api: Api, job: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    return out


def test_the_first_job_short_of_devices_keeps_them_as_they_free_up(api: Api) -> None:
    """A 4-worker job at top priority used to wait while each device that freed went to the
    next small job that fit: it keeps the free devices it can use, and starts once its
    neighbour's job ends, before the small job submitted after it."""
    host = _host(api, "h", ["NVIDIA A100-SXM4-80GB"] * 4)
    running = api.submit(workers=3)
    big = api.submit(workers=4, priority=10)
    small = api.submit(workers=1)
    assert (_job(api, big)["status"], _job(api, small)["status"]) == ("pending", "pending")
    assert _job(api, big)["pending_reason"].startswith(
        "first in the queue: the free device it can use is kept for it until 4 are; "
        "needs 4 devices, 1 free, 3 busy with job"
    )
    assert _job(api, small)["pending_reason"] == (
        f"needs 1 device, 1 free but 1 of them kept for job {big['id']} (priority 10), "
        "first in the queue and waiting for 4"
    )
    api.client.post(f"/api/v1/jobs/{running['id']}/cancel", headers=api.headers())
    api.place()
    assert _job(api, big)["status"] == "starting"
    assert _devices_of(api, big) == _ids(host, 0, 1, 2, 3)
    assert _job(api, small)["status"] == "pending"


def test_jobs_start_beside_what_the_head_keeps(api: Api) -> None:
    """The hold keeps only what the first job can use: devices of another kind, and free
    devices an explicit job does not name, still go to the jobs after it."""
    gpus = _host(api, "g", ["NVIDIA A100-SXM4-80GB"] * 3)
    cpu = api.register("c", devices=2, kind="cpu")
    d0, d1, d2 = sorted(_ids(gpus, 0, 1, 2))
    api.submit(workers=None, devices=[d2])
    named = api.submit(workers=None, devices=[d1, d2], priority=5)
    assert _job(api, named)["status"] == "pending"
    beside = api.submit(workers=1)  # d0 is free and not named: it starts on a GPU
    assert _job(api, beside)["status"] == "starting" and _devices_of(api, beside) == {d0}
    wide = api.submit(workers=3, priority=5)  # after ``named``: short, but keeps nothing
    one = api.submit(workers=1)  # would take the free A100 d1 but for the hold
    assert _job(api, wide)["status"] == "pending"
    assert _job(api, one)["status"] == "starting", "CPU slots are no one's to keep"
    assert _devices_of(api, one) <= {d["id"] for d in cpu["devices"]}  # type: ignore[attr-defined]


@pytest.fixture
def no_hold_api(db_url: str) -> Iterator[Api]:
    with TestClient(create_app(make_settings(db_url, queue_hold=False))) as client:
        yield driven(client)


def test_without_the_hold_any_job_that_fits_starts(no_hold_api: Api) -> None:
    api = no_hold_api
    _host(api, "h", ["NVIDIA A100-SXM4-80GB"] * 4)
    api.submit(workers=3)
    big = api.submit(workers=4, priority=10)
    small = api.submit(workers=1)
    assert _job(api, big)["status"] == "pending"
    assert not _job(api, big)["pending_reason"].startswith("first in the queue")
    assert _job(api, small)["status"] == "starting"


def test_a_device_taken_between_the_read_and_the_write_makes_the_pass_run_again(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A placement pass reads the free devices as rows and writes the ones it gives a job in
    one statement, only while they are still free: one that went offline meanwhile (its host
    lost) stops the pass (``ReadChanged``, retried by the controller) with nothing written, and
    the pass run again places the job on what is free then."""
    host = _host(api, "h", ["NVIDIA H100 80GB HBM3"] * 2 + ["Tesla K80"] * 2)
    job = api.submit(workers=2, place=False)
    context = context_of(api.client.app)  # type: ignore[arg-type]
    read = scheduler.free_devices

    def then_one_goes_offline(session: Any) -> list[scheduler.Free]:
        free = read(session)
        fast = next(d for d in free if d.model.startswith("NVIDIA H100"))
        with transaction(context.sessions) as other:
            other.execute(
                update(Device).where(Device.id == fast.id).values(status=DeviceStatus.OFFLINE)
            )
        return free

    with monkeypatch.context() as patched:
        patched.setattr(scheduler, "free_devices", then_one_goes_offline)
        with (
            pytest.raises(ReadChanged, match="were not all free"),
            transaction(context.sessions) as s,
        ):
            scheduler.place_pending(s, datetime.now(UTC))
    with context.sessions() as s:
        assert s.scalars(select(Worker).where(Worker.job_id == job["id"])).all() == []
        busy = s.scalars(select(Device).where(Device.status == DeviceStatus.BUSY)).all()
        assert busy == []
    assert api.place() == [job["id"]]
    offline = {
        d["id"]
        for d in api.client.get(f"/api/v1/hosts/{host['id']}", headers=api.headers()).json()[
            "devices"
        ]
        if d["status"] == "offline"
    }
    assert len(offline) == 1
    chosen = _devices_of(api, job)
    assert len(chosen) == 2 and not chosen & offline
    with context.sessions() as s:
        held = s.scalars(select(Device).where(Device.job_id == job["id"])).all()
        assert {d.id for d in held} == chosen
        assert {d.status for d in held} == {DeviceStatus.BUSY.value}
