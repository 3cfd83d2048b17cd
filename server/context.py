"""The control plane's application state: one typed value per app, built by ``create_app``.

Routes reach it through the ``Context`` dependency (``server.api.deps``); anything holding the
app itself (tests, the ingest hook) calls :func:`context_of`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette

from server.api.slots import DbSlots
from server.config import Settings
from server.live import StreamSlots, TelemetryNotifier
from server.metrics import Metrics
from server.notify import PLACEMENT, Bus, PlanWaiters
from server.scale import AgentPaths
from server.scale.cache import Caches
from server.scale.heartbeat_groups import HeartbeatGroups
from server.scale.host_answers import HostAnswers, Liveness
from server.scale.telemetry_writer import TelemetryWriter
from server.throttle import FailureLimit


@dataclass
class AppContext:
    """Everything a request may need beyond its own session."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    write_lock: AbstractContextManager[Any]
    """SQLite's one-writer lock across this process and the controller; a no-op elsewhere."""
    caches: Caches
    metrics: Metrics
    plan_waiters: PlanWaiters
    """This process's plan long-polls, woken when a plan is committed."""
    plan_bus: Bus
    """Plans committed here, announced to the other server processes, and theirs to us."""
    host_answers: HostAnswers
    """Steady heartbeats' answers, per host (``server.scale.host_answers``)."""
    liveness: Liveness
    """Heartbeats answered from memory, their liveness to be written in a batch."""
    host_bus: Bus
    """Hosts whose heartbeat answer a commit changed, here and in the other processes."""
    wake_bus: Bus
    """Jobs whose telemetry is urgent, announced to a controller process."""
    token_bus: Bus
    """Credentials a commit changed (``server.scale.cache.CredentialChange``), for every process."""
    wake_controller: Callable[[int], None]
    """Runs the controller's next round for a job now (urgent telemetry)."""
    auth_failures: FailureLimit
    """Bad credentials per client address (the API's gate and ``/login``)."""
    telemetry_writer: TelemetryWriter
    """Telemetry posts, stored in groups (one transaction for the posts that arrive together)."""
    paths: AgentPaths = field(init=False)
    """What answers heartbeats and telemetry posts (``server.scale``: the fast paths or the
    plain one, as ``Settings.fast_paths`` says); set once the rest is built."""
    heartbeat_groups: HeartbeatGroups = field(init=False)
    """Heartbeats worked out in the database, in groups (``server.scale.heartbeat_groups``); set once
    the rest is built."""
    db_slots: DbSlots = field(default_factory=lambda: DbSlots(16))
    """Requests doing database work at once in this process (``create_app`` sets the bound,
    ``Settings.db_concurrency``). A request holds its slot from before its session opens until
    after it closes, across the worker-thread hops between, so the bound keeps the requests
    holding pool connections fewer than the worker threads they need to give them back (and
    SQLite's writers fewer than the threads they wait in): with more, every thread could sit
    waiting for a connection held by requests that wait for a thread. A freed slot goes to any
    other request before a heartbeat (``server.api.slots``)."""
    telemetry_notifier: TelemetryNotifier = field(default_factory=TelemetryNotifier)
    stream_slots: StreamSlots = field(default_factory=lambda: StreamSlots(8))
    """Live streams open per token in this process (``create_app`` sets the cap)."""
    generated_admin_token: str | None = None
    """The admin token generated at start-up when none was configured (shown once)."""
    stopping: bool = False
    """The server is stopping (``begin_stop``): held requests answer now rather than wait."""

    @contextmanager
    def transaction(self, *, write: bool) -> Iterator[Session]:
        """One transaction, committed on success. Writes take the app's writer lock first (a
        real lock on SQLite, which allows one writer at a time: queueing here is fairer and far
        faster than SQLite's busy-wait backoff; a no-op elsewhere). Once committed, the
        controller is woken if the work asked for a placement round (jobs to place, or devices
        to place them on)."""
        lock = self.write_lock if write else nullcontext()
        with lock, self.sessions() as session, session.begin():
            yield session
        if session.info.get("placement"):
            self.wake_controller(PLACEMENT)

    def begin_stop(self) -> None:
        """The server is about to stop: plan long-polls answer at once (304) and dashboard
        streams end with an ``end`` event, so they finish within the server's graceful wait
        instead of being cancelled at its end with an error per request. Any thread."""
        self.stopping = True
        self.plan_waiters.close()


def context_of(app: Starlette) -> AppContext:
    """The context ``create_app`` stored on ``app``."""
    context = app.state.context
    assert isinstance(context, AppContext), "not an app built by server.app.create_app"
    return context
