"""Shared membership: a rank out of the all-reduce group that dies leaves the job for good when
the others can go on (no restart); otherwise the job restarts saying why. The decision alone,
then through the agents' heartbeats against the real app."""

from __future__ import annotations

from typing import Any

import pytest

from contract.enums import PlanSource, Role
from server.context import context_of
from server.db import transaction
from server.models import Job
from server.services import departures, plans
from tests.api.test_restarts import _assignments, _failed, _heartbeat
from tests.harness import Api


@pytest.mark.parametrize(
    ("rank", "running", "excluded", "departed", "minimum", "go_on", "why"),
    [
        (2, True, [2], [], 3, True, None),
        (2, True, [1, 2], [1], 2, True, None),
        (2, True, [], [], 3, False, None),  # in the group: a plain restart
        (0, True, [0], [], 3, False, "rank 0 holds the job's rendezvous"),
        (2, True, [2], [], 4, False, "the 3 rank(s) left are fewer than the job's minimum of 4"),
        (2, True, [1, 2], [1], 3, False, "the 2 rank(s) left are fewer"),
        (2, False, [2], [], 3, False, "the job was starting"),
    ],
)
def test_the_decision(
    rank: int,
    running: bool,
    excluded: list[int],
    departed: list[int],
    minimum: int,
    go_on: bool,
    why: str | None,
) -> None:
    d = departures.decide(
        rank,
        running=running,
        world_size=4,
        excluded=excluded,
        departed=departed,
        min_workers=minimum,
    )
    assert d.go_on is go_on
    assert (d.why is None) if why is None else (d.why is not None and why in d.why)


def _running_job(api: Api, **extra: Any) -> tuple[dict[str, Any], Any]:
    host = api.register("host-a", devices=4)
    job = api.submit(workers=3, max_workers=4, global_batch=64, **extra)
    assert len(job["workers"]) == 4
    running = [{"job_id": job["id"], "rank": r, "state": "running", "attempt": 0} for r in range(4)]
    _heartbeat(api, host, *running)
    return host, job["id"]


def _exclude(api: Api, job_id: int, rank: int) -> int:
    """What the straggler ladder stores for a rank it takes out of the all-reduce group."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    with context.write_lock, transaction(context.sessions) as s:
        job = s.get(Job, job_id)
        assert job is not None
        sizes = [0 if r == rank else 22 for r in range(4)]
        sizes[next(r for r in range(4) if r != rank)] -= 2
        return plans.create(
            s, job, sizes, PlanSource.AUTOMATIC, "ladder", by="stragglers", excluded=[rank]
        ).version


def _job(api: Api, job_id: int) -> dict[str, Any]:
    out: dict[str, Any] = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers()).json()
    return out


def test_an_excluded_rank_that_dies_departs_without_a_restart(api: Api) -> None:
    host, job_id = _running_job(api)
    assert _job(api, job_id)["status"] == "running"
    version = _exclude(api, job_id, 2)
    _heartbeat(api, host, _failed(job_id, 2, exit_code=-9))
    out = _job(api, job_id)
    assert out["status"] == "running"
    assert (out["attempt"], out["restarts"], out["restart_history"]) == (0, 0, [])
    (gone,) = out["departures"]
    assert (gone["rank"], gone["attempt"], gone["reason"]) == (2, 0, "rank 2 killed by SIGKILL")
    plan = api.client.get(f"/api/v1/jobs/{job_id}/plan", headers=api.headers()).json()
    assert plan["version"] == version + 1 and plan["departed"] == [2]
    assert plan["excluded"] == [2] and plan["batch_sizes"][2] == 0
    # the others keep running; the departed rank's device is free
    assert sorted(a["rank"] for a in _assignments(api, host, job_id)) == [0, 1, 3]
    devices = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"][0]["devices"]
    assert sorted(d["status"] for d in devices) == ["busy", "busy", "busy", "free"]
    # no later plan gives it samples, nor an operator
    r = api.client.post(
        f"/api/v1/jobs/{job_id}/overrides",
        json={"kind": "readmit", "rank": 2, "reason": "back?"},
        headers=api.headers(api.token(Role.OPERATOR)),
    )
    assert r.status_code == 422 and "has left job" in r.json()["detail"]
    # the others finish: the job succeeds without it
    _heartbeat(
        api,
        host,
        *({"job_id": job_id, "rank": r, "state": "succeeded", "attempt": 0} for r in (0, 1, 3)),
    )
    assert _job(api, job_id)["status"] == "succeeded"


def test_when_the_others_cannot_go_on_the_job_restarts_saying_why(api: Api) -> None:
    host, job_id = _running_job(api)
    _exclude(api, job_id, 0)
    _heartbeat(api, host, _failed(job_id, 0, exit_code=-9))
    out = _job(api, job_id)
    assert out["restarts"] == 1 and out["departures"] == []
    assert out["restart_history"][0]["reason"].startswith(
        "rank 0 killed by SIGKILL (it was out of the all-reduce group, but rank 0 holds"
    )


def test_an_excluded_rank_below_the_minimum_restarts_the_job(api: Api) -> None:
    host = api.register("host-a", devices=4)
    job = api.submit(workers=4, global_batch=64)
    job_id = job["id"]
    _heartbeat(
        api,
        host,
        *({"job_id": job_id, "rank": r, "state": "running", "attempt": 0} for r in range(4)),
    )
    _exclude(api, job_id, 3)
    _heartbeat(api, host, _failed(job_id, 3, exit_code=-9))
    out = _job(api, job_id)
    assert out["restarts"] == 1 and out["departures"] == []
    assert "fewer than the job's minimum of 4 workers" in out["restart_history"][0]["reason"]
