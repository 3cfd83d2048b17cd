"""The controller: one per database (its lock), writers serialised across processes, and
`evenflow server` running it in a process of its own that re-plans jobs."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, delete, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from contract.base import PROTOCOL_VERSION
from evenflow.local_cluster import server_process
from server import controller as controller_module
from server.controller import STANDBY_POLL_S, Controller, Fence, FencedOut
from server.db import make_engine, migrate, session_factory, transaction
from server.locks import ControllerLock, WriterLock, writer_lock_for
from server.models import AuditEntry, ControllerFence
from server.services.audit import record
from tests.harness import ADMIN_TOKEN, ROOT, make_settings, until, wait_placed


def test_one_controller_lock_per_database(db_url: str) -> None:
    a, b = make_engine(db_url), make_engine(db_url)
    first, second = ControllerLock(a), ControllerLock(b)
    try:
        assert first.try_acquire()
        assert not second.try_acquire()  # a standby
        first.check()
        first.release()
        assert second.try_acquire()  # takes over
    finally:
        first.release()
        second.release()
        a.dispose()
        b.dispose()


def test_writer_lock_excludes_other_processes(tmp_path: Path) -> None:
    lock = writer_lock_for(f"sqlite:///{tmp_path / 'w.db'}")
    assert isinstance(lock, WriterLock) and lock.path == tmp_path / "w.db.writer.lock"
    probe = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n"
        "    sys.exit(3)\n"
    )
    with lock:
        held = subprocess.run([sys.executable, "-c", probe, str(lock.path)], check=False)
    free = subprocess.run([sys.executable, "-c", probe, str(lock.path)], check=False)
    assert (held.returncode, free.returncode) == (3, 0)
    fd = os.open(lock.path, os.O_RDWR)
    try:  # and released: this process can take it too
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_postgres_needs_no_writer_lock() -> None:
    assert writer_lock_for("postgresql+psycopg://u@h/db") is None


@pytest.mark.timeout(120)
def test_evenflow_server_runs_the_controller_in_its_own_process(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EVENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'cp.db'}",
        "EVENFLOW_ADMIN_TOKEN": ADMIN_TOKEN,
        "EVENFLOW_REBALANCE_INTERVAL_S": "0.1",
        "EVENFLOW_CONTROLLER_NICE": "3",
    }
    h = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with server_process(env) as (root, proc):
        base = root + "/api/v1"
        # The controller is a child process holding the controller lock.
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "server.controller"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert len(children) == 1
        _until_locked(ControllerLock(make_engine(env["EVENFLOW_DATABASE_URL"])))
        # Its rounds give way to the API's requests: it runs 3 nicer than the server.
        server_nice = _nice(proc.pid)
        assert _nice(int(children[0])) == min(19, server_nice + 3)
        assert server_nice == os.getpriority(os.PRIO_PROCESS, 0)
        # A job whose first plans explore: the controller (not the API process) makes them,
        # and a long-poll on the API process hears of each.
        devices = [{"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(2)]
        host = {
            "protocol_version": PROTOCOL_VERSION,
            "name": "h",
            "address": "127.0.0.1",
            "devices": devices,
        }
        httpx.post(base + "/hosts/register", headers=h, json=host).raise_for_status()
        spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 64, "workers": 2}
        job = httpx.post(base + "/jobs", headers=h, json={**spec, "iterations": 1000}).json()["id"]
        with httpx.Client(headers=h) as http:  # the controller places it on its own thread
            wait_placed(http, f"{base}/jobs/{job}", job)
        records = [
            {"rank": r, "iteration": i, "plan_version": 1, "batch_size": 32, "data_ms": 1.0,
             "compute_ms": 10.0 * (r + 1), "sync_ms": 1.0, "ts": 1.7e9 + i}
            for i in range(1, 40) for r in range(2)
        ]  # fmt: skip
        httpx.post(
            f"{base}/jobs/{job}/telemetry", headers=h, json={"records": records}
        ).raise_for_status()
        r = httpx.get(
            f"{base}/jobs/{job}/plan",
            params={"known_version": 1, "wait_s": 20},
            headers=h,
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["version"] >= 2
        assert r.json()["source"] == "automatic"
    # Stopping the server stops its controller: the lock is free again.
    lock = ControllerLock(make_engine(env["EVENFLOW_DATABASE_URL"]))
    assert lock.try_acquire()
    lock.release()


def _nice(pid: int) -> int:
    """A process's nice value (``/proc/PID/stat``'s 19th field)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


def _until_locked(probe: ControllerLock) -> None:
    """Until someone else holds the controller lock (the controller process takes a moment)."""
    deadline = time.monotonic() + 30
    while probe.try_acquire():
        probe.release()
        assert time.monotonic() < deadline, "nobody took the controller lock"
        time.sleep(0.1)


def test_a_poke_runs_the_next_round_now(tmp_path: Path) -> None:
    """Urgent telemetry must not wait out the interval: with an hour between rounds, only the
    poke (directly, or over the wake bus from an API process) can run one."""
    import threading

    from server.config import Settings
    from server.controller import Controller, _listen_for_pokes
    from server.db import migrate, session_factory
    from server.notify import PlanBus

    url = f"sqlite:///{tmp_path / 'c.db'}"
    engine = make_engine(url)
    migrate(engine)
    settings = Settings(database_url=url, rebalance_interval_s=3600)
    controller = Controller(settings, engine=engine, sessions=session_factory(engine))
    stop = threading.Event()
    loop = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    wake = PlanBus.for_database(url, "wake")
    listener = threading.Thread(target=_listen_for_pokes, args=(wake, controller, stop))
    try:
        loop.start()
        listener.start()
        time.sleep(0.3)
        assert controller.rounds == 0
        controller.poke()
        _wait_for(lambda: controller.rounds == 1)
        _wait_for(lambda: wake.directory is not None and any(wake.directory.glob("*.sock")))
        api = PlanBus.for_database(url, "wake")
        api.publish([7])  # what an API process does with an urgent telemetry batch
        api.close()
        _wait_for(lambda: controller.rounds == 2)
    finally:
        stop.set()
        loop.join(5)
        listener.join(5)
        wake.close()
        engine.dispose()
    assert not loop.is_alive() and not listener.is_alive()


def _wait_for(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def _records(iterations: range) -> list[dict[str, object]]:
    return [
        {"rank": r, "iteration": i, "plan_version": 1, "batch_size": 32, "data_ms": 1.0,
         "compute_ms": 10.0, "sync_ms": 1.0, "ts": 1.7e9 + i}
        for i in iterations for r in range(2)
    ]  # fmt: skip


@pytest.mark.timeout(180)
def test_api_and_controller_killed_with_sigkill_lose_no_telemetry(tmp_path: Path) -> None:
    """Both processes of `evenflow server` die with SIGKILL (no shutdown at all): every batch
    the API acknowledged is there after a restart, a retried batch is not stored twice, and a
    new controller takes the lock."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EVENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'cp.db'}",
        "EVENFLOW_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    h = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    devices = [{"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(2)]
    host = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "h",
        "address": "127.0.0.1",
        "devices": devices,
    }
    spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 64, "workers": 2}
    with server_process(env) as (root, proc):
        base = root + "/api/v1"
        httpx.post(base + "/hosts/register", headers=h, json=host).raise_for_status()
        job = httpx.post(base + "/jobs", headers=h, json={**spec, "iterations": 1000}).json()["id"]
        with httpx.Client(headers=h) as http:
            wait_placed(http, f"{base}/jobs/{job}", job)
        for start in range(0, 50, 10):
            r = httpx.post(
                f"{base}/jobs/{job}/telemetry",
                headers=h,
                json={"records": _records(range(start, start + 10))},
            )
            assert r.json() == {"accepted": 20, "duplicates": 0}
        controller = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "server.controller"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert len(controller) == 1
        os.kill(int(controller[0]), signal.SIGKILL)
        proc.kill()
        proc.wait()
    with server_process(env) as (root, _):
        base = root + "/api/v1"
        rows = httpx.get(f"{base}/jobs/{job}/telemetry", headers=h, params={"limit": 1000})
        assert rows.json()["total"] == 100  # every acknowledged row
        retried = httpx.post(
            f"{base}/jobs/{job}/telemetry", headers=h, json={"records": _records(range(40, 50))}
        )
        assert retried.json() == {"accepted": 0, "duplicates": 20}
        more = httpx.post(
            f"{base}/jobs/{job}/telemetry", headers=h, json={"records": _records(range(50, 60))}
        )
        assert more.json() == {"accepted": 20, "duplicates": 0}
        _until_locked(ControllerLock(make_engine(env["EVENFLOW_DATABASE_URL"])))


def test_the_round_summary_says_what_rounds_and_placement_passes_took(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Every ``report_s`` the controller logs its rounds and the CPU that they and the
    placement passes (a thread of their own) took; the fleet bench reads the line back."""
    from bench.fleet import controller_rounds
    from server.controller import RoundStats

    stats = RoundStats(report_s=3600.0)
    stats.add_placement(0.25)
    stats.add_placement(0.5)
    stats.add(120.0, 40, 10, cpu_s=0.1)
    stats.add(80.0, 42, 12, cpu_s=0.2)
    stats.report_s = 0.0  # the next round reports
    with caplog.at_level("INFO", logger="evenflow.controller"):
        stats.add(100.0, 44, 14, cpu_s=0.3, paced_s=1.5)
    (line,) = [r.getMessage() for r in caplog.records if "controller rounds" in r.getMessage()]
    log = tmp_path / "server.log"
    log.write_text(f"2026-11-28 00:00:00,000 evenflow-controller INFO {line}\n")
    (window,) = controller_rounds(log)
    assert window["rounds"] == 3 and window["live_jobs"] == 44
    assert window["swept_per_round"] == 12.0 and window["p50_ms"] == 100.0
    assert window["rounds_cpu_s"] == 0.6
    assert window["placement_cpu_s"] == 0.8 and window["placement_passes"] == 2
    assert window["paced_s"] == 1.5  # the rounds' waits for their pace (``controller_cores``)
    stats.add(10.0, 1, 1, cpu_s=0.05)  # a fresh window: the counts start again
    assert stats._passes == 0 and stats._placement_cpu == 0.0


def _terminate_backend(engine: Engine, pid: int) -> None:
    with engine.connect() as c:
        c.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        c.commit()


def _audited(sessions: sessionmaker[Session], action: str) -> int:
    with transaction(sessions) as s:
        q = select(func.count()).select_from(AuditEntry).where(AuditEntry.action == action)
        return int(s.scalar(q) or 0)


@pytest.mark.timeout(60)
def test_a_controller_that_lost_its_lock_writes_nothing_once_another_took_over(
    pg_url: str,
) -> None:
    """Its lock's connection alone ended (an idle-session timeout, a pooler) while its process
    went on: a standby takes the lock, and the first controller's next write transaction stops
    before writing; the one already under way when the standby took the lock holds the
    standby's turn back until it ends, so the two never write at once."""
    settings = make_settings(pg_url)
    engines = [make_engine(pg_url) for _ in range(3)]
    a_sessions = session_factory(engines[0])
    a = Controller(settings, engine=engines[0], sessions=a_sessions)
    b = Controller(settings, engine=engines[1], sessions=session_factory(engines[1]))
    lock = ControllerLock(engines[0])
    stop = threading.Event()
    standby = threading.Thread(target=b.run, args=(stop,), daemon=True)
    try:
        assert lock.try_acquire()
        a._take_turn()
        assert a.fence is not None
        assert lock._conn is not None
        pid = int(lock._conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
        lock._conn.commit()
        with a._writing() as s:  # under way when the lock is lost
            _terminate_backend(engines[2], pid)
            standby.start()
            time.sleep(STANDBY_POLL_S + 1.0)  # b took the lock; its turn waits for this one
            assert b.fence is None
            record(s, "a", "test.in_turn", "x")
        until(lambda: b.fence is not None, timeout_s=15)
        assert b.fence is not None and b.fence.epoch == a.fence.epoch + 1
        with pytest.raises(FencedOut), a._writing() as s:
            record(s, "a", "test.after_turn", "x")
        with pytest.raises(FencedOut):
            a.place()
        assert _audited(a_sessions, "test.in_turn") == 1
        assert _audited(a_sessions, "test.after_turn") == 0
    finally:
        stop.set()
        if standby.is_alive():
            standby.join(15)
        lock.release()
        for engine in engines:
            engine.dispose()


@pytest.mark.timeout(60)
def test_a_controller_that_takes_its_lock_again_begins_a_new_turn(pg_url: str) -> None:
    """A new epoch, and no memory of its jobs from the turn before: another controller may
    have planned them in between, so it takes them up from the database, as one that takes
    over does."""
    engine, admin = make_engine(pg_url), make_engine(pg_url)
    a = Controller(
        make_settings(pg_url, rebalance_interval_s=0.1),
        engine=engine,
        sessions=session_factory(engine),
    )
    stop = threading.Event()
    runner = threading.Thread(target=a.run, args=(stop,), daemon=True)
    runner.start()
    try:
        until(lambda: a.fence is not None, timeout_s=15)
        assert a.fence is not None
        first, memory = a.fence.epoch, a.state
        with admin.connect() as c:
            pid = c.execute(
                text("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted")
            ).scalar_one()
        _terminate_backend(admin, int(pid))
        until(lambda: a.turns == 2 and a.fence is not None, timeout_s=15)
        assert a.fence is not None and a.fence.epoch == first + 1
        assert a.state is not memory
    finally:
        stop.set()
        runner.join(15)
        engine.dispose()
        admin.dispose()


@pytest.mark.parametrize("lost", [False, True])
def test_a_round_under_way_ends_the_turn_once_the_lock_is_lost(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, lost: bool
) -> None:
    """A round uses the lock's connection every ``LOCK_CHECK_S`` (a round may take a minute on
    a starved machine; the database or a pooler may end a connection idle that long) and ends
    the turn as soon as the lock is gone, not once every job has been swept."""
    monkeypatch.setattr(controller_module, "LOCK_CHECK_S", 0.0)
    engine, admin = make_engine(pg_url), make_engine(pg_url)
    a = Controller(make_settings(pg_url), engine=engine, sessions=session_factory(engine))
    lock = ControllerLock(engine)
    try:
        assert lock.try_acquire()
        a._lock = lock
        if lost:
            assert lock._conn is not None
            pid = int(lock._conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            lock._conn.commit()
            _terminate_backend(admin, pid)
            with pytest.raises(FencedOut, match="lock's connection broke"):
                a.sweep()
        else:
            a.sweep()
            assert a.rounds == 1
    finally:
        lock.release()
        engine.dispose()
        admin.dispose()


def test_a_turn_is_taken_even_once_the_fence_row_was_deleted(db_url: str) -> None:
    """Deleted by hand, the one row comes back with the next turn (the turns count from 1
    again) instead of every controller failing to start."""
    engine = make_engine(db_url)
    migrate(engine)
    sessions = session_factory(engine)
    try:
        with transaction(sessions) as s:
            s.execute(delete(ControllerFence))
        assert Fence.take(sessions, nullcontext()).epoch == 1
        assert Fence.take(sessions, nullcontext()).epoch == 2
    finally:
        engine.dispose()
