"""The controller's lost-host sweep (``Controller.reap``): which silence counts, the loss guard
that pauses it when most of the fleet falls silent at once, and its transaction against
heartbeats in flight."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text, update
from sqlalchemy.exc import DBAPIError

from server.context import AppContext, context_of
from server.controller import Controller
from server.db import transaction
from server.models import Host
from server.services import hosts as host_service
from tests.harness import Api


def _controller(api: Api, **settings: Any) -> tuple[Controller, AppContext]:
    context = context_of(api.client.app)  # type: ignore[arg-type]
    controller = Controller(
        context.settings.model_copy(update=settings),
        engine=context.engine,
        sessions=context.sessions,
        write_lock=context.write_lock,
    )
    controller.active_since = datetime.now(UTC) - timedelta(hours=1)
    return controller, context


def _fleet(api: Api, n: int) -> list[int]:
    return [int(api.register(f"h{i}", devices=1)["id"]) for i in range(n)]  # type: ignore[call-overload]


def _silence(context: AppContext, host_ids: list[int], seconds: float = 600) -> None:
    with transaction(context.sessions) as s:
        s.execute(
            update(Host)
            .where(Host.id.in_(host_ids))
            .values(last_heartbeat=datetime.now(UTC) - timedelta(seconds=seconds))
        )


def _statuses(api: Api) -> dict[str, str]:
    listed = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"]
    return {h["name"]: h["status"] for h in listed}


def _audit(api: Api, action: str) -> list[dict[str, Any]]:
    items = api.client.get("/api/v1/audit?limit=200", headers=api.headers()).json()["items"]
    return [a for a in items if a["action"] == action]


def test_silence_from_before_the_controller_became_active_does_not_count(api: Api) -> None:
    """After a control-plane outage every host looks silent; none is lost until it has been
    silent as long while a controller was there."""
    ids = _fleet(api, 2)
    controller, context = _controller(api)
    _silence(context, ids)
    controller.active_since = datetime.now(UTC) - timedelta(seconds=5)
    assert controller.reap().lost == [] and set(_statuses(api).values()) == {"active"}
    controller.active_since = datetime.now(UTC) - timedelta(seconds=31)
    assert sorted(h.name for h in controller.reap().lost) == ["h0", "h1"]
    assert set(_statuses(api).values()) == {"lost"}


def test_most_of_the_fleet_silent_at_once_pauses_the_reaper_until_it_speaks_again(
    api: Api,
) -> None:
    ids = _fleet(api, 5)
    job = api.submit(workers=1, max_restarts=3)
    controller, context = _controller(api)
    _silence(context, ids[:3])  # 3 of 5: more than half
    sweep = controller.reap()
    assert sweep.paused and (sweep.silent, sweep.active) == (3, 5) and sweep.lost == []
    assert set(_statuses(api).values()) == {"active"}
    assert controller.reap().paused  # still: audited once for the episode
    paused = _audit(api, "hosts.loss_paused")
    assert len(paused) == 1 and paused[0]["detail"] == {"silent": 3, "active": 5}
    assert api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()["attempt"] == 0

    _silence(context, ids[:2], seconds=0)  # two come back: 1 of 5 silent
    sweep = controller.reap()
    assert not sweep.paused and [h.name for h in sweep.lost] == ["h2"]
    assert _statuses(api) == {
        "h0": "active",
        "h1": "active",
        "h2": "lost",
        "h3": "active",
        "h4": "active",
    }
    assert len(_audit(api, "hosts.loss_resumed")) == 1


def test_the_guard_needs_enough_silent_hosts_and_can_be_turned_off(api: Api) -> None:
    ids = _fleet(api, 2)
    controller, context = _controller(api)
    _silence(context, ids)  # both of a two-host cluster: the hosts' trouble, not the server's
    assert sorted(h.name for h in controller.reap().lost) == ["h0", "h1"]

    more = [int(api.register(f"g{i}", devices=1)["id"]) for i in range(4)]  # type: ignore[call-overload]
    _silence(context, more)
    off, _ = _controller(api, host_loss_pause_share=1.0)
    assert sorted(h.name for h in off.reap().lost) == ["g0", "g1", "g2", "g3"]


def test_a_sweep_the_database_aborts_for_another_transaction_runs_again(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _fleet(api, 1)
    controller, context = _controller(api)
    _silence(context, ids)
    real, calls = host_service.mark_lost, []

    class Deadlock(Exception):
        sqlstate = "40P01"

    def aborted_once(*args: Any, **kw: Any) -> host_service.LostSweep:
        calls.append(1)
        if len(calls) == 1:
            raise DBAPIError("UPDATE hosts ...", {}, Deadlock("deadlock detected"))
        return real(*args, **kw)

    monkeypatch.setattr(host_service, "mark_lost", aborted_once)
    assert [h.name for h in controller.reap().lost] == ["h0"] and len(calls) == 2

    class Broken(Exception):
        sqlstate = "42P01"  # not another's fault: raised at once

    calls.clear()
    monkeypatch.setattr(
        host_service,
        "mark_lost",
        lambda *a, **k: (_ for _ in ()).throw(DBAPIError("x", {}, Broken("no table"))),
    )
    with pytest.raises(DBAPIError):
        controller.reap()


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_host_whose_heartbeat_is_being_written_is_skipped_not_waited_for(api: Api) -> None:
    ids = _fleet(api, 2)
    controller, context = _controller(api)
    _silence(context, ids)
    holding, release = threading.Event(), threading.Event()

    def heartbeat_in_flight() -> None:
        with context.engine.begin() as conn:
            conn.execute(text("UPDATE hosts SET address = address WHERE id = :id"), {"id": ids[0]})
            holding.set()
            assert release.wait(10)

    writer = threading.Thread(target=heartbeat_in_flight)
    writer.start()
    try:
        assert holding.wait(10)
        done: list[host_service.LostSweep] = []
        sweeper = threading.Thread(target=lambda: done.append(controller.reap()))
        sweeper.start()
        sweeper.join(5)
        assert done, "the sweep waited for the heartbeat's lock"
        assert [h.name for h in done[0].lost] == ["h1"]
    finally:
        release.set()
        writer.join()
    assert [h.name for h in controller.reap().lost] == ["h0"]  # still silent once it is free
