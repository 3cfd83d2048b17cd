"""``create_app(settings)`` builds the control plane. No module-level engine or settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException

from contract.agent import Heartbeat, TelemetryBatch
from contract.problems import explain
from server.api import raw, statuses
from server.api.bodies import component_schemas
from server.api.gate import DATABASE_DOWN, Gate, database_unavailable, error_response
from server.api.routes import (
    artifact_content,
    artifacts,
    audit,
    checkpoints,
    contexts,
    events,
    health,
    hosts,
    job_metrics,
    jobs,
    planner,
    plans,
    series,
    stream,
    telemetry,
    tokens,
)
from server.api.routes.ui import MAX_LOGIN_BODY, mount_dashboard
from server.api.slots import DbSlots
from server.config import Settings
from server.context import AppContext
from server.controller import CONTROLLER_THREAD, Controller
from server.db import make_engine, migrate, session_factory, transaction
from server.errors import EvenflowError
from server.live import StreamSlots
from server.locks import WriterLock, bootstrap_lock, writer_lock_for
from server.metrics import Metrics, MetricsMiddleware, measure_loop_lag
from server.notify import PlanWaiters, open_bus, subscribe
from server.scale import agent_paths
from server.scale.cache import Caches
from server.scale.heartbeat_groups import HeartbeatGroups
from server.scale.host_answers import LIVENESS_FLUSH_S, HostAnswers, Liveness, track
from server.scale.telemetry_writer import TelemetryWriter
from server.services import tokens as token_service
from server.throttle import FailureLimit

log = logging.getLogger("evenflow.server")

API_PREFIX = "/api/v1"
PUBLIC_PATHS = frozenset({f"{API_PREFIX}/health", f"{API_PREFIX}/health/live"})
"""The only API routes callable without a token."""
MAX_BODY_BYTES = 8 * 1024 * 1024
API_ROUTES = (
    hosts,
    jobs,
    plans,
    telemetry,
    job_metrics,
    checkpoints,
    artifacts,
    artifact_content,
    contexts,
    events,
    audit,
    tokens,
    planner,
)
"""The API's resources (the dashboard's series and stream are mounted with the dashboard)."""


def _field_path(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:] or parts
    return ".".join(parts)


async def _on_domain_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EvenflowError)
    return error_response(exc.status_code, exc.message, exc.field)


async def _on_database_down(_: Request, exc: Exception) -> JSONResponse:
    return database_unavailable(exc)


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    raw = exc.errors()
    errors = [
        {
            "loc": [str(p) for p in e.get("loc", ())],
            "msg": problem.message,
            "type": str(e.get("type", "")),
        }
        for e, problem in zip(raw, explain(raw), strict=True)
    ]
    if errors and errors[0]["type"] == "json_invalid":  # the body as a whole is not JSON
        reason = (exc.errors()[0].get("ctx") or {}).get("error") or errors[0]["msg"]
        reason = str(reason).removeprefix("Invalid JSON: ")
        if "escape" in reason:  # the parser's words for a lone surrogate such as \\ud800
            reason += " (a \\u escape must be valid Unicode: no lone surrogate)"
        return error_response(422, f"body: not valid UTF-8 JSON: {reason}", "body", errors)
    summary = "; ".join(f"{_field_path(e['loc'])}: {e['msg']}" for e in errors[:5])
    first = _field_path(errors[0]["loc"]) if errors else None
    return error_response(422, summary or "invalid request", first, errors)


async def _on_http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 304:
        return Response(status_code=304)
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


def create_app(settings: Settings | None = None) -> FastAPI:
    context = _build_context(settings or Settings())
    # The API docs (/docs, /redoc) load Swagger UI and ReDoc from the ``fastapi-offline``
    # package, served here: nothing a page of this server loads comes from another host.
    app = FastAPIOffline(
        title="Evenflow",
        version="1",
        summary="Per-worker batch sizes for synchronous training on heterogeneous GPUs.",
        lifespan=_lifespan(context),
        static_url="/vendor/docs",
        # Swagger UI would fetch a validity badge from validator.swagger.io: no other host.
        swagger_ui_parameters={"validatorUrl": None},
        telemetry={
            "tracing": context.settings.opentelemetry,
            "metrics": context.settings.opentelemetry,
            "logs": context.settings.opentelemetry,
        },
    )
    app.state.context = context

    app.add_exception_handler(EvenflowError, _on_domain_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for down in DATABASE_DOWN:
        app.add_exception_handler(down, _on_database_down)

    for module in (health, *API_ROUTES, series, stream):
        # each operation's error statuses, from its dependencies (``server.api.statuses``)
        statuses.document(module.router, api_prefix=API_PREFIX, public=PUBLIC_PATHS)
    app.include_router(health.router, prefix=API_PREFIX)
    for module in API_ROUTES:
        app.include_router(module.router, prefix=API_PREFIX)
    # The dashboard: chart data, the live stream, and the web UI (pages, login, static files).
    mount_dashboard(app, api_prefix=API_PREFIX)
    raw.mount(app, prefix=API_PREFIX, public=PUBLIC_PATHS)  # the fleet's two, matched first
    metrics = context.metrics

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = _openapi(app)  # type: ignore[method-assign]
    metrics.set_templates([*app.openapi()["paths"], "/metrics"])
    app.add_middleware(
        Gate,
        context=context,
        api_prefix=API_PREFIX,
        public=PUBLIC_PATHS,
        max_body=MAX_BODY_BYTES,
        body_limits={
            "/login": MAX_LOGIN_BODY,
            API_PREFIX + contexts.UPLOAD_PATH: context.settings.context_max_bytes,
        },
        body_limit_patterns=[(artifact_content.CONTENT_PATH, context.settings.artifact_max_bytes)],
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def _build_context(settings: Settings) -> AppContext:
    engine = make_engine(
        settings.database_url, pool_size=settings.db_pool_size, name="evenflow-api"
    )
    sessions = session_factory(engine)
    caches = Caches(sessions)
    waiters = PlanWaiters()
    bus = open_bus(settings.database_url)
    caches.plan_listeners += [waiters.notify, bus.publish]
    answers = HostAnswers(settings.heartbeat_answer_ttl_s)
    host_bus = open_bus(settings.database_url, "hosts")
    track(sessions, answers.invalidate, host_bus.publish)
    wake_bus = open_bus(settings.database_url, "wake")
    token_bus = open_bus(settings.database_url, "tokens")
    caches.credential_listeners.append(token_bus.publish)
    # SQLite takes one writer at a time, across this process and the controller process.
    write_lock = writer_lock_for(settings.database_url) or contextlib.nullcontext()
    metrics = Metrics(sessions)
    context = AppContext(
        settings=settings,
        engine=engine,
        sessions=sessions,
        write_lock=write_lock,
        caches=caches,
        metrics=metrics,
        plan_waiters=waiters,
        plan_bus=bus,
        host_answers=answers,
        liveness=Liveness(),
        host_bus=host_bus,
        wake_bus=wake_bus,
        token_bus=token_bus,
        # Urgent telemetry (a worker's iteration time jumped) runs the controller's next round
        # now: over the wake bus to a controller process, or directly when it is a thread here.
        wake_controller=lambda job_id: wake_bus.publish([job_id]),
        stream_slots=StreamSlots(settings.max_streams_per_token),
        db_slots=DbSlots(min(settings.db_concurrency, 3 * settings.db_pool_size)),
        auth_failures=FailureLimit(settings.auth_failures_max, settings.auth_failures_window_s),
        telemetry_writer=TelemetryWriter(engine, write_lock, metrics.telemetry_group_posts.observe),
    )
    context.heartbeat_groups = HeartbeatGroups(
        context,
        at_once=min(settings.heartbeat_groups, context.db_slots.value),
        max_size=settings.heartbeat_group_size,
    )
    context.paths = agent_paths(context)
    return context


def _lifespan(context: AppContext) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Start-up (migrations, the admin token, the plan listener, the controller thread) and
    shutdown (in reverse) of an app."""
    settings, engine, sessions = context.settings, context.engine, context.sessions

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        context.generated_admin_token = await asyncio.to_thread(
            bootstrap, engine, sessions, settings
        )
        unsubscribe = [
            _listen_for_plans(context),
            # another process committed a change to these hosts: their answers are stale
            subscribe(
                context.host_bus, context.host_answers.invalidate, context.host_answers.clear
            ),
            # another process changed credentials: their cached principals go (all of them
            # when the LISTEN starts again: what was sent while it was down is lost)
            subscribe(
                context.token_bus, context.caches.on_credential_ids, context.caches.tokens.clear
            ),
        ]
        liveness = asyncio.ensure_future(_write_liveness(context))
        lag = asyncio.ensure_future(measure_loop_lag(context.metrics.loop_lag))
        context.metrics.gc_pauses.start()
        stop = threading.Event()
        controller: threading.Thread | None = None
        if settings.controller == "thread":
            loop = Controller(
                settings, engine=engine, sessions=sessions, write_lock=context.write_lock
            )
            context.wake_controller = lambda job_id: loop.poke((job_id,))
            controller = threading.Thread(
                target=loop.run, args=(stop,), name=CONTROLLER_THREAD, daemon=True
            )
            controller.start()
        try:
            yield
        finally:
            context.metrics.gc_pauses.stop()
            for task in (liveness, lag):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            try:
                await asyncio.to_thread(_flush_liveness, context)
            except Exception:  # the database is away: the reaper will not run either
                log.warning("could not write the hosts' liveness", exc_info=True)
            stop.set()
            if controller is not None:
                await asyncio.to_thread(controller.join, 30)
            for stop_listening in unsubscribe:
                stop_listening()
            _close(context)

    return lifespan


async def _write_liveness(context: AppContext) -> None:
    """Every ``LIVENESS_FLUSH_S``, the hosts' heartbeats noted (``host_answers.Liveness``).
    Outside the database slots: behind the heartbeats queued for them, a flush would come late
    exactly when the server is busy, and hosts waiting for it look silent to the reaper. One
    statement a second, one flush at a time, on the loop's own executor."""
    while True:
        await asyncio.sleep(LIVENESS_FLUSH_S)
        if context.liveness.pending():
            try:
                await asyncio.to_thread(_flush_liveness, context)
            except Exception:  # the database is away: the times are written at the next try
                log.warning("could not write the hosts' liveness", exc_info=True)


def _flush_liveness(context: AppContext) -> None:
    """One statement on PostgreSQL, in autocommit (``host_answers._ALIVE_IF_NEWER_PG``); a
    transaction under the writer lock on SQLite. Timed, its connection's checkout included,
    with the hosts it wrote and those it left for the next (``/metrics``): a flush that comes
    late or skips hosts is what lets the reaper take heartbeating hosts for silent."""
    started = time.perf_counter()
    liveness, metrics = context.liveness, context.metrics
    try:
        if context.engine.dialect.name == "postgresql":
            autocommit = context.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            with autocommit as conn:
                written = liveness.flush(conn)
        else:
            with context.write_lock, context.engine.begin() as conn:
                written = liveness.flush(conn)
    except Exception:
        liveness.restore()
        raise
    metrics.liveness_flush.observe(time.perf_counter() - started)
    metrics.liveness_hosts.labels("written").inc(written)
    metrics.liveness_hosts.labels("held").inc(liveness.held)


def _close(context: AppContext) -> None:
    context.telemetry_writer.close()
    context.plan_bus.close()
    context.host_bus.close()
    context.wake_bus.close()
    context.token_bus.close()
    context.caches.close()
    if isinstance(context.write_lock, WriterLock):
        context.write_lock.close()
    context.engine.dispose()


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The app's schema, built once: validation errors documented as ``ErrorOut`` like every
    other 4xx, and the bodies hot routes parse themselves (``server.api.bodies``) included."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            text = _replace_refs(
                schema, "#/components/schemas/HTTPValidationError", "#/components/schemas/ErrorOut"
            )
            for name in ("HTTPValidationError", "ValidationError"):
                text["components"]["schemas"].pop(name, None)
            text["components"]["schemas"].update(component_schemas(TelemetryBatch, Heartbeat))
            app.openapi_schema = text
        return app.openapi_schema

    return openapi


def bootstrap(engine: Engine, sessions: sessionmaker[Session], settings: Settings) -> str | None:
    """Migrate (when ``settings.run_migrations``) and make sure an admin token exists; returns
    a generated one, printed once (``evenflow server`` runs this before its processes start)."""
    secret = settings.admin_token.get_secret_value() if settings.admin_token else None
    with bootstrap_lock(engine):  # replicas starting together take turns
        if settings.run_migrations:
            migrate(engine)
        with transaction(sessions) as s:
            generated = token_service.ensure_admin(s, secret)
            token_service.ensure_agent_tokens(s, settings.agent_token_pairs())
    if generated:
        print(
            f"evenflow: generated admin token (shown once): {generated}",
            file=sys.stderr,
            flush=True,
        )
    return generated


def _replace_refs(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {
            k: (new if k == "$ref" and v == old else _replace_refs(v, old, new))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_replace_refs(v, old, new) for v in node]
    return node


def _listen_for_plans(context: AppContext) -> Callable[[], None]:
    """Plans committed by other processes (the controller, other API workers, other servers on
    the same PostgreSQL): clear their cache entries and wake their long-polls, as the ids
    arrive (on the event loop from the Unix socket bus; from the LISTEN thread on PostgreSQL)."""
    caches, waiters = context.caches, context.plan_waiters

    def on_ids(ids: set[int]) -> None:
        for job_id in ids:
            caches.plans.invalidate(job_id)
        waiters.notify(ids)

    def on_lost() -> None:  # (the LISTEN started again, or a publisher failed to send)
        caches.plans.clear()
        waiters.notify_all()

    return subscribe(context.plan_bus, on_ids, on_lost)
