"""Alembic owns the schema: the models and the migrations agree, and a round trip works."""

from __future__ import annotations

from typing import Any

from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from server.app import create_app
from server.db import alembic_config, make_engine, migrate
from tests.api.test_telemetry import _rec
from tests.harness import driven, make_settings


def test_models_and_migrations_agree(db_url: str) -> None:
    engine = make_engine(db_url)
    migrate(engine)
    command.check(alembic_config(engine))  # raises if autogenerate would emit any operation
    engine.dispose()


def test_downgrade_and_upgrade_round_trip(db_url: str) -> None:
    engine = make_engine(db_url)
    migrate(engine)
    cfg = alembic_config(engine)
    command.downgrade(cfg, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    command.upgrade(cfg, "head")
    assert {"jobs", "plans", "iteration_telemetry", "api_tokens"} <= set(
        inspect(engine).get_table_names()
    )
    engine.dispose()


def test_sqlite_runs_in_wal_mode(tmp_path: object) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/w.db")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def _post(client: TestClient, job: int, iterations: range) -> dict[str, Any]:
    records = [_rec(rank, it) for it in iterations for rank in (0, 1)]
    r = client.post(
        f"/api/v1/jobs/{job}/telemetry",
        json={"records": records},
        headers=driven(client).headers(),
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _telemetry_key(db_url: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The unique keys and the indexes of ``iteration_telemetry``, as column tuples."""
    engine = make_engine(db_url)
    found = inspect(engine)
    unique = [tuple(u["column_names"]) for u in found.get_unique_constraints("iteration_telemetry")]
    indexes = [
        tuple(i["column_names"])  # type: ignore[arg-type]
        for i in found.get_indexes("iteration_telemetry")
        if not i.get("unique")
    ]
    engine.dispose()
    return unique, indexes


def test_the_telemetry_keys_new_order_keeps_rows_and_dedupes_both_ways(db_url: str) -> None:
    """Migration 0028 (the unique key in (job_id, iteration, rank) order, no (job_id,
    iteration) index) and back, over stored rows: none lost, and a retried post stores nothing
    again on either side."""
    with TestClient(create_app(make_settings(db_url))) as client:
        api = driven(client)
        api.register("h", devices=2)
        job = int(api.submit(workers=2, global_batch=32)["id"])  # type: ignore[call-overload]
        assert _post(client, job, range(10)) == {"accepted": 20, "duplicates": 0}
    assert _telemetry_key(db_url) == (
        [("job_id", "iteration", "rank")],
        [("job_id", "id")],
    )
    engine = make_engine(db_url)
    command.downgrade(alembic_config(engine), "0027_departures")
    engine.dispose()
    unique, indexes = _telemetry_key(db_url)
    assert unique == [("job_id", "rank", "iteration")]
    assert sorted(indexes) == [("job_id", "id"), ("job_id", "iteration")]
    with TestClient(create_app(make_settings(db_url, run_migrations=False))) as client:
        assert _post(client, job, range(5, 15)) == {"accepted": 10, "duplicates": 10}
    with TestClient(create_app(make_settings(db_url))) as client:  # upgrades to head again
        assert _post(client, job, range(12, 20)) == {"accepted": 10, "duplicates": 6}
        rows = client.get(
            f"/api/v1/jobs/{job}/telemetry?limit=1000", headers=driven(client).headers()
        ).json()["items"]
    assert [(r["iteration"], r["rank"]) for r in rows] == [
        (it, rank) for it in range(20) for rank in (0, 1)
    ]


def test_downgrading_keeps_the_rows_of_the_tables_that_stay(db_url: str) -> None:
    """A downgrade that drops a column of ``jobs`` or ``workers`` must not take their rows (or
    those that hang off them) with it. On SQLite a batch copies the table and drops the old
    one, and dropping ``jobs`` deleted every job's workers, plans and telemetry (their keys
    cascade): a downgrade by one revision left the jobs with nothing of theirs."""
    with TestClient(create_app(make_settings(db_url))) as client:
        api = driven(client)
        api.register("h", devices=2)
        job = int(api.submit(workers=2, global_batch=32)["id"])  # type: ignore[call-overload]
        _post(client, job, range(3))
    engine = make_engine(db_url)
    counts = "SELECT " + ", ".join(
        f"(SELECT count(*) FROM {table})"
        for table in ("jobs", "workers", "plans", "iteration_telemetry")
    )
    with engine.connect() as c:
        before = tuple(c.exec_driver_sql(counts).one())
    assert before == (1, 2, 1, 6)
    command.downgrade(alembic_config(engine), "0001")
    with engine.connect() as c:
        assert tuple(c.exec_driver_sql(counts).one()) == before
    engine.dispose()


def test_the_jobs_settled_before_the_upgrade_are_marked_settled(db_url: str) -> None:
    """Migration 0029 marks the live jobs the rebalancer had already planned on identified
    models as settled (else the controller after the upgrade would replace their plan as one
    made on guesses); a job still exploring, or one not live, is left unmarked."""
    with TestClient(create_app(make_settings(db_url))) as client:
        api = driven(client)
        api.register("h", devices=6)
        jobs = [int(api.submit(workers=2, global_batch=32)["id"]) for _ in range(3)]  # type: ignore[call-overload]
    engine = make_engine(db_url)
    command.downgrade(alembic_config(engine), "0028_telemetry_key_order")
    reasons = {
        jobs[0]: "minmax: predicted 9.0 ms per iteration, 10.0% less than 10.0 ms",
        jobs[1]: "exploring: rank(s) 0, 1 seen at one batch size; planned on guesses",
        jobs[2]: "minmax: predicted 9.0 ms per iteration, 10.0% less than 10.0 ms",
    }
    with engine.begin() as c:
        c.exec_driver_sql("UPDATE jobs SET status = 'running'")
        c.exec_driver_sql(f"UPDATE jobs SET status = 'succeeded' WHERE id = {jobs[2]}")
        for job, reason in reasons.items():
            c.execute(
                text(
                    "INSERT INTO plans (job_id, version, batch_sizes, excluded, global_batch, "
                    "source, reason, created_at) VALUES (:job, 2, '[20, 12]', '[]', 32, "
                    "'automatic', :reason, CURRENT_TIMESTAMP)"
                ),
                {"job": job, "reason": reason},
            )
    command.upgrade(alembic_config(engine), "head")
    with engine.connect() as c:
        marks = dict(c.execute(text("SELECT id, settled_through FROM jobs")).all())
    engine.dispose()
    assert marks == {jobs[0]: 0, jobs[1]: None, jobs[2]: None}
