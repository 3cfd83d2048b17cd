"""The agent's telemetry relay: one post per job and flush interval for all of a host's ranks.

A telemetry post costs the server about the same CPU whatever its size (README, "Capacity"), so
the number of posts decides what a server carries. Each worker therefore posts its timings to
its own agent (``POST http://127.0.0.1:PORT/api/v1/jobs/{id}/telemetry``, the server's route
and body, ``EVENFLOW_TELEMETRY_RELAY`` in its environment), which buffers them per job and
posts each job's rows as one batch every ``flush_s`` with the agent's token (the server lets an
agent post rows of the ranks placed on its host)::

    worker --TelemetryBatch--> relay (127.0.0.1, ephemeral port)
              <--TelemetryAck(accepted=rows buffered, duplicates=0) at once
    relay  --one TelemetryBatch per job--> server   every flush_s, or at once when urgent

Only the agent's own workers may post: a batch is taken only with the credential the agent
handed to that job's rank at launch (:meth:`TelemetryRelay.grant`), for that rank's rows only
(else 403, JSON ``detail``), and is validated with the same contract model (else 422).

An ``urgent`` batch (an iteration time jumped) makes its job's rows go at once (after
``URGENT_WINDOW_S`` for its other ranks' batches of the same jump), marked urgent,
so the control plane still looks at the job without waiting. A failed post keeps its rows (at
most ``max_rows`` per job: the oldest are dropped and counted in the log) and is retried with
``agent.backoff.Backoff``; a 409 (the job ended) drops the job's rows, and its workers' later
posts are answered 409, which stops them as the server's answer would. Rows the server refuses
for good (403, 404, 422) are dropped with a log line. A post never carries more than
``MAX_TELEMETRY_RECORDS`` rows. :meth:`TelemetryRelay.flush` posts one job's rows at once: the
agent calls it before a heartbeat reports one of the job's ranks ended, so the server has every
row of a rank before it learns that the rank ended.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from pydantic import ValidationError

from agent.backoff import Backoff
from agent.client import ApiError
from contract.agent import TelemetryAck, TelemetryBatch, TelemetryRecord
from contract.base import MAX_TELEMETRY_RECORDS

log = logging.getLogger("evenflow.agent.relay")

RELAY_ENV = "EVENFLOW_TELEMETRY_RELAY"
"""The worker's variable holding the relay's base URL."""
MAX_BODY_BYTES = 16 * 2**20
URGENT_WINDOW_S = 0.05
"""How long an urgent batch waits for the same jump's batches of the job's other ranks (their
iterations end together, in one all-reduce), so that one jump is one urgent post, not one per
rank."""
DROPPED_FOR_GOOD = (403, 404, 422)
"""Server answers that retrying cannot change: the rows are dropped."""
_PATH = re.compile(r"^/api/v1/jobs/(\d{1,18})/telemetry$")

Post = Callable[[int, TelemetryBatch], TelemetryAck]
"""Posts one job's batch to the control plane with the agent's token; raises on failure."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TelemetryRelay:
    """Buffers the workers' telemetry per job and posts it in one batch per job."""

    def __init__(
        self,
        post: Post,
        *,
        flush_s: float = 2.0,
        max_rows: int = 100_000,
        backoff: Backoff | None = None,
    ) -> None:
        if flush_s <= 0 or max_rows < 1:
            raise ValueError("flush_s must be positive and max_rows at least 1")
        self._post = post
        self.flush_s = flush_s
        self.max_rows = max_rows
        """Rows kept per job while the server cannot be reached; the oldest go first."""
        self._backoff = backoff or Backoff(0.5, 30.0)
        self._cond = threading.Condition()
        self._sending = threading.Lock()  # one post at a time: a failed one puts rows back first
        self._grants: dict[str, tuple[int, int]] = {}  # token digest -> (job, rank)
        self._rows: dict[int, deque[TelemetryRecord]] = {}
        self._urgent: set[int] = set()
        self._urgent_at = 0.0  # when the first of the urgent jobs became urgent
        self._ended: set[int] = set()
        self._retry_at = 0.0
        self._closing = False
        self.posts = self.rows_posted = self.rows_dropped = 0
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ credentials
    def grant(self, job_id: int, rank: int, token: str) -> None:
        """Accept batches of ``rank`` of ``job_id`` sent with ``token`` (its worker credential)."""
        with self._cond:
            self._grants[_digest(token)] = (job_id, rank)

    def revoke(self, token: str) -> None:
        with self._cond:
            self._grants.pop(_digest(token), None)

    # ------------------------------------------------------------------ the endpoint
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the relay is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> str:
        """Listen on 127.0.0.1 (an ephemeral port) and start the flusher; returns the URL."""
        relay = self

        class Handler(_Handler):
            pass

        Handler.relay = relay
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._threads = [
            threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="evenflow-relay-http",
                daemon=True,
            ),
            threading.Thread(target=self._run, name="evenflow-relay-flush", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        log.info("telemetry relay listening on %s", self.url)
        return self.url

    def accept(self, job_id: int, token: str, body: bytes) -> tuple[int, dict[str, object]]:
        """One worker post: (HTTP status, JSON answer). Buffers the rows when it may."""
        with self._cond:
            grant = self._grants.get(_digest(token))
        if grant is None:
            return 403, {"detail": "not a worker credential this agent handed out"}
        if grant[0] != job_id:
            return 403, {
                "detail": f"a credential of job {grant[0]} rank {grant[1]} may not post "
                f"telemetry for job {job_id}"
            }
        try:
            batch = TelemetryBatch.model_validate_json(body)
        except ValidationError as exc:
            return 422, {"detail": str(exc).splitlines()[0], "errors": json.loads(exc.json())}
        records = batch.all_records()
        other = next((r.rank for r in records if r.rank != grant[1]), None)
        if other is not None:
            return 403, {"detail": f"a credential of rank {grant[1]} may not post rank {other}"}
        with self._cond:
            if job_id in self._ended:
                return 409, {"detail": f"job {job_id} has ended"}
            rows = self._rows.setdefault(job_id, deque())
            rows.extend(records)
            self._trim(job_id, rows)
            if batch.urgent:
                if not self._urgent:
                    self._urgent_at = time.monotonic()
                self._urgent.add(job_id)
                self._cond.notify_all()
        return 200, TelemetryAck(accepted=len(records), duplicates=0).model_dump()

    # ------------------------------------------------------------------ flushing
    def pending(self, job_id: int | None = None) -> int:
        """Rows buffered (of one job, or of all)."""
        with self._cond:
            if job_id is not None:
                return len(self._rows.get(job_id, ()))
            return sum(len(rows) for rows in self._rows.values())

    def flush(self, job_id: int) -> bool:
        """Post the job's buffered rows now; whether none is left (delivered, or dropped because
        the server will never take them). On a failure the rows stay buffered."""
        with self._sending:
            while True:
                with self._cond:
                    rows = self._rows.get(job_id)
                    if not rows:
                        self._rows.pop(job_id, None)
                        self._urgent.discard(job_id)
                        return True
                    chunk = [rows.popleft() for _ in range(min(len(rows), MAX_TELEMETRY_RECORDS))]
                    urgent = job_id in self._urgent
                if not self._send(job_id, chunk, urgent):
                    return False

    def _send(self, job_id: int, chunk: list[TelemetryRecord], urgent: bool) -> bool:
        batch = TelemetryBatch.model_construct(records=chunk, columns=None, urgent=urgent)
        try:
            self._post(job_id, batch)
        except ApiError as exc:
            if exc.status_code == 409:
                with self._cond:
                    self._ended.add(job_id)
                    dropped = len(self._rows.pop(job_id, ())) + len(chunk)
                    self._urgent.discard(job_id)
                log.info("job %d has ended; dropped its %d buffered row(s)", job_id, dropped)
                return True
            if exc.status_code in DROPPED_FOR_GOOD:
                with self._cond:
                    self.rows_dropped += len(chunk)
                log.warning(
                    "dropped %d telemetry row(s) of job %d the server refused: %s",
                    len(chunk),
                    job_id,
                    exc,
                )
                return True
            return self._put_back(job_id, chunk, exc)
        except httpx.HTTPError as exc:
            return self._put_back(job_id, chunk, exc)
        with self._cond:
            self.posts += 1
            self.rows_posted += len(chunk)
            if urgent:
                self._urgent.discard(job_id)
        return True

    def _put_back(self, job_id: int, chunk: list[TelemetryRecord], exc: Exception) -> bool:
        with self._cond:
            rows = self._rows.setdefault(job_id, deque())
            rows.extendleft(reversed(chunk))
            self._trim(job_id, rows)
            kept = len(rows)
        log.warning("telemetry of job %d not posted (%s); %d row(s) kept", job_id, exc, kept)
        return False

    def _trim(self, job_id: int, rows: deque[TelemetryRecord]) -> None:
        """Drop the oldest rows past ``max_rows`` (the caller holds the lock)."""
        over = len(rows) - self.max_rows
        if over > 0:
            for _ in range(over):
                rows.popleft()
            self.rows_dropped += over
            log.warning(
                "telemetry buffer of job %d is full: dropped its %d oldest row(s) (%d in all)",
                job_id,
                over,
                self.rows_dropped,
            )

    def flush_all(self) -> bool:
        """Flush every job (stopping at the first failure); whether all got through."""
        with self._cond:
            jobs = list(self._rows)
        return all(self.flush(job) for job in jobs)

    def _run(self) -> None:
        """The flusher: every job's rows each ``flush_s``, an urgent job's at once, and after a
        failure nothing before the back-off has passed."""
        due = time.monotonic() + self.flush_s
        while True:
            with self._cond:
                while not self._closing:
                    now = time.monotonic()
                    soon = min(due, self._urgent_at + URGENT_WINDOW_S) if self._urgent else due
                    wake = max(self._retry_at, soon)
                    if now >= wake:
                        break
                    self._cond.wait(wake - now)
                if self._closing:
                    return
                periodic = time.monotonic() >= due
                jobs = list(self._rows) if periodic else list(self._urgent)
            if periodic:
                due = time.monotonic() + self.flush_s
            ok = all(self.flush(job) for job in jobs)
            with self._cond:
                if ok:
                    self._backoff.succeeded()
                    self._retry_at = 0.0
                else:
                    self._retry_at = time.monotonic() + self._backoff.failed()
                    due = max(due, self._retry_at)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the flusher, flush everything (retrying until ``timeout_s``), then stop the
        endpoint; whether every row got through."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        flusher = self._threads[1:]
        for thread in flusher:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        delivered = self.flush_all()
        delay = Backoff(0.2, 2.0)
        while not delivered and time.monotonic() + delay.current_s < deadline:
            time.sleep(min(delay.failed(), max(0.0, deadline - time.monotonic())))
            delivered = self.flush_all()
        if not delivered:
            log.warning("telemetry relay stopped with %d row(s) not posted", self.pending())
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        return delivered


class _Handler(BaseHTTPRequestHandler):
    """The endpoint: ``POST /api/v1/jobs/{id}/telemetry`` with a worker's Bearer token."""

    relay: TelemetryRelay
    protocol_version = "HTTP/1.1"  # keep-alive: a worker's client reuses its connection

    def do_POST(self) -> None:
        match = _PATH.match(self.path.split("?", 1)[0])
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._answer(411, {"detail": "a body with a Content-Length is required"}, close=True)
            return
        if int(length) > MAX_BODY_BYTES:
            self._answer(413, {"detail": f"a body is at most {MAX_BODY_BYTES} bytes"}, close=True)
            return
        body = self.rfile.read(int(length))
        if match is None:
            self._answer(404, {"detail": "the relay serves POST /api/v1/jobs/{id}/telemetry only"})
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            self._answer(401, {"detail": "a Bearer token is required"})
            return
        status, answer = self.relay.accept(int(match.group(1)), token.strip(), body)
        self._answer(status, answer)

    def _answer(self, status: int, answer: dict[str, object], close: bool = False) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("relay %s: " + format, self.address_string(), *args)
