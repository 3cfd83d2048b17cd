"""How ``evenflow server`` runs the control plane: one controller process and API processes.

1. Migrations and the bootstrap admin token, once, before anything serves.
2. The controller (``python -m server.controller``) in a process of its own, restarted if it
   dies, stopped with the server: the control loop's database reads and model fits never hold
   the API process's GIL.
3. uvicorn serving ``create_app`` with ``controller="none"``: one process, or ``workers``
   processes sharing the port (each gets plan notifications over the plan bus).

On SIGTERM or SIGINT each API process answers the requests it holds open (plan long-polls,
dashboard streams) at once, then lets uvicorn stop as usual (``answer_held_requests_on_stop``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

from fastapi import FastAPI

from server.config import Settings

log = logging.getLogger("evenflow.serve")

RESTART_AFTER_S = 1.0


def worker_app() -> FastAPI:
    """The app of one of several uvicorn workers (``uvicorn --factory``): settings from the
    environment, no controller of its own, migrations already applied by the parent."""
    from server.app import create_app

    app = answer_held_requests_on_stop(
        create_app(Settings(controller="none", run_migrations=False))
    )
    settle_heap()
    return app


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def answer_held_requests_on_stop(app: FastAPI) -> FastAPI:
    """Once ``app`` has started under uvicorn, a stop signal first ends the requests it holds
    open (``AppContext.begin_stop``), then reaches uvicorn's own handler. uvicorn waits for open
    requests for its graceful timeout and then cancels them, logging an error and a traceback
    per request: a server holding an agent's plan long-poll or a dashboard stream did so on
    every stop, and those clients saw their connection cut instead of an answer. uvicorn offers
    no hook before that wait (with ``workers`` it builds its servers itself), so the handler
    is chained in at start-up, after uvicorn installed its own (in the main thread only)."""
    from server.context import context_of

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        async with inner(a) as state:
            if threading.current_thread() is threading.main_thread():
                for sig in STOP_SIGNALS:
                    _chain(sig, context_of(a).begin_stop)
            yield state

    app.router.lifespan_context = lifespan
    return app


def _chain(sig: signal.Signals, first: Callable[[], None]) -> None:
    previous = signal.getsignal(sig)
    if not callable(previous):
        return  # uvicorn did not take this signal: leave it alone

    def handler(signum: int, frame: FrameType | None) -> None:
        first()
        previous(signum, frame)

    signal.signal(sig, handler)


GC_YOUNG_OBJECTS = 20_000
"""Container objects allocated (net) between two collections of the youngest generation, for
a server process (Python's default: 700). A request's objects that are still alive at two
young collections are promoted to the oldest generation, and a full collection follows once
those add up to a quarter of it. At 700, a busy API process (hundreds of requests a second,
some of them waiting seconds for a database slot) promotes its in-flight requests so fast
that full collections come every few seconds, each holding the whole process, loop and every
thread (``evenflow_gc_pause_seconds`` shows them). At 20,000 the young collections come ~30
times less often, so a request lives through two of them only if it lasts seconds; what they
find is still small (most garbage goes by reference counting)."""


def settle_heap() -> None:
    """Move everything built so far (modules, the app, its schemas) out of the garbage
    collector's view (``gc.freeze``): a full collection then scans only what requests create,
    and stalls the requests in flight for less; these objects live as long as the process
    anyway. And collect the youngest generation every ``GC_YOUNG_OBJECTS`` allocations, not
    700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])


def prepare(settings: Settings) -> None:
    """Migrate and make sure an admin token exists (printing a generated one once)."""
    from server.app import bootstrap
    from server.db import make_engine, session_factory

    engine = make_engine(settings.database_url, pool_size=1, name="evenflow-prepare")
    try:
        bootstrap(engine, session_factory(engine), settings)
    finally:
        engine.dispose()


class ControllerProcess:
    """``python -m server.controller`` as a child, restarted when it exits unasked."""

    def __init__(self, log_level: str) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "server.controller",
            "--log-level",
            log_level,
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="controller-supervisor")

    def start(self) -> ControllerProcess:
        self.proc = subprocess.Popen(self.cmd)
        self._thread.start()
        return self

    def _supervise(self) -> None:
        while not self._stop.is_set():
            assert self.proc is not None
            code = self.proc.wait()
            if self._stop.is_set():
                return
            log.error("controller exited with %s; restarting", code)
            time.sleep(RESTART_AFTER_S)
            if not self._stop.is_set():
                self.proc = subprocess.Popen(self.cmd)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def serve(
    host: str, port: int, log_level: str = "info", workers: int = 1, access_log: bool = False
) -> None:
    """Run the control plane until interrupted (``evenflow server``)."""
    import uvicorn

    from server.app import create_app

    settings = Settings()
    prepare(settings)
    # uvicorn re-raises the SIGTERM it stopped on once it has shut down; with the default
    # action that would kill this process before it stops the controller.
    signal.signal(signal.SIGTERM, _exit)
    controller = ControllerProcess(log_level).start()
    # Open dashboard streams would otherwise hold a stop for up to their 60 s lifetime.
    common = {
        "host": host,
        "port": port,
        "log_level": log_level,
        # A line per request is thousands of lines a second from a fleet's heartbeats and
        # telemetry; /metrics counts requests instead. --access-log turns them on.
        "access_log": access_log,
        # Agents heartbeat and post every few seconds; a connection outliving uvicorn's 5 s
        # default is reused instead of racing its close and being reset.
        "timeout_keep_alive": 30,
        "timeout_graceful_shutdown": 3,
    }
    try:
        if workers > 1:
            uvicorn.run("server.serve:worker_app", factory=True, workers=workers, **common)  # type: ignore[arg-type]
        else:
            app = create_app(Settings(controller="none", run_migrations=False))
            answer_held_requests_on_stop(app)
            settle_heap()
            uvicorn.run(app, **common)  # type: ignore[arg-type]
    finally:
        controller.stop()


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
