"""Training metrics: idempotent ingest with per-rank rights, refused after the job ended, and
reads downsampled per (name, rank) with exact newest values. On SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.base import MAX_METRIC_NAMES, MAX_TELEMETRY_RECORDS
from contract.enums import Role
from tests.harness import Api


def _point(rank: int, it: int, name: str = "loss", value: float | None = None) -> dict[str, Any]:
    return {
        "rank": rank,
        "iteration": it,
        "name": name,
        "value": 1.0 / (it + 1) if value is None else value,
    }


def _job(api: Api, workers: int = 2) -> tuple[int, dict[str, Any]]:
    host = api.register("h", devices=workers)
    job = api.submit(workers=workers, global_batch=32)
    return int(str(job["id"])), host


def _post(api: Api, job: int, points: list[dict[str, Any]], token: str | None = None) -> Any:
    headers = api.headers(token) if token else api.headers()
    return api.client.post(f"/api/v1/jobs/{job}/metrics", json={"points": points}, headers=headers)


def _get(api: Api, job: int, **params: Any) -> Any:
    r = api.client.get(f"/api/v1/jobs/{job}/metrics", params=params, headers=api.headers())
    assert r.status_code == 200, r.text
    return r.json()


def test_retried_batch_never_duplicates_and_the_first_value_wins(api: Api) -> None:
    job, _ = _job(api)
    batch = [_point(0, i) for i in range(30)] + [_point(1, i, "acc", 0.5) for i in range(30)]
    assert _post(api, job, batch).json() == {"accepted": 60, "duplicates": 0}
    assert _post(api, job, batch).json() == {"accepted": 0, "duplicates": 60}
    overlap = [_point(0, 29, value=9.0), _point(0, 30), _point(0, 30, value=7.0)]
    assert _post(api, job, overlap).json() == {"accepted": 1, "duplicates": 2}
    out = _get(api, job, points=1000)
    assert out["names"] == ["acc", "loss"]
    assert out["bucket"] == 1 and (out["first_iteration"], out["last_iteration"]) == (0, 30)
    by = {(s["name"], s["rank"]): s for s in out["series"]}
    assert list(by) == [("acc", 1), ("loss", 0)]
    loss = by["loss", 0]
    assert loss["iteration"] == list(range(31))
    assert loss["value"] == [1.0 / (i + 1) for i in range(31)]  # 29 kept its first value
    assert (loss["last_iteration"], loss["last_value"]) == (30, 1.0 / 31)


def test_downsampling_bounds_points_and_means_each_bucket(api: Api) -> None:
    job, _ = _job(api)
    values = {i: float(i % 7) for i in range(1000)}
    for lo in range(0, 1000, 500):
        points = [_point(0, i, value=values[i]) for i in range(lo, lo + 500)]
        assert _post(api, job, points).json()["accepted"] == 500
    _post(api, job, [_point(1, i, "lr", 0.1) for i in range(0, 1000, 10)])
    out = _get(api, job, points=10)
    assert out["bucket"] == 100
    for s in out["series"]:
        assert len(s["iteration"]) <= 10
    loss = next(s for s in out["series"] if s["name"] == "loss")
    assert loss["iteration"] == list(range(0, 1000, 100))
    for k, first in enumerate(loss["iteration"]):
        bucket = [values[i] for i in range(first, first + 100)]
        assert abs(loss["value"][k] - sum(bucket) / 100) < 1e-9
    assert (loss["last_iteration"], loss["last_value"]) == (999, values[999])
    only = _get(api, job, points=10, names="lr")
    assert [s["name"] for s in only["series"]] == ["lr"]
    assert only["names"] == ["loss", "lr"]  # every name, whatever was asked
    assert _get(api, job, rank=1)["series"][0]["rank"] == 1
    empty = _get(api, job, names="nothing")
    assert empty["series"] == [] and empty["first_iteration"] is None


def test_every_point_lands_in_one_bucket_within_bounds(sqlite_api: Api) -> None:
    """Property: at most `points` entries per series, each at the first iteration of its
    bucket, one entry for every bucket that holds a point."""
    api = sqlite_api
    job, _ = _job(api)
    names: list[str] = []

    @settings(max_examples=20, deadline=None)
    @given(
        its=st.lists(st.integers(0, 10**6), min_size=1, max_size=60, unique=True),
        points=st.integers(10, 50),
    )
    def check(its: list[int], points: int) -> None:
        name = f"m{len(names)}"
        names.append(name)
        assert _post(api, job, [_point(0, i, name, 1.0) for i in its]).status_code == 200
        out = _get(api, job, points=points, names=name)
        (s,) = out["series"]
        lo, bucket = min(its), out["bucket"]
        assert (out["first_iteration"], out["last_iteration"]) == (lo, max(its))
        assert len(s["iteration"]) <= points and (max(its) - lo) // bucket < points
        firsts: dict[int, int] = {}
        for i in sorted(its):
            firsts.setdefault((i - lo) // bucket, i)
        assert s["iteration"] == list(firsts.values())
        assert s["value"] == [1.0] * len(firsts)

    check()


def test_rights_one_rank_per_worker_credential_and_none_for_readers(api: Api) -> None:
    job, host = _job(api)
    hb = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": []},
        headers=api.headers(str(host["_token"])),
    ).json()
    tokens = {a["rank"]: a["worker_token"] for a in hb["assignments"] if a["job_id"] == job}
    r = _post(api, job, [_point(0, 0), _point(1, 0)], tokens[0])
    assert r.status_code == 403
    assert "may post metrics for rank 0 only, not rank 1" in r.json()["detail"]
    assert _post(api, job, [_point(0, 0)], tokens[0]).json() == {"accepted": 1, "duplicates": 0}
    assert _post(api, job, [_point(1, 0)], tokens[1]).json() == {"accepted": 1, "duplicates": 0}
    assert _post(api, job, [_point(0, 1)], str(host["_token"])).status_code == 200  # its host's
    other = api.register("other-host", devices=1)
    r = _post(api, job, [_point(0, 2)], str(other["_token"]))
    assert r.status_code == 403 and "not placed on host 'other-host'" in r.json()["detail"]
    for role in (Role.VIEWER, Role.OPERATOR):
        r = _post(api, job, [_point(0, 3)], api.token(role))
        assert r.status_code == 403, role
    assert (
        api.client.post(f"/api/v1/jobs/{job}/metrics", json={"points": [_point(0, 4)]}).status_code
        == 401
    )
    viewer = api.token(Role.VIEWER)
    assert (
        api.client.get(f"/api/v1/jobs/{job}/metrics", headers=api.headers(viewer)).status_code
        == 200
    )
    assert len(_get(api, job)["series"]) == 2  # nothing refused was stored


def test_metrics_of_an_ended_or_pending_job_are_409(api: Api) -> None:
    job, _ = _job(api)
    assert _post(api, job, [_point(0, 0)]).status_code == 200
    api.client.post(f"/api/v1/jobs/{job}/cancel", headers=api.headers())
    r = _post(api, job, [_point(0, 1)])
    assert r.status_code == 409 and "has ended (cancelled)" in r.json()["detail"]
    pending = int(api.submit(workers=1, place=False)["id"])  # type: ignore[call-overload]
    assert _post(api, pending, [_point(0, 0)]).status_code == 409
    assert _post(api, 999_999, [_point(0, 0)]).status_code == 404
    assert api.client.get("/api/v1/jobs/999999/metrics", headers=api.headers()).status_code == 404
    assert _get(api, job)["series"][0]["iteration"] == [0]


def test_bad_points_and_queries_are_422_naming_the_field_and_store_nothing(api: Api) -> None:
    job, _ = _job(api)
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([_point(0, 0), _point(5, 1)], "points.1.rank"),
        ([_point(0, 0, name="bad name")], "points.0.name"),
        ([_point(0, 0, name="")], "points.0.name"),
        ([_point(0, 0, name="x" * 129)], "points.0.name"),
        ([_point(0, 0, value=1e31)], "points.0.value"),
        ([{**_point(0, 0), "value": "1"}], "points.0.value"),
        ([{**_point(0, 0), "extra": 1}], "points.0.extra"),
        ([_point(0, -1, value=1.0)], "points.0.iteration"),
        ([], "points"),
        ([_point(0, i) for i in range(5001)], "points"),
    ]
    for points, field in cases:
        r = _post(api, job, points)
        assert r.status_code == 422, (field, r.text)
        assert r.json()["field"] == field, r.json()
    raw = b'{"points": [{"rank": 0, "iteration": 0, "name": "loss", "value": NaN}]}'
    r = api.client.post(
        f"/api/v1/jobs/{job}/metrics",
        content=raw,
        headers={**api.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 422
    for params in (
        {"points": 5},
        {"points": 10_001},
        {"names": "a,,b"},
        {"names": "x y"},
        {"rank": -1},
    ):
        r = api.client.get(f"/api/v1/jobs/{job}/metrics", params=params, headers=api.headers())
        assert r.status_code == 422, params
        assert r.json()["field"] == next(iter(params)), r.json()
    assert _get(api, job)["series"] == []


def test_a_job_reports_at_most_max_metric_names(api: Api) -> None:
    job, _ = _job(api)
    names = [f"m{i:02d}" for i in range(MAX_METRIC_NAMES)]
    assert _post(api, job, [_point(0, 0, n) for n in names]).json()["accepted"] == MAX_METRIC_NAMES
    assert _post(api, job, [_point(0, 1, n) for n in names]).json()["accepted"] == MAX_METRIC_NAMES
    r = _post(api, job, [_point(0, 2, "m00"), _point(0, 2, "one-too-many")])
    assert r.status_code == 422 and r.json()["field"] == "points.1.name"
    assert f"at most {MAX_METRIC_NAMES} metric names" in r.json()["detail"]
    assert len(_get(api, job)["names"]) == MAX_METRIC_NAMES


def test_a_full_batch_is_one_insert_within_the_backends_parameter_limits(api: Api) -> None:
    job, _ = _job(api)
    points = [_point(i % 2, i // 2, f"m{i % 3}", 0.5) for i in range(MAX_TELEMETRY_RECORDS)]
    assert _post(api, job, points).json() == {"accepted": MAX_TELEMETRY_RECORDS, "duplicates": 0}
    assert _post(api, job, points).json() == {"accepted": 0, "duplicates": MAX_TELEMETRY_RECORDS}
