"""The agent's relay of its workers' telemetry and metrics: one post per job, kind and flush
interval for all of a host's ranks, kept on the host's disk until the server has it.

A telemetry post costs the server about the same CPU whatever its size (README, "Capacity"), so
the number of posts decides what a server carries. Each worker therefore posts its timings and
its metric points to its own agent (``POST http://127.0.0.1:PORT/api/v1/jobs/{id}/telemetry``
and ``.../metrics``, the server's routes and bodies, ``EVENFLOW_TELEMETRY_RELAY`` in its
environment), which keeps them per job and posts each job's rows as one batch every
``flush_s`` with the agent's token (the server lets an agent post rows and points of the ranks
placed on its host)::

    worker --TelemetryBatch / MetricBatch--> relay (127.0.0.1, ephemeral port)
              <--Ack(accepted=n, duplicates=0) once the batch is in the spool (fsynced)
    relay  --one batch per job and kind--> server   every flush_s, or at once when urgent

What the relay acknowledges is never lost with the agent: with a :class:`~agent.spool.Spool`
(the daemon's is ``workdir/spool/<host name>``) a batch is appended and ``fdatasync``-ed before
the worker gets its answer, and leaves the spool only once the server took it (or refused it
for good). A relay started over an earlier agent's spool (:meth:`TelemetryRelay.start`) reads
it back, cutting off a torn tail, and posts it before it serves any worker; the server
deduplicates on (job, rank, iteration) and (job, name, rank, iteration), so what it had already
is not stored twice. A worker whose batch the relay cannot keep (the spool at its bound, the
disk refusing the write, ``max_rows`` of its job waiting) is answered 503: nothing was
acknowledged, so the worker keeps its rows and retries with back-off.

Only the agent's own workers may post: a batch is taken only with the credential the agent
handed to that job's rank at launch (:meth:`TelemetryRelay.grant`), for that rank's rows only
(else 403, JSON ``detail``), and is validated with the same contract model (else 422).

An ``urgent`` batch (an iteration time jumped) makes its job's rows go at once (after
``URGENT_WINDOW_S`` for its other ranks' batches of the same jump), marked urgent,
so the control plane still looks at the job without waiting. A failed post keeps its rows and
is retried with ``agent.backoff.Backoff``; a 409 (the job ended) drops the job's rows with a
log line, and its workers' later posts are answered 409, which stops them as the server's
answer would (until a rank of the job is granted here again: a new attempt). Rows the server
refuses for good (403, 404, 422) are dropped with a log line. A post never carries more than
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
from typing import cast

import httpx
from pydantic import ValidationError

from agent.backoff import Backoff
from agent.client import ApiError
from agent.spool import Key, Spool, SpoolFull
from contract.agent import (
    MetricAck,
    MetricBatch,
    MetricPoint,
    TelemetryAck,
    TelemetryBatch,
    TelemetryRecord,
)
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
TELEMETRY, METRICS = "telemetry", "metrics"
KINDS = (TELEMETRY, METRICS)
RETRY_AFTER_S = 2
"""What a 503 (the relay cannot keep a batch now) asks the worker to wait."""
_PATH = re.compile(r"^/api/v1/jobs/(\d{1,18})/(telemetry|metrics)$")

Item = TelemetryRecord | MetricPoint
Post = Callable[[int, TelemetryBatch], TelemetryAck]
"""Posts one job's batch to the control plane with the agent's token; raises on failure."""
PostMetrics = Callable[[int, MetricBatch], MetricAck]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _parse(kind: str, body: bytes) -> tuple[list[Item], bool]:
    """The rows or points of one worker post, and whether it is urgent (raises
    ``ValidationError``)."""
    if kind == TELEMETRY:
        batch = TelemetryBatch.model_validate_json(body)
        return list(batch.all_records()), batch.urgent
    return list(MetricBatch.model_validate_json(body).points), False


class TelemetryRelay:
    """Keeps the workers' telemetry and metrics per job (in memory and, with a ``spool``, on
    disk) and posts them in one batch per job and kind."""

    def __init__(
        self,
        post: Post,
        *,
        post_metrics: PostMetrics | None = None,
        spool: Spool | None = None,
        flush_s: float = 2.0,
        max_rows: int = 100_000,
        backoff: Backoff | None = None,
    ) -> None:
        if flush_s <= 0 or max_rows < 1:
            raise ValueError("flush_s must be positive and max_rows at least 1")
        self._post = post
        self._post_metrics = post_metrics
        """Without one, the relay takes no metrics (workers post them to the server)."""
        self.spool = spool
        self.flush_s = flush_s
        self.max_rows = max_rows
        """Rows (or points) kept per job and kind while the server cannot be reached; past it,
        workers are answered 503 and keep theirs."""
        self._backoff = backoff or Backoff(0.5, 30.0)
        self._cond = threading.Condition()
        self._sending = threading.Lock()  # one post at a time: a failed one puts rows back first
        self._grants: dict[str, tuple[int, int]] = {}  # token digest -> (job, rank)
        self._rows: dict[Key, deque[Item]] = {}
        self._urgent: set[int] = set()
        self._urgent_at = 0.0  # when the first of the urgent jobs became urgent
        self._ended: set[int] = set()
        self._retry_at = 0.0
        self._closing = False
        self.posts = self.rows_posted = self.rows_dropped = self.refused = self.recovered = 0
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []

    @property
    def relays_metrics(self) -> bool:
        return self._post_metrics is not None

    # ------------------------------------------------------------------ credentials
    def grant(self, job_id: int, rank: int, token: str) -> None:
        """Accept batches of ``rank`` of ``job_id`` sent with ``token`` (its worker credential);
        a job granted again (a new attempt) is no longer taken for ended."""
        with self._cond:
            self._grants[_digest(token)] = (job_id, rank)
            self._ended.discard(job_id)

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
        """Read back what an earlier agent's spool holds and try to post it, then listen on
        127.0.0.1 (an ephemeral port) and start the flusher; returns the URL."""
        if self.spool is not None:
            self._recover(self.spool)
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

    def _recover(self, spool: Spool) -> None:
        """Take on an earlier agent's spool and post it first (one try; the flusher retries)."""

        def count(key: Key, payload: bytes) -> int | None:
            if key[1] not in KINDS:
                return None
            try:
                return len(_parse(key[1], payload)[0])
            except ValidationError:
                return None

        records = spool.recover(count)
        with self._cond:
            for key, payload in records:
                self._rows.setdefault(key, deque()).extend(_parse(key[1], payload)[0])
            self.recovered = sum(len(rows) for rows in self._rows.values())
        if records or spool.torn:
            log.info(
                "spool: %d row(s) and point(s) of %d job(s) left by an earlier agent (%d torn "
                "tail(s) dropped); posting them first",
                self.recovered,
                len({job for job, _ in self._rows}),
                spool.torn,
            )
        self.flush_all()

    def accept(
        self, job_id: int, token: str, body: bytes, kind: str = TELEMETRY
    ) -> tuple[int, dict[str, object]]:
        """One worker post: (HTTP status, JSON answer). Keeps the rows when it may."""
        if kind == METRICS and not self.relays_metrics:
            return 404, {"detail": "this relay takes no metrics; post them to the server"}
        with self._cond:
            grant = self._grants.get(_digest(token))
        if grant is None:
            return 403, {"detail": "not a worker credential this agent handed out"}
        if grant[0] != job_id:
            return 403, {
                "detail": f"a credential of job {grant[0]} rank {grant[1]} may not post "
                f"{kind} for job {job_id}"
            }
        try:
            items, urgent = _parse(kind, body)
        except ValidationError as exc:
            return 422, {"detail": str(exc).splitlines()[0], "errors": json.loads(exc.json())}
        other = next((r.rank for r in items if r.rank != grant[1]), None)
        if other is not None:
            return 403, {"detail": f"a credential of rank {grant[1]} may not post rank {other}"}
        key = (job_id, kind)
        with self._cond:
            if job_id in self._ended:
                return 409, {"detail": f"job {job_id} has ended"}
            rows = self._rows.setdefault(key, deque())
            if len(rows) + len(items) > self.max_rows:
                return self._refuse(
                    f"the relay holds {len(rows)} {kind} item(s) of job {job_id} it could not "
                    f"post yet (at most {self.max_rows})"
                )
            if self.spool is not None:
                try:
                    self.spool.append(key, body, len(items))
                except (SpoolFull, OSError) as exc:
                    return self._refuse(f"the relay cannot keep the batch now: {exc}")
            rows.extend(items)
            if urgent:
                if not self._urgent:
                    self._urgent_at = time.monotonic()
                self._urgent.add(job_id)
                self._cond.notify_all()
        ack = TelemetryAck if kind == TELEMETRY else MetricAck
        return 200, ack(accepted=len(items), duplicates=0).model_dump()

    def _refuse(self, why: str) -> tuple[int, dict[str, object]]:
        """503: nothing taken, so nothing acknowledged; the worker keeps its rows and retries
        (the caller holds the lock)."""
        self.refused += 1
        if self.refused == 1 or self.refused % 100 == 0:
            log.warning("%s; workers are answered 503 (%d time(s) so far)", why, self.refused)
        return 503, {"detail": why, "retry_after_s": RETRY_AFTER_S}

    # ------------------------------------------------------------------ flushing
    def pending(self, job_id: int | None = None, kind: str | None = None) -> int:
        """Rows and points kept (of one job, of one kind, or of all)."""
        with self._cond:
            return sum(
                len(rows)
                for (job, k), rows in self._rows.items()
                if job_id in (None, job) and kind in (None, k)
            )

    def flush(self, job_id: int) -> bool:
        """Post the job's kept rows and points now; whether none is left (delivered, or dropped
        because the server will never take them). On a failure they stay kept."""
        with self._sending:
            for kind in KINDS:
                key = (job_id, kind)
                while True:
                    with self._cond:
                        rows = self._rows.get(key)
                        if not rows:
                            self._rows.pop(key, None)
                            if kind == TELEMETRY:
                                self._urgent.discard(job_id)
                            break
                        n = min(len(rows), MAX_TELEMETRY_RECORDS)
                        chunk = [rows.popleft() for _ in range(n)]
                        urgent = job_id in self._urgent
                    if not self._send(key, chunk, urgent):
                        return False
            return True

    def _send(self, key: Key, chunk: list[Item], urgent: bool) -> bool:
        job_id, kind = key
        try:
            if kind == TELEMETRY:
                self._post(
                    job_id,
                    TelemetryBatch.model_construct(
                        records=cast(list[TelemetryRecord], chunk), columns=None, urgent=urgent
                    ),
                )
            elif self._post_metrics is not None:
                self._post_metrics(
                    job_id, MetricBatch.model_construct(points=cast(list[MetricPoint], chunk))
                )
        except ApiError as exc:
            if exc.status_code == 409:
                self._drop_job(job_id, len(chunk), exc)
                return True
            if exc.status_code in DROPPED_FOR_GOOD:
                with self._cond:
                    self.rows_dropped += len(chunk)
                self._consumed(key, len(chunk))
                log.warning(
                    "dropped %d %s item(s) of job %d the server refused: %s",
                    len(chunk),
                    kind,
                    job_id,
                    exc,
                )
                return True
            return self._put_back(key, chunk, exc)
        except httpx.HTTPError as exc:
            return self._put_back(key, chunk, exc)
        self._consumed(key, len(chunk))
        with self._cond:
            self.posts += 1
            self.rows_posted += len(chunk)
            if urgent and kind == TELEMETRY:
                self._urgent.discard(job_id)
        return True

    def _consumed(self, key: Key, n: int) -> None:
        if self.spool is not None:
            self.spool.consumed(key, n)

    def _drop_job(self, job_id: int, in_flight: int, exc: ApiError) -> None:
        """The server takes nothing more of the job (it ended): drop what is kept of it, in
        memory and in the spool, and answer its workers 409."""
        with self._cond:
            self._ended.add(job_id)
            dropped = in_flight
            for kind in KINDS:
                dropped += len(self._rows.pop((job_id, kind), ()))
                if self.spool is not None:
                    self.spool.drop((job_id, kind))
            self.rows_dropped += dropped
            self._urgent.discard(job_id)
        log.info("job %d takes no more (%s); dropped its %d kept item(s)", job_id, exc, dropped)

    def _put_back(self, key: Key, chunk: list[Item], exc: Exception) -> bool:
        with self._cond:
            rows = self._rows.setdefault(key, deque())
            rows.extendleft(reversed(chunk))
            kept = len(rows)
        log.warning("%s of job %d not posted (%s); %d item(s) kept", key[1], key[0], exc, kept)
        return False

    def flush_all(self) -> bool:
        """Flush every job (stopping at the first failure); whether all got through."""
        with self._cond:
            jobs = sorted({job for job, _ in self._rows})
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
                jobs = sorted({job for job, _ in self._rows}) if periodic else list(self._urgent)
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
        endpoint; whether every row got through (what did not stays in the spool, for the
        next agent)."""
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
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if not delivered:
            where = "kept in the spool for the next agent" if self.spool else "lost"
            log.warning(
                "telemetry relay stopped with %d item(s) not posted: %s", self.pending(), where
            )
        if self.spool is not None:
            self.spool.close()
        return delivered


class _Handler(BaseHTTPRequestHandler):
    """The endpoint: ``POST /api/v1/jobs/{id}/telemetry`` (and ``.../metrics``) with a
    worker's Bearer token."""

    relay: TelemetryRelay
    protocol_version = "HTTP/1.1"  # keep-alive: a worker's client reuses its connection
    disable_nagle_algorithm = True  # the head and the body are two writes: without it the body
    # waits for the client's delayed ACK

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
            self._answer(
                404,
                {
                    "detail": "the relay serves POST /api/v1/jobs/{id}/telemetry and .../metrics only"
                },
            )
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            self._answer(401, {"detail": "a Bearer token is required"})
            return
        job_id, kind = int(match.group(1)), match.group(2)
        status, answer = self.relay.accept(job_id, token.strip(), body, kind)
        self._answer(status, answer)

    def _answer(self, status: int, answer: dict[str, object], close: bool = False) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 503:
            self.send_header("Retry-After", str(RETRY_AFTER_S))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("relay %s: " + format, self.address_string(), *args)
