"""Telemetry ingest: idempotent on (job, rank, iteration), bounded, validated."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness import Api


def _rec(rank: int, it: int, **kw: Any) -> dict[str, Any]:
    return {
        "rank": rank,
        "iteration": it,
        "plan_version": 1,
        "batch_size": 16,
        "data_ms": 1.0,
        "compute_ms": 10.0 + rank,
        "sync_ms": 2.0,
        "ts": 1_700_000_000.0 + it,
        **kw,
    }


def _job(api: Api) -> int:
    api.register("h", devices=2)
    return int(api.submit(workers=2, global_batch=32)["id"])  # type: ignore[call-overload]


def test_retried_batch_never_duplicates(api: Api) -> None:
    job = _job(api)
    batch = {"records": [_rec(r, i) for i in range(50) for r in range(2)]}
    first = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json=batch, headers=api.headers()
    ).json()
    assert first == {"accepted": 100, "duplicates": 0}
    again = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json=batch, headers=api.headers()
    ).json()
    assert again == {"accepted": 0, "duplicates": 100}
    overlap = {"records": [_rec(0, 49), _rec(0, 50), _rec(0, 50)]}
    assert api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json=overlap, headers=api.headers()
    ).json() == {"accepted": 1, "duplicates": 2}
    rows = api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=api.headers()).json()[
        "items"
    ]
    assert len(rows) == 101
    assert rows[0] == {
        **_rec(0, 0),
        "probe": False,
        "peak_memory_mb": None,
        "oom_batch": None,
        "pass_size": None,
    }
    metrics = api.client.get("/metrics").text
    assert (
        'evenflow_http_requests_total{method="POST",route="/api/v1/jobs/{job_id}/telemetry",status="200"} 3.0'
        in metrics
    )


def test_bad_records_are_422_and_store_nothing(api: Api) -> None:
    job = _job(api)
    cases = [
        ([_rec(0, 0), _rec(5, 1)], "records.1.rank"),
        ([_rec(0, 0, compute_ms="3")], "records.0.compute_ms"),
        ([_rec(0, 0, compute_ms=-1.0)], "records.0.compute_ms"),
        ([_rec(0, 0, extra=1)], "records.0.extra"),
        ([], "records"),
        ([_rec(0, i) for i in range(5001)], "records"),
    ]
    for records, field in cases:
        r = api.client.post(
            f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
        )
        assert r.status_code == 422, field
        assert r.json()["field"] == field
    assert (
        api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=api.headers()).json()[
            "items"
        ]
        == []
    )


def _columns(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The same records as one array per field (the form the runtime posts)."""
    fields = list(records[0])
    return {f: [r.get(f, False) for r in records] for f in fields}


def test_a_columnar_batch_stores_what_the_same_records_would(api: Api) -> None:
    job = _job(api)
    records = [
        _rec(
            r,
            i,
            probe=(i == 3 and r == 1),
            peak_memory_mb=None if r else 100.0 + i,
            oom_batch=24 if (r, i) == (0, 2) else None,
            pass_size=12 if (r, i) == (0, 2) else None,
        )
        for i in range(5)
        for r in range(2)
    ]
    ack = api.client.post(
        f"/api/v1/jobs/{job}/telemetry",
        json={"columns": _columns(records)},
        headers=api.headers(),
    ).json()
    assert ack == {"accepted": 10, "duplicates": 0}
    rows = api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=api.headers()).json()[
        "items"
    ]
    assert rows == records
    # The records form of an overlapping batch sees them as duplicates, and the reverse.
    again = {"records": [_rec(0, 4), _rec(0, 5)]}
    assert api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json=again, headers=api.headers()
    ).json() == {"accepted": 1, "duplicates": 1}
    without_probe = _columns([_rec(1, 5), _rec(1, 4)])
    assert "probe" not in without_probe  # absent: no probes
    assert "peak_memory_mb" not in without_probe  # absent: nothing measured its memory
    assert api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"columns": without_probe}, headers=api.headers()
    ).json() == {"accepted": 1, "duplicates": 1}
    last = api.client.get(
        f"/api/v1/jobs/{job}/telemetry?since_iteration=5&rank=1", headers=api.headers()
    ).json()["items"]
    assert last == [
        {**_rec(1, 5), "probe": False, "peak_memory_mb": None, "oom_batch": None, "pass_size": None}
    ]


def test_peak_memory_is_stored_from_records_and_columns_and_bounded(api: Api) -> None:
    job = _job(api)
    post = lambda body: api.client.post(  # noqa: E731
        f"/api/v1/jobs/{job}/telemetry", json=body, headers=api.headers()
    )
    assert post({"records": [_rec(0, 0, peak_memory_mb=2428.5)]}).json()["accepted"] == 1
    cols = _columns([_rec(1, 0, peak_memory_mb=3192.0), _rec(0, 1, peak_memory_mb=None)])
    cols["peak_memory_mb"] = [3192.0, None]
    assert post({"columns": cols}).json()["accepted"] == 2
    rows = api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=api.headers()).json()[
        "items"
    ]
    assert [r["peak_memory_mb"] for r in rows] == [2428.5, 3192.0, None]
    for bad, field in (
        ({"records": [_rec(0, 2, peak_memory_mb=-1.0)]}, "records.0.peak_memory_mb"),
        ({"columns": {**cols, "peak_memory_mb": [1.0]}}, "columns"),
        ({"columns": {**cols, "peak_memory_mb": [1.0, "x"]}}, "columns.peak_memory_mb.1"),
    ):
        r = post(bad)
        assert r.status_code == 422, bad
        assert field in r.text


def test_bad_columns_are_422_naming_the_column_and_store_nothing(api: Api) -> None:
    job = _job(api)
    good = _columns([_rec(0, 0), _rec(1, 0)])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"columns": {**good, "rank": [0, 5]}}, "columns.rank.1"),
        ({"columns": {**good, "compute_ms": [1.0, -1.0]}}, "columns.compute_ms.1"),
        ({"columns": {**good, "compute_ms": [1.0, "3"]}}, "columns.compute_ms.1"),
        ({"columns": {**good, "sync_ms": [1.0]}}, "columns"),
        ({"columns": {**good, "extra": [1, 2]}}, "columns.extra"),
        ({"columns": {k: v for k, v in good.items() if k != "ts"}}, "columns.ts"),
        ({"columns": {**good, "rank": []}}, "columns.rank"),
        ({"columns": good, "records": [_rec(0, 1)]}, "body"),
        ({"urgent": True}, "body"),
    ]
    for body, field in cases:
        r = api.client.post(f"/api/v1/jobs/{job}/telemetry", json=body, headers=api.headers())
        assert r.status_code == 422, (field, r.text)
        assert r.json()["field"] == field, r.json()
        if field == "columns":
            assert "columns.sync_ms has 1 values" in r.json()["detail"]
    assert (
        api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=api.headers()).json()[
            "items"
        ]
        == []
    )


def test_nan_and_infinity_are_refused(sqlite_api: Api) -> None:
    job = _job(sqlite_api)
    raw = (
        b'{"records": [{"rank": 0, "iteration": 0, "plan_version": 1, "batch_size": 1, "data_ms": NaN,'
        b' "compute_ms": 1, "sync_ms": 1, "ts": 1}]}'
    )
    r = sqlite_api.client.post(
        f"/api/v1/jobs/{job}/telemetry",
        content=raw,
        headers={**sqlite_api.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 422


def test_oversized_body_is_413(sqlite_api: Api) -> None:
    job = _job(sqlite_api)
    r = sqlite_api.client.post(
        f"/api/v1/jobs/{job}/telemetry",
        content=b"x" * (9 * 1024 * 1024),
        headers={**sqlite_api.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 413


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 1), st.integers(0, 30)), min_size=1, max_size=40),
        min_size=1,
        max_size=6,
    )
)
def test_any_sequence_of_retries_stores_each_key_once(
    sqlite_api: Api, batches: list[list[tuple[int, int]]]
) -> None:
    """Property: whatever batches (with overlaps and repeats) arrive, stored rows == distinct keys."""
    app = sqlite_api
    jobs = app.client.get("/api/v1/jobs", headers=app.headers()).json()["items"]
    job = jobs[0]["id"] if jobs else _job(app)
    before = {
        (r["rank"], r["iteration"])
        for r in app.client.get(
            f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=app.headers()
        ).json()["items"]
    }
    seen = set(before)
    for n, batch in enumerate(batches):
        records = [_rec(r, i) for r, i in batch]
        body = {"columns": _columns(records)} if n % 2 else {"records": records}
        ack = app.client.post(
            f"/api/v1/jobs/{job}/telemetry", json=body, headers=app.headers()
        ).json()
        new = {k for k in batch if k not in seen}
        assert ack == {"accepted": len(new), "duplicates": len(batch) - len(new)}
        seen |= new
    stored = app.client.get(
        f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=app.headers()
    ).json()["items"]
    assert len(stored) == len(seen)


def test_an_urgent_batch_wakes_the_controller(api: Api) -> None:
    job = _job(api)
    woken: list[int] = []
    app = api.client.app  # type: ignore[attr-defined]
    app.state.context.wake_controller = woken.append
    url, h = f"/api/v1/jobs/{job}/telemetry", api.headers()
    assert api.client.post(url, json={"records": [_rec(0, 0)]}, headers=h).status_code == 200
    assert woken == []  # the usual cadence: the next round will do
    body = {"records": [_rec(0, 1)], "urgent": True}
    assert api.client.post(url, json=body, headers=h).status_code == 200
    assert woken == [job]
    bad = {"records": [_rec(0, 2)], "urgent": "yes"}
    r = api.client.post(url, json=bad, headers=h)
    assert r.status_code == 422 and "urgent" in r.text
