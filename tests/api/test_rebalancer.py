"""The rebalancing loop end to end through the API: telemetry -> fits -> plans, and overrides
that go through the planner (pin, exclude, readmit, rebalance now)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.enums import Role
from server.db import transaction
from server.models import Job
from server.services import control_loop, rebalancer
from tests.harness import Api

PER_SAMPLE = [1.0, 1.0, 2.0, 4.0]
INTERCEPT = 5.0
B = 256


def _policy(**kw: Any) -> dict[str, Any]:
    return {"name": "minmax", "rebalance_every": 10, "explore_iterations": 5, **kw}


class Sim:
    """Workers that report t = intercept + per_sample * b for whatever plan the server serves."""

    def __init__(self, api: Api, policy: dict[str, Any] | None = None) -> None:
        self.api = api
        self.host = api.register("sim", devices=4)
        self.job = int(api.submit(workers=4, global_batch=B, policy=policy or _policy())["id"])  # type: ignore[call-overload]
        self.iteration = 0
        self.state = control_loop.LoopState()

    def plan(self) -> dict[str, Any]:
        data: dict[str, Any] = self.api.client.get(
            f"/api/v1/jobs/{self.job}/plan", headers=self.api.headers()
        ).json()
        return data

    def run(self, iterations: int) -> None:
        for _ in range(iterations):
            plan = self.plan()
            records = [
                {
                    "rank": r,
                    "iteration": self.iteration,
                    "plan_version": plan["version"],
                    "batch_size": b,
                    "data_ms": 0.5,
                    "compute_ms": (INTERCEPT + PER_SAMPLE[r] * b) if b else 0.0,
                    "sync_ms": 1.0,
                    "ts": 1.7e9 + self.iteration,
                }
                for r, b in enumerate(plan["batch_sizes"])
            ]
            r = self.api.client.post(
                f"/api/v1/jobs/{self.job}/telemetry",
                json={"records": records},
                headers=self.api.headers(str(self.host["_token"])),
            )
            assert r.status_code == 200, r.text
            self.iteration += 1
            with transaction(self.api.client.app.state.context.sessions) as s:  # type: ignore[attr-defined]
                control_loop.sweep(s, self.state, watch=False)


def test_minmax_explores_then_converges_to_the_optimum(api: Api) -> None:
    sim = Sim(api)
    sim.run(40)
    history = api.client.get(f"/api/v1/jobs/{sim.job}/plans", headers=api.headers()).json()[
        "items"
    ][::-1]
    assert [p["source"] for p in history][:3] == ["initial", "automatic", "automatic"]
    assert "exploring" in history[1]["reason"]
    # Continuous optimum: (T - 5) * (1 + 1 + 1/2 + 1/4) = 256 -> T = 98.1 ms; the integer plan
    # is within one sample of the slowest worker of it.
    final = sim.plan()
    assert sum(final["batch_sizes"]) == B
    times = [INTERCEPT + s * b for s, b in zip(PER_SAMPLE, final["batch_sizes"], strict=True)]
    assert max(times) <= 98.1 + 4.0
    assert final["predicted_ms"] is not None and abs(final["predicted_ms"] - max(times)) < 0.5
    # It settles: no plan flapping once optimal.
    versions = len(history)
    sim.run(30)
    assert (
        len(api.client.get(f"/api/v1/jobs/{sim.job}/plans", headers=api.headers()).json()["items"])
        == versions
    )
    models = api.client.get(f"/api/v1/jobs/{sim.job}/models", headers=api.headers()).json()["items"]
    assert [m["identifiable"] for m in models] == [True] * 4
    for m, s in zip(models, PER_SAMPLE, strict=True):
        assert abs(m["per_sample_ms"] - s) < 0.05 and abs(m["intercept_ms"] - INTERCEPT) < 1.0


def test_equal_policy_and_frozen_jobs_are_never_replanned(api: Api) -> None:
    sim = Sim(api, policy={"name": "equal"})
    sim.run(20)
    assert sim.plan()["version"] == 1
    other = Sim.__new__(Sim)
    other.api, other.host, other.iteration, other.state = api, sim.host, 0, control_loop.LoopState()
    api.client.post(f"/api/v1/jobs/{sim.job}/cancel", headers=api.headers())
    other.job = int(api.submit(workers=4, global_batch=B, policy=_policy())["id"])  # type: ignore[call-overload]
    r = api.client.post(
        f"/api/v1/jobs/{other.job}/overrides",
        json={"kind": "freeze", "reason": "hands off"},
        headers=api.headers(),
    )
    assert r.status_code == 201
    other.run(20)
    assert other.plan()["version"] == 1


def _override(api: Api, job: int, **body: Any) -> Any:
    return api.client.post(
        f"/api/v1/jobs/{job}/overrides",
        json={"reason": "test", **body},
        headers=api.headers(api.token(Role.OPERATOR, name="ops")),
    )


def test_pin_exclude_readmit_and_rebalance_now(api: Api) -> None:
    sim = Sim(api)
    sim.run(25)
    before = sim.plan()
    # Preview first: nothing changes.
    preview = _override(api, sim.job, kind="pin", rank=3, batch_size=40, preview=True).json()
    assert preview["applied"] is False and preview["plan"]["batch_sizes"][3] == 40
    assert preview["plan"]["predicted_ms"] > preview["current_predicted_ms"]
    assert sim.plan()["version"] == before["version"]
    # Pin: rank 3 keeps 40, the others are solved.
    pinned = _override(api, sim.job, kind="pin", rank=3, batch_size=40).json()
    assert pinned["plan"]["batch_sizes"][3] == 40 and sum(pinned["plan"]["batch_sizes"]) == B
    sim.run(30)  # the automatic loop keeps the pin
    assert sim.plan()["batch_sizes"][3] == 40
    # Exclude rank 0: it gets nothing, also in later automatic plans.
    excluded = _override(api, sim.job, kind="exclude", rank=0).json()
    assert excluded["plan"]["batch_sizes"][0] == 0
    sim.run(30)
    plan = sim.plan()
    assert (
        plan["batch_sizes"][0] == 0
        and plan["batch_sizes"][3] == 40
        and sum(plan["batch_sizes"]) == B
    )
    # Readmit both; rebalance now brings back the unconstrained optimum.
    _override(api, sim.job, kind="readmit", rank=0)
    _override(api, sim.job, kind="readmit", rank=3)
    now = _override(api, sim.job, kind="rebalance_now").json()
    assert now["applied"]
    assert sim.plan()["batch_sizes"][0] > 0 and sim.plan()["batch_sizes"][3] != 40
    audit = api.client.get(f"/api/v1/audit?target=job:{sim.job}", headers=api.headers()).json()[
        "items"
    ]
    actions = [a["action"] for a in audit if a["actor"] == "ops"]
    assert actions[::-1] == [
        "override.pin",
        "override.exclude",
        "override.readmit",
        "override.readmit",
        "override.rebalance_now",
    ]


def test_impossible_overrides_are_422(api: Api) -> None:
    sim = Sim(api)
    for body, field in (
        ({"kind": "pin", "rank": 9, "batch_size": 10}, "rank"),
        ({"kind": "pin", "rank": 0, "batch_size": B + 1}, "batch_size"),
        ({"kind": "pin", "rank": 0}, "batch_size"),
        ({"kind": "readmit", "rank": 1}, "rank"),
    ):
        r = _override(api, sim.job, **body)
        assert r.status_code == 422, body
        assert r.json()["field"] == field, r.json()
    for rank in range(3):
        assert _override(api, sim.job, kind="exclude", rank=rank).status_code == 201
    r = _override(api, sim.job, kind="exclude", rank=3)
    assert r.status_code == 422 and "every worker" in r.json()["detail"]


# A post: (iterations it adds, per rank the batch size, or 0 for a rank out of the group),
# and whether it also re-sends an iteration a rank reported before (a late row).
_POSTS = st.lists(
    st.tuples(
        st.integers(1, 6),
        st.lists(st.integers(0, 40), min_size=3, max_size=3),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(posts=_POSTS, window=st.integers(3, 12))
def test_a_kept_fit_window_reads_what_a_whole_read_does(
    api: Api, posts: list[tuple[int, list[int], bool]], window: int
) -> None:
    """The control loop keeps each job's fit window, fed the rows added since its last read
    (``NewRows``); after every post it holds the same observations, in the same order, as the
    window read whole (old iterations leave it, rows read again on PostgreSQL count once), and
    fits of it are the whole window's."""
    if not api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"]:
        api.register("fw", devices=3)
    job_id = int(api.submit(workers=3, global_batch=60)["id"])  # type: ignore[call-overload]
    try:
        _kept_against_whole(api, job_id, posts, window)
    finally:  # its devices for the next example's job
        api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers())


def _kept_against_whole(
    api: Api, job_id: int, posts: list[tuple[int, list[int], bool]], window: int
) -> None:
    token = api.token(Role.AGENT, host="fw")
    kept, reader = rebalancer.FitWindow(), rebalancer.NewRows()
    context = api.client.app.state.context  # type: ignore[attr-defined]
    iteration = 0
    for adds, batches, late in posts:
        records = [
            {
                "rank": r,
                "iteration": it,
                "plan_version": 1,
                "batch_size": b,
                "data_ms": 0.5,
                "compute_ms": 3.0 + (r + 1) * b + it % 3 if b else 0.0,
                "sync_ms": 1.0,
                "ts": 1.7e9 + it,
            }
            for it in range(iteration, iteration + adds)
            for r, b in enumerate(batches)
        ]
        if late and iteration:
            records.append({**records[0], "rank": 0, "iteration": iteration - 1})
        r = api.client.post(
            f"/api/v1/jobs/{job_id}/telemetry",
            json={"records": records},
            headers=api.headers(token),
        )
        assert r.status_code == 200, r.text
        iteration += adds
        with transaction(context.sessions) as s:
            job = s.get(Job, job_id)
            assert job is not None
            kept.add(s, job, reader.read(s, job), window)
            incremental = kept.observations()
            whole = rebalancer.observed(s, job, window)
            assert rebalancer.fits(s, job, kept=kept) == rebalancer.fits(s, job, window=window)
        assert incremental == whole
        assert all(o.iteration > iteration - 1 - window for obs in whole.values() for o in obs)
