"""Prometheus metrics, one registry per app (no process globals, so tests build their own)."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.enums import HostStatus, JobStatus
from server.models import ControllerFence, Host, Job

LOOP_LAG_EVERY_S = 0.1
REMEMBERED = 65_536
"""Raw paths (and label sets) whose route name (and series) a process keeps; past it, forgotten
and found again: a client sending random paths costs a scan each, never unbounded memory."""


async def measure_loop_lag(histogram: Histogram, every_s: float = LOOP_LAG_EVERY_S) -> None:
    """Observe, until cancelled, how much later than asked the running event loop wakes a
    sleep of ``every_s``: the time anything ready to run (a request read off its socket, an
    answer to send) waits for the loop. Runs on that loop."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + every_s
        await asyncio.sleep(every_s)
        histogram.observe(max(0.0, loop.time() - asked))


class GcPauses:
    """Times each of this process's garbage collections, telling ``observe`` (generation,
    seconds) of each; a ``gc.callbacks`` hook from ``start`` to ``stop``. A collection holds
    the interpreter: the event loop and every thread wait for it, so a long one delays every
    request in flight at once, the kind of pause the event-loop lag samples only now and
    then."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self.observe = observe
        self._started: float | None = None

    @classmethod
    def into(cls, histogram: Histogram) -> GcPauses:
        """Into ``histogram``, labelled by generation."""
        return cls(lambda generation, took: histogram.labels(str(generation)).observe(took))

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            took = time.perf_counter() - self._started
            self._started = None
            self.observe(info["generation"], took)

    def start(self) -> None:
        """Time the collections from now (an app's start) until ``stop``."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def stop(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


class _StateCollector(Collector):
    """Jobs by status, hosts by status and the controller's turn, read from the database at
    scrape time."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("evenflow_jobs", "Jobs by status", labels=["status"])
        hosts = GaugeMetricFamily("evenflow_hosts", "Hosts by status", labels=["status"])
        with self.sessions() as s:
            job_counts = dict(
                s.execute(select(Job.status, func.count(Job.id)).group_by(Job.status)).all()
            )
            host_counts = dict(
                s.execute(select(Host.status, func.count(Host.id)).group_by(Host.status)).all()
            )
            columns = (ControllerFence.epoch, ControllerFence.holder, ControllerFence.since)
            row = s.execute(select(*columns).where(ControllerFence.id == 1)).one_or_none()
            turn = None if row is None else (int(row[0]), row[1], row[2])
        for st in JobStatus:
            jobs.add_metric([st.value], float(job_counts.get(st, 0)))
        for hs in HostStatus:
            hosts.add_metric([hs.value], float(host_counts.get(hs, 0)))
        yield jobs
        yield hosts
        if turn is not None:
            yield from _controller_turn(*turn)


def _controller_turn(
    epoch: int, holder: str | None, since: datetime | None
) -> Iterator[GaugeMetricFamily]:
    """The active controller's turn (``models.ControllerFence``): one more at every takeover,
    so a fail-over shows as a step, with who took it and when."""
    turn = GaugeMetricFamily(
        "evenflow_controller_epoch",
        "Turns the database's controllers have taken (one more at every start or takeover), "
        "labelled with who took the last (host:pid)",
        labels=["holder"],
    )
    turn.add_metric([holder or ""], float(epoch))
    yield turn
    if since is not None:
        yield GaugeMetricFamily(
            "evenflow_controller_since_seconds",
            "When the active controller took its turn (Unix time)",
            value=since.timestamp(),
        )


class Metrics:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "evenflow_http_requests",
            "HTTP requests",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "evenflow_http_request_seconds",
            "HTTP request latency",
            ["route"],
            registry=self.registry,
            # up to a minute: a busy fleet's slowest requests take seconds
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.telemetry_records = Counter(
            "evenflow_telemetry_records", "Telemetry records stored", registry=self.registry
        )
        self.telemetry_duplicates = Counter(
            "evenflow_telemetry_duplicates",
            "Telemetry records skipped as already stored",
            registry=self.registry,
        )
        self.telemetry_group_posts = Histogram(
            "evenflow_telemetry_group_posts",
            "Telemetry posts stored together in one transaction (server.scale.telemetry_writer)",
            registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.heartbeat_answers = Counter(
            "evenflow_heartbeat_answers",
            "Heartbeat answers, by where they came from: memory (the host's last heartbeat "
            "repeated, nothing changed) or the database",
            ["source"],
            registry=self.registry,
        )
        self.heartbeat_misses = Counter(
            "evenflow_heartbeat_database_reasons",
            "Heartbeats worked out in the database, by why memory had no answer: launch (the "
            "host's last answer handed out launch credentials, never repeated), none (the "
            "host's first here, or a change dropped its answer), expired (the answer's TTL, "
            "EVENFLOW_HEARTBEAT_ANSWER_TTL_S), token (another credential) or report (something "
            "new reported)",
            ["reason"],
            registry=self.registry,
        )
        self.heartbeat_group = Histogram(
            "evenflow_heartbeat_group_heartbeats",
            "Heartbeats worked out in the database together, in one transaction "
            "(server.scale.heartbeat_groups)",
            registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.heartbeat_phases = Histogram(
            "evenflow_heartbeat_database_seconds",
            "Heartbeats worked out in the database, where their time went: slot (waiting for "
            "one of the API process's database slots, after any other request waiting), "
            "thread (from the slot to a worker thread running it: the process's CPU) and "
            "transaction (its statements and commit: lock waits and the database included); "
            "report_lock (within transaction, of those that took jobs' report locks: the wait "
            "for them); advance (within transaction, of groups whose reports may move jobs "
            "on: the transaction after their commit that advances those jobs)",
            ["phase"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.liveness_flush = Histogram(
            "evenflow_liveness_flush_seconds",
            "Each write of the hosts' heartbeat times noted in memory (one a second while any "
            "are noted; server.scale.host_answers.Liveness), its connection's checkout included",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.liveness_hosts = Counter(
            "evenflow_liveness_hosts",
            "Hosts' heartbeat times flushed, by outcome: written, or held (another "
            "transaction held the host's row; left for the next flush)",
            ["outcome"],
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "evenflow_event_loop_lag_seconds",
            "How late this API process's event loop ran a timer (one every "
            f"{LOOP_LAG_EVERY_S} s): what a request arriving then waited before the server could "
            "even read it. Seconds here mean the process needs more CPU than it gets (another "
            "API process, or another server, takes part of its load).",
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.gc_pauses = GcPauses.into(
            Histogram(
                "evenflow_gc_pause_seconds",
                "Each garbage collection of this process, by generation: the interpreter, its "
                "event loop and every thread of it wait for it to end.",
                ["generation"],
                registry=self.registry,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            )
        )
        self.registry.register(_StateCollector(sessions))
        self._templates: list[tuple[re.Pattern[str], str]] = []
        self._names: dict[str, str] = {}
        self._counted: dict[tuple[str, str, int], Any] = {}
        self._timed: dict[str, Any] = {}

    def set_templates(self, paths: list[str]) -> None:
        """Label requests by these path templates (the app's OpenAPI paths), not raw paths."""
        self._templates = [(compile_path(p)[0], p) for p in paths]
        self._names.clear()

    def route_name(self, path: str) -> str:
        """The template ``path`` matches, remembered for the next request to the same path (a
        fleet's hosts each heartbeat to a path of their own, every 2 s)."""
        name = self._names.get(path)
        if name is None:
            name = next((t for regex, t in self._templates if regex.match(path)), "unmatched")
            if len(self._names) >= REMEMBERED:  # raw paths are the clients' to choose
                self._names.clear()
            self._names[path] = name
        return name

    def observe_request(self, method: str, path: str, status: int, seconds: float) -> None:
        """Count and time one request. The labelled series are kept rather than looked up
        by their labels each time (``labels()`` joins and checks them, a large share of what
        metering a request costs)."""
        name = self.route_name(path)
        key = (method, name, status)
        counted = self._counted.get(key)
        if counted is None:
            if len(self._counted) >= REMEMBERED:
                self._counted.clear()
            counted = self._counted[key] = self.requests.labels(method, name, str(status))
        counted.inc()
        timed = self._timed.get(name)
        if timed is None:
            timed = self._timed[name] = self.latency.labels(name)
        timed.observe(seconds)


class MetricsMiddleware:
    """Counts and times every HTTP request by its route template (not the raw path), and tells
    the client the time the app took until its response started (``Server-Timing: app;dur=ms``),
    so a client can tell the server's share of the latency it observes from the rest
    (connection, HTTP parsing, the event loop's queue, its own scheduling)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                took = f"app;dur={1000 * (time.perf_counter() - start):.3f}".encode()
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"server-timing", took)],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            took = time.perf_counter() - start
            self.metrics.observe_request(scope["method"], scope["path"], status, took)
