"""Server settings: one pydantic-settings class, read from ``EVENFLOW_*`` environment variables.

Settings are a value passed to ``create_app``; nothing reads the environment at import time.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EVENFLOW_", extra="ignore")

    database_url: str = "sqlite:///./evenflow.db"
    """SQLAlchemy URL. SQLite (WAL mode) by default; ``postgresql+psycopg://...`` at scale."""

    admin_token: SecretStr | None = None
    """Bootstrap admin token. When unset and no admin exists yet, one is generated and printed."""

    agent_tokens: SecretStr | None = None
    """One token per agent host, as ``host=token`` pairs separated by commas (``agent-1=...,
    agent-2=...``): each becomes an agent token bound to that host name (what
    ``docker-compose.yml`` gives every agent service, each from its own secret). A token that
    changes here replaces the one set before for that host. Never the admin token."""

    context_max_bytes: int = Field(default=64 * 2**20, ge=1024, le=2**34)
    """The largest code archive a job may ship (``POST /api/v1/contexts``); past it the upload
    is refused with 413 naming the limit."""

    artifact_max_bytes: int = Field(default=512 * 2**20, ge=1024, le=2**36)
    """The most bytes of a job's artifacts the server keeps copies of (what its ranks left on
    their hosts' own disks: the final model, files under ``ctx.output_dir``); past it an upload
    is refused with 413 and the artifact stays listed where it is."""

    host_lost_after_s: float = Field(default=30.0, gt=0)
    """A host that has not sent a heartbeat for this long is marked lost: counted from its last
    heartbeat, or from when this database's controller became active if that is later (while no
    controller ran, no server may have been there to hear it)."""

    host_loss_pause_share: float = Field(default=0.5, gt=0, le=1)
    """When more than this share of the active hosts, and at least
    ``host_loss_pause_min_hosts`` of them, are silent at once, the reaper marks none of them
    lost and says so in the log and the audit log, until the share falls back (as Kubernetes'
    node controller stops evicting in a zone whose nodes all went unready). Half a fleet
    falling silent together is far likelier the control plane's own trouble (a server behind,
    a network partition on its side) than half the cluster dying; restarting every job would
    turn it into an outage. 1 turns the guard off."""

    host_loss_pause_min_hosts: int = Field(default=3, ge=1)
    """The fewest silent hosts that can pause the reaper (``host_loss_pause_share``): a cluster
    of one or two hosts that loses them is not taken for the server's fault."""

    heartbeat_answer_ttl_s: float = Field(default=600.0, ge=0)
    """A heartbeat that repeats the host's last one is answered from memory while nothing its
    answer depends on has changed, and for at most this long (``server.scale.host_answers``): a
    backstop should a change be missed anyway (a publisher that failed to notify and died
    before it could say so, ``server.notify.LOST``; a bug). Every expiry costs a heartbeat worked
    out in the database, so a short TTL adds to the database's load at fleet scale
    (``evenflow_heartbeat_database_reasons_total`` counts them;
    ``docs/decisions/0003-heartbeats-answered-from-memory.md`` has the figures). 0 works out
    every answer in the database."""

    reaper_interval_s: float = Field(default=5.0, gt=0)
    """How often the server looks for lost hosts."""

    rebalance_interval_s: float = Field(default=0.5, gt=0)
    """How often running jobs are checked for a due re-plan."""

    queue_hold: bool = True
    """The first job in the queue that is short of free devices keeps the free ones it can use
    as others free up, and jobs after it start only on the rest (``server.services.scheduler``):
    a big job starts once enough devices have ended their jobs. Off: any job that fits starts at
    once, and a big job can wait behind a stream of small ones indefinitely."""

    controller_report_s: float = Field(default=60.0, gt=0)
    """How often the controller logs a summary of its round times."""

    controller_nice: int = Field(default=10, ge=0, le=19)
    """How much lower the controller process's CPU priority is than the server's (``nice``),
    for ``python -m server.controller``, which ``evenflow server`` runs
    (``server.serve.ControllerProcess``; the solver it runs for placement inherits it). Its
    rounds are background work that can wait a moment; the fleet's heartbeats and telemetry
    are answers that hosts wait on. On a control-plane machine whose cores are all busy, at the
    same nice the rounds take their share from the API and PostgreSQL whenever a burst of job
    starts and ends comes, and every request waits for CPU. Its rounds are slower then, and
    detection can be too (``docs/decisions/0006-controller-process-niced.md`` has the
    figures). 0: the server's priority."""

    controller_cores: float = Field(default=0.0, ge=0)
    """How much of a core the controller's rounds may take, averaged over a round: a job's
    sweep waits (``server.workqueue.CpuPace``) until the CPU the sweeps before it took is
    paid back at this rate. Urgent work is never held (a job poked for a straggler, or hot:
    ``server.workqueue.HOT_S``); its CPU still counts. At fleet scale every job has new
    telemetry every round and rounds run back to back, so the controller takes whatever the
    machine leaves it, and the more often it sweeps a job the more each row costs (measured in
    ``docs/decisions/0006-controller-process-niced.md``). For a small
    control-plane machine shared with PostgreSQL; on one with cores to spare a cap only makes
    rounds longer, and ``controller_nice`` already lets the API and the database go first when
    the cores are busy. 0 (the default): not paced."""

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

    db_pool_size: int = Field(default=24, ge=1, le=512)
    """Connections kept open per process; up to twice as many more open under load, each
    opened for one use and closed after it. Keep it above ``db_concurrency`` by the API's own
    users of connections: the telemetry writer, the token checks' thread, liveness flushes and
    the plan reads' thread (``cache.PLAN_REFRESH_AFTER_S``), four in all. With no more than the
    slots, the overflow connections open and close all the time under load, each a new backend
    process that warms its caches on its first statements."""

    db_concurrency: int = Field(default=16, ge=1, le=32)
    """Requests doing database work at once per API process (``AppContext.db_slots``); the
    others wait without holding a worker thread or a connection. At most 32: it must stay
    below the worker threads (40) and the pool's connections (``3 * db_pool_size``)."""

    fast_paths: bool = True
    """Answer heartbeats and telemetry posts by the fleet's fast paths (``server.scale``:
    steady heartbeats from memory, group commits, the writer thread). Off, each is worked out
    and committed on its own (the plain path, their specification): for a small cluster, or to
    rule the fast paths out of a problem."""

    heartbeat_group_size: int = Field(default=32, ge=1, le=1024)
    """Heartbeats worked out in the database together at most, in one transaction
    (``server.scale.heartbeat_groups``): those that queued while the groups before them ran.
    1: each heartbeat in a transaction of its own."""

    heartbeat_groups: int = Field(default=4, ge=1, le=32)
    """Groups of heartbeats worked out at once per API process, each in a database slot (at
    most ``db_concurrency``)."""

    opentelemetry: bool = False
    """FastAPI's own OpenTelemetry spans, metrics and logs of each request, for a process whose
    OpenTelemetry SDK is configured (``opentelemetry-instrument``). Off, FastAPI does not even
    ask: asking on every request whether a provider is set (three reads of the environment) is
    a steady cost at a fleet's request rate; Evenflow's own metrics are at ``/metrics``."""

    allowed_origins: Annotated[tuple[str, ...], NoDecode] = ()
    """Origins besides the server's own (scheme, host and port as a request sees them) from
    which a browser session may write, comma-separated (``https://evenflow.example.com``):
    the public origin of a reverse proxy that rewrites the scheme or host
    (``server.api.gate``)."""

    auth_failures_max: int = Field(default=20, ge=1)
    """Bad credentials one client address may send per ``auth_failures_window_s`` before
    further bad ones get 429 (valid ones from that address still work)."""

    auth_failures_window_s: float = Field(default=60.0, ge=1)

    max_streams_per_token: int = Field(default=8, ge=1, le=10_000)
    """Live streams (``GET /jobs/{id}/stream``) one token may hold open at once, per server
    process; one more gets 429."""

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins(cls, v: object) -> object:
        items = [o.strip() for o in v.split(",") if o.strip()] if isinstance(v, str) else v
        if not isinstance(items, list | tuple):
            return v
        for origin in items:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/"):
                raise ValueError(
                    f"EVENFLOW_ALLOWED_ORIGINS: {origin!r} is not an origin like "
                    "'https://host[:port]'"
                )
        return tuple(items)

    @field_validator("agent_tokens")
    @classmethod
    def _pairs(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            parse_agent_tokens(v.get_secret_value())
        return v

    @model_validator(mode="after")
    def _agents_are_not_admins(self) -> Settings:
        admin = self.admin_token.get_secret_value() if self.admin_token else None
        if admin is not None and admin in self.agent_token_pairs().values():
            raise ValueError("EVENFLOW_AGENT_TOKENS must not contain the admin token")
        return self

    def agent_token_pairs(self) -> dict[str, str]:
        """``agent_tokens`` as {host name: token}."""
        if self.agent_tokens is None:
            return {}
        return parse_agent_tokens(self.agent_tokens.get_secret_value())

    @field_validator("admin_token")
    @classmethod
    def _strong_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("EVENFLOW_ADMIN_TOKEN must be at least 16 characters")
        return v


_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def parse_agent_tokens(text: str) -> dict[str, str]:
    """``host=token,host=token`` as a dict; raises ``ValueError`` naming the bad entry (by host
    or position, never showing a token)."""
    pairs: dict[str, str] = {}
    for i, item in enumerate(p.strip() for p in text.split(",")):
        if not item:
            continue
        host, sep, token = item.partition("=")
        host, token = host.strip(), token.strip()
        if not sep or not _HOST.match(host):
            raise ValueError(f"EVENFLOW_AGENT_TOKENS entry {i + 1} is not 'host=token'")
        if len(token) < 16:
            raise ValueError(f"EVENFLOW_AGENT_TOKENS: the token of {host} is under 16 characters")
        if host in pairs:
            raise ValueError(f"EVENFLOW_AGENT_TOKENS names {host} twice")
        if token in pairs.values():
            raise ValueError(f"EVENFLOW_AGENT_TOKENS: {host} shares its token with another host")
        pairs[host] = token
    return pairs
