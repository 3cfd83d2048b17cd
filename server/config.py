"""Server settings: one pydantic-settings class, read from ``EVENFLOW_*`` environment variables.

Settings are a value passed to ``create_app``; nothing reads the environment at import time.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EVENFLOW_", extra="ignore")

    database_url: str = "sqlite:///./evenflow.db"
    """SQLAlchemy URL. SQLite (WAL mode) by default; ``postgresql+psycopg://...`` at scale."""

    admin_token: SecretStr | None = None
    """Bootstrap admin token. When unset and no admin exists yet, one is generated and printed."""

    host_lost_after_s: float = Field(default=30.0, gt=0)
    """A host that has not sent a heartbeat for this long is marked lost."""

    reaper_interval_s: float = Field(default=5.0, gt=0)
    """How often the server looks for lost hosts."""

    rebalance_interval_s: float = Field(default=0.5, gt=0)
    """How often running jobs are checked for a due re-plan."""

    controller_report_s: float = Field(default=60.0, gt=0)
    """How often the controller logs a summary of its round times."""

    telemetry_keep_iterations: int = Field(default=20_000, ge=100)
    """Raw telemetry kept per job: its newest this many iterations. Older rows are rolled up
    into per-rank aggregates per bucket of iterations (``server.services.retention``)."""

    telemetry_keep_running_s: float = Field(default=3600.0, ge=0)
    """A running job also keeps every raw row of its last this many seconds."""

    retention_interval_s: float = Field(default=60.0, gt=0)
    """How often the controller rolls up telemetry older than the window."""

    controller: Literal["thread", "none"] = "thread"
    """Where this app's control loop runs (``server.controller``): ``thread``, in a thread of
    the app's process; ``none``, elsewhere (``evenflow server`` starts it as a process of its
    own, so it never competes with request handling for the GIL). Either way, at most one
    controller per database is active."""

    run_migrations: bool = True
    """Apply Alembic migrations on start."""

    db_pool_size: int = Field(default=16, ge=1, le=512)

    @field_validator("admin_token")
    @classmethod
    def _strong_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("EVENFLOW_ADMIN_TOKEN must be at least 16 characters")
        return v
