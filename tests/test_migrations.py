"""Alembic owns the schema: the models and the migrations agree, and a round trip works."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect

from server.db import alembic_config, make_engine, migrate


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
