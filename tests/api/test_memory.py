"""Memory-aware plans through the API: caps from fitted memory models and device memory, plans
that carry them, the plan view that shows them, and overrides beyond a cap refused."""

from __future__ import annotations

from typing import Any

from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from server.db import transaction
from server.models import Job
from server.services import control_loop, memory
from tests.harness import Api

SMALL_MB, BIG_MB = 12_288, 81_920
BASE, PER_SAMPLE = 4_595.0, 90.7
"""resnet50-224px fp32 on an H100 (tests/data/h100_tb_curves.csv): mem(b) = 4595 + 90.7 b."""


def _cuda_host(api: Api) -> None:
    tok = api.token(Role.AGENT, host="gpu")
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "gpu",
        "address": "127.0.0.1",
        "devices": [
            {"index": 0, "kind": "cuda", "model": "RTX 3060", "memory_mb": SMALL_MB},
            {"index": 1, "kind": "cuda", "model": "A100 80GB", "memory_mb": BIG_MB},
        ],
    }
    r = api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(tok))
    assert r.status_code == 201, r.text


def _rec(rank: int, it: int, b: int, ms: float, **kw: Any) -> dict[str, Any]:
    return {
        "rank": rank,
        "iteration": it,
        "plan_version": 1,
        "batch_size": b,
        "data_ms": 0.1,
        "compute_ms": ms,
        "sync_ms": 0.1,
        "ts": 1_700_000_000.0 + it,
        "peak_memory_mb": BASE + PER_SAMPLE * b,
        **kw,
    }


def _job_with_telemetry(api: Api) -> int:
    """Rank 0 (12 GB) is three times faster than rank 1 (80 GB); both seen at two sizes."""
    _cuda_host(api)
    job = int(api.submit(workers=2, global_batch=200, policy={"name": "minmax"})["id"])  # type: ignore[call-overload]
    records = []
    for it in range(12):
        b0, b1 = (40, 160) if it % 2 else (60, 140)
        records += [_rec(0, it, b0, 5 + 1.0 * b0), _rec(1, it, b1, 5 + 3.0 * b1)]
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
    )
    assert r.status_code == 200, r.text
    return job


def test_caps_come_from_the_memory_fit_and_the_device_and_plans_carry_them(api: Api) -> None:
    job = _job_with_telemetry(api)
    models = api.client.get(f"/api/v1/jobs/{job}/models", headers=api.headers()).json()["items"]
    small, big = models
    # (0.9 * 12288 - 4595) / 90.7 = 71.3; (0.9 * 81920 - 4595) / 90.7 = 762.2
    assert small["memory_cap"] == 71 and big["memory_cap"] == 762
    assert small["device_memory_mb"] == SMALL_MB and small["memory_identifiable"]
    assert abs(small["memory_per_sample_mb"] - PER_SAMPLE) < 1e-6
    assert abs(small["predicted_memory_mb"] - (BASE + PER_SAMPLE * 71)) < 1e-6  # 100 > cap
    r = api.client.post(
        f"/api/v1/jobs/{job}/overrides",
        json={"kind": "rebalance_now", "reason": "fit memory"},
        headers=api.headers(),
    )
    assert r.status_code == 201, r.text  # applied
    plan = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()
    assert plan["memory_caps"] == [71, 762]
    # Speed only would give rank 0 150 of 200 (5 + b = 5 + 3 (200 - b)); at most 71 fit a pass.
    # 150 in three passes costs 3 * 5 + 150 = 165 ms, rank 1's 50 cost 155: accumulating pays.
    b0, b1 = plan["batch_sizes"]
    assert b0 + b1 == 200 and b0 > 71
    assert "memory caps changed" in plan["reason"] or "minmax" in plan["reason"]


def test_overrides_beyond_a_cap_are_refused_in_preview_with_the_reason(api: Api) -> None:
    job = _job_with_telemetry(api)
    for body, field in (
        ({"kind": "pin", "rank": 0, "batch_size": 100}, "batch_size"),
        ({"kind": "set_batches", "batch_sizes": [100, 100]}, "batch_sizes.0"),
    ):
        r = api.client.post(
            f"/api/v1/jobs/{job}/overrides",
            json={**body, "reason": "what if", "preview": True},
            headers=api.headers(),
        )
        assert r.status_code == 422, r.text
        assert r.json()["field"] == field
        assert "memory cap of 71 per pass" in r.json()["detail"]
        assert "12288 MB with 10% headroom" in r.json()["detail"]
    ok = api.client.post(
        f"/api/v1/jobs/{job}/overrides",
        json={"kind": "pin", "rank": 0, "batch_size": 70, "reason": "fits", "preview": True},
        headers=api.headers(),
    )
    assert ok.status_code == 200, ok.text
    assert api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()["version"] == 1


def test_an_out_of_memory_report_caps_the_rank_below_the_failing_size(api: Api) -> None:
    job = _job_with_telemetry(api)
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry",
        json={"records": [_rec(1, 12, 140, 425.0, oom_batch=140)]},
        headers=api.headers(),
    )
    assert r.status_code == 200, r.text
    models = api.client.get(f"/api/v1/jobs/{job}/models", headers=api.headers()).json()["items"]
    assert models[1]["oom_batch"] == 140 and models[1]["memory_cap"] == 139


def test_an_out_of_memory_report_is_an_event_and_a_new_plan_under_every_policy(api: Api) -> None:
    """Even ``equal`` (never re-planned on its own) gets a plan that carries the lowered cap."""
    _cuda_host(api)
    job = int(api.submit(workers=2, global_batch=200, policy={"name": "equal"})["id"])  # type: ignore[call-overload]
    records = [
        _rec(0, 0, 100, 105.0, peak_memory_mb=None),
        _rec(1, 0, 100, 305.0, peak_memory_mb=None, oom_batch=100),
    ]
    state = control_loop.LoopState()
    for _ in range(2):  # a retried batch and a second round record nothing twice
        api.client.post(
            f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
        )
        with transaction(api.client.app.state.context.sessions) as s:  # type: ignore[attr-defined]
            control_loop.sweep(s, state, watch=False)
    events = api.client.get(f"/api/v1/jobs/{job}/events", headers=api.headers()).json()["items"]
    assert [(e["kind"], e["rank"], e["detail"]["batch"]) for e in events] == [("oom", 1, 100)]
    assert "cap 99 per pass" in events[0]["action"]
    plan = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()
    assert plan["version"] == 2 and "out of memory on rank(s) 1" in plan["reason"]
    assert plan["memory_caps"] == [None, 99]
    assert plan["batch_sizes"] == [101, 99]  # equal within the cap; the rest to rank 0


def test_the_time_fit_counts_an_accumulated_iteration_as_passes(api: Api) -> None:
    """Rank 0 (t = 5 + b per pass) runs shares above its cap of 71 as two passes, 10 + b in all:
    the fitted single-pass model stays 5 + 1.0 b instead of absorbing the second intercept."""
    job = _job_with_telemetry(api)
    api.client.post(
        f"/api/v1/jobs/{job}/overrides",
        json={"kind": "rebalance_now", "reason": "caps"},
        headers=api.headers(),
    )
    plan = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()
    assert plan["memory_caps"][0] == 71
    records = []
    for it in range(12, 40):
        b0 = 100 if it % 2 else 130  # two passes either way
        records += [
            _rec(0, it, b0, 10 + 1.0 * b0, plan_version=plan["version"]),
            _rec(1, it, 200 - b0, 5 + 3.0 * (200 - b0), plan_version=plan["version"]),
        ]
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
    )
    assert r.status_code == 200, r.text
    fast = api.client.get(f"/api/v1/jobs/{job}/models", headers=api.headers()).json()["items"][0]
    assert abs(fast["per_sample_ms"] - 1.0) < 0.05 and abs(fast["intercept_ms"] - 5.0) < 1.0


def test_after_an_out_of_memory_error_the_cap_comes_from_the_pass_that_fitted(api: Api) -> None:
    """Rank 0 (12 GB) ran out of memory at 100 and redid its share in passes of 50: the peak
    belongs to 50 (``pass_size``), so its cap is the conservative guess through that point
    (11059 MB / 182.6 MB per sample = 60), not just one below the size that failed."""
    _cuda_host(api)
    job = int(api.submit(workers=2, global_batch=200, policy={"name": "equal"})["id"])  # type: ignore[call-overload]
    records = [
        _rec(0, 0, 100, 115.0, oom_batch=100, pass_size=50, peak_memory_mb=BASE + PER_SAMPLE * 50),
        _rec(1, 0, 100, 305.0),
    ]
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
    )
    assert r.status_code == 200, r.text
    small = api.client.get(f"/api/v1/jobs/{job}/models", headers=api.headers()).json()["items"][0]
    assert small["memory_cap"] == 60 and small["oom_batch"] == 100
    assert not small["memory_identifiable"]  # one pass size seen: a labelled guess


def test_the_control_loops_kept_window_gives_the_caps_a_read_of_the_window_does(
    api: Api,
) -> None:
    """The loop keeps the rows that measured a peak or ran out of memory as it reads them
    (``memory.KeptMemory``); through plans with caps, passes, an out-of-memory report and rows
    leaving the window, its caps are those of the window read from the database."""
    job = _job_with_telemetry(api)
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    state = control_loop.LoopState()

    def same() -> tuple[int | None, ...]:
        with transaction(sessions) as s:
            control_loop.sweep(s, state, watch=False)
        with transaction(sessions) as s:
            j = s.get(Job, job)
            assert j is not None
            kept = state.windows[job]
            assert memory.recent(s, j, kept.memory, kept.plan_caps()) == memory.recent(s, j)
            caps = memory.caps(s, j, kept.memory, kept.plan_caps())
            assert caps == memory.caps(s, j)
            return caps

    assert same() == (71, 762)
    version = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()["version"]
    it = 12
    for chunk in range(6):  # 300 iterations: the first ones leave the 200-iteration window
        records = []
        for _ in range(50):
            b0 = 100 if it % 2 else 60  # over the cap of 71 every other iteration: two passes
            extra = {"oom_batch": 150, "pass_size": 75} if chunk == 3 and it % 50 == 0 else {}
            records += [
                _rec(0, it, b0, 10 + 1.0 * b0, plan_version=version),
                _rec(1, it, 200 - b0, 5 + 3.0 * (200 - b0), plan_version=version, **extra),
            ]
            it += 1
        r = api.client.post(
            f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
        )
        assert r.status_code == 200, r.text
        caps = same()
        version = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()[
            "version"
        ]
    assert caps[1] == 149  # below the pass that ran out of memory, after it left the window
