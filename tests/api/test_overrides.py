"""Manual overrides: validated, previewed, recorded in the audit log, visible as a plan."""

from __future__ import annotations

from contract.enums import Role
from tests.harness import Api


def _live_job(api: Api) -> int:
    api.register("h", devices=3)
    return int(api.submit(workers=3, global_batch=60)["id"])  # type: ignore[call-overload]


def test_set_batches_makes_a_manual_plan_and_an_audit_entry(api: Api) -> None:
    job = _live_job(api)
    op = api.token(Role.OPERATOR, name="alice")
    body = {
        "kind": "set_batches",
        "batch_sizes": [10, 20, 30],
        "reason": "rank 0 is on a busy node",
    }
    r = api.client.post(f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers(op))
    assert r.status_code == 201, r.text  # created
    assert r.json()["applied"] and r.json()["plan"]["version"] == 2
    plan = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()
    assert plan["batch_sizes"] == [10, 20, 30]
    assert plan["source"] == "manual" and plan["created_by"] == "alice"
    assert "busy node" in plan["reason"]
    audit = api.client.get(f"/api/v1/audit?target=job:{job}", headers=api.headers()).json()["items"]
    entry = next(a for a in audit if a["action"] == "override.set_batches")
    assert entry["actor"] == "alice" and entry["detail"]["reason"] == "rank 0 is on a busy node"
    listed = api.client.get(f"/api/v1/jobs/{job}/overrides", headers=api.headers()).json()["items"]
    assert [o["kind"] for o in listed] == ["set_batches"]


def test_preview_changes_nothing(api: Api) -> None:
    job = _live_job(api)
    body = {
        "kind": "set_batches",
        "batch_sizes": [30, 20, 10],
        "reason": "what if",
        "preview": True,
    }
    r = api.client.post(f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers())
    assert r.status_code == 200  # nothing created
    assert r.json()["applied"] is False and r.json()["plan"]["batch_sizes"] == [30, 20, 10]
    assert api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()["version"] == 1
    assert (
        api.client.get(f"/api/v1/jobs/{job}/overrides", headers=api.headers()).json()["items"] == []
    )


def test_invalid_override_is_422_and_keeps_the_plan(api: Api) -> None:
    job = _live_job(api)
    for sizes, msg in (
        ([10, 20, 31], "sums to 61"),
        ([10, 50], "2 entries"),
        ([-1, 31, 30], "greater than or equal to 0"),
    ):
        r = api.client.post(
            f"/api/v1/jobs/{job}/overrides",
            json={"kind": "set_batches", "batch_sizes": sizes, "reason": "x"},
            headers=api.headers(),
        )
        assert r.status_code == 422, sizes
        assert r.json()["field"].startswith("batch_sizes") and msg in r.json()["detail"]
    assert api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()[
        "batch_sizes"
    ] == [20, 20, 20]


def test_freeze_needs_operator_and_toggles(api: Api) -> None:
    job = _live_job(api)
    viewer = api.token(Role.VIEWER)
    body = {"kind": "freeze", "reason": "debugging"}
    assert (
        api.client.post(
            f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers(viewer)
        ).status_code
        == 403
    )
    assert (
        api.client.post(
            f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers()
        ).status_code
        == 201
    )
    assert api.client.get(f"/api/v1/jobs/{job}", headers=api.headers()).json()["frozen"] is True
    body = {"kind": "unfreeze", "reason": "done"}
    assert (
        api.client.post(
            f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers()
        ).status_code
        == 201
    )
    assert api.client.get(f"/api/v1/jobs/{job}", headers=api.headers()).json()["frozen"] is False
