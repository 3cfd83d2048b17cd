"""A job's live feed for the dashboard, as server-sent events.

``GET /api/v1/jobs/{id}/stream`` (viewer; the session cookie works) sends:

- ``telemetry``: ``{"columns": [...], "rows": [[...], ...]}``, the rows stored since the last
  message, ordered by iteration then rank;
- ``plan``: a new plan version (``PlanOut``);
- ``event``: a new straggler event (``EventOut``);
- ``job``: the job's status, frozen flag and plan version, whenever one changes;
- ``end``: the job has ended and everything has been sent; the client should close.

Every message's ``id`` is the cursor ``telemetry_id.plan_version.event_id``, so a browser's
automatic reconnection (``Last-Event-ID``) resumes where it stopped. The stream wakes at once
when this process stores the job's telemetry (``server.live``), polls the database every
``POLL_S`` otherwise (for rows written by other processes), sends at most one telemetry
message per ``MIN_GAP_S`` (bursts are batched), and ends after ``max_s`` seconds or when the
client goes away; browsers reconnect by themselves.

It is left out of the OpenAPI schema: a schema-driven client (or fuzzer) would wait on it for
its whole duration.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from contract.agent import PlanOut
from contract.api import EventOut
from contract.enums import JobStatus
from server.api.deps import Context, Viewer
from server.context import AppContext
from server.errors import NotFound
from server.models import Job, Plan
from server.services import series

router = APIRouter(prefix="/jobs", tags=["dashboard"])
JobId = Path(ge=1, le=2**31 - 1)

POLL_S = 0.25
MIN_GAP_S = 0.05
PING_S = 15.0
MAX_ROWS = 20_000
SETTLE_S = 2.0
"""PostgreSQL hands out ids before commit, so a row may become visible after one with a higher
id. There, rows stay re-readable for this long before the cursor passes them."""


@dataclass
class Cursor:
    """Where a stream stands: the last telemetry row, plan version and event it sent."""

    telemetry: int
    plan_version: int
    event: int
    settle_s: float = 0.0
    recent: dict[int, float] = field(default_factory=dict)
    """Telemetry ids above ``telemetry`` already sent, and when (out-of-order commits)."""
    status: str | None = None
    frozen: bool | None = None

    def token(self) -> str:
        return f"{self.telemetry}.{self.plan_version}.{self.event}"

    def fresh(self, rows: list[tuple[int, list[Any]]], now: float) -> list[list[Any]]:
        """The rows not sent yet; advances the cursor past rows old enough to have settled."""
        new = [row for rid, row in rows if rid not in self.recent]
        for rid, _ in rows:
            self.recent.setdefault(rid, now)
        if self.settle_s <= 0:
            if rows:
                self.telemetry = max(self.telemetry, rows[-1][0])
            self.recent.clear()
            return new
        settled = [rid for rid, seen in self.recent.items() if now - seen >= self.settle_s]
        if settled:
            self.telemetry = max(self.telemetry, max(settled))
            self.recent = {r: s for r, s in self.recent.items() if r > self.telemetry}
        return new


def _parse_cursor(raw: str | None) -> tuple[int, int, int] | None:
    try:
        t, p, e = (int(x) for x in (raw or "").split("."))
    except ValueError:
        return None
    return (t, p, e) if min(t, p, e) >= 0 else None


@router.get("/{job_id}/stream", include_in_schema=False)
async def stream(
    request: Request,
    context: Context,
    _: Viewer,
    job_id: int = JobId,
    after: int | None = Query(None, ge=0, le=2**63 - 1),
    plan_version: int | None = Query(None, ge=0, le=2**31 - 1),
    event_after: int | None = Query(None, ge=0, le=2**31 - 1),
    max_s: float = Query(60.0, gt=0, le=3600),
    last_event_id: str | None = Header(None, max_length=100),
) -> StreamingResponse:
    """Live telemetry, plans, events and job state of one job (server-sent events)."""
    sessions = context.sessions
    resumed = _parse_cursor(last_event_id)
    if resumed is not None:
        after, plan_version, event_after = resumed
    cursor = await run_in_threadpool(_open, sessions, job_id, after, plan_version, event_after)
    return StreamingResponse(
        _events(request, context, job_id, cursor, max_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _open(
    sessions: sessionmaker[Session],
    job_id: int,
    after: int | None,
    plan_version: int | None,
    event_after: int | None,
) -> Cursor:
    with sessions() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found")
        return Cursor(
            telemetry=series.max_telemetry_id(s, job_id) if after is None else after,
            plan_version=(job.plan_version or 0) if plan_version is None else plan_version,
            event=series.max_event_id(s, job_id) if event_after is None else event_after,
            settle_s=SETTLE_S if s.get_bind().dialect.name == "postgresql" else 0.0,
        )


def _message(kind: str, data: Any, cursor: Cursor) -> str:
    body = json.dumps(data, separators=(",", ":"), default=str)
    return f"event: {kind}\nid: {cursor.token()}\ndata: {body}\n\n"


def _poll(sessions: sessionmaker[Session], job_id: int, cursor: Cursor) -> tuple[list[str], bool]:
    """Everything new since ``cursor`` as SSE messages (advancing it), and whether the job has
    ended with nothing left to send."""
    out: list[str] = []
    now = time.monotonic()
    with sessions() as s:
        job = s.get(Job, job_id)
        if job is None:
            return [_message("end", {"reason": "job deleted"}, cursor)], True
        rows = series.rows_after(s, job_id, cursor.telemetry, MAX_ROWS)
        fresh = cursor.fresh(rows, now)
        if fresh:
            fresh.sort(key=lambda r: (r[1], r[0]))
            body = {"columns": series.STREAM_COLUMNS, "rows": fresh}
            out.append(_message("telemetry", body, cursor))
        if (job.plan_version or 0) > cursor.plan_version:
            for plan in s.scalars(
                select(Plan)
                .where(Plan.job_id == job_id, Plan.version > cursor.plan_version)
                .order_by(Plan.version)
            ):
                cursor.plan_version = plan.version
                payload = PlanOut.model_validate(plan).model_dump(mode="json")
                out.append(_message("plan", payload, cursor))
        for ev in series.events_after(s, job_id, cursor.event):
            cursor.event = ev.id
            out.append(
                _message("event", EventOut.model_validate(ev).model_dump(mode="json"), cursor)
            )
        if (job.status, job.frozen) != (cursor.status, cursor.frozen):
            cursor.status, cursor.frozen = job.status, job.frozen
            state = {"status": job.status, "frozen": job.frozen, "plan_version": job.plan_version}
            out.append(_message("job", state, cursor))
        done = JobStatus(job.status).terminal and len(rows) < MAX_ROWS and not cursor.recent
    return out, done


async def _events(
    request: Request, context: AppContext, job_id: int, cursor: Cursor, max_s: float
) -> AsyncIterator[str]:
    sessions, notifier = context.sessions, context.telemetry_notifier
    deadline = time.monotonic() + max_s
    with notifier.watch(job_id) as waiter:
        yield "retry: 1000\n\n"
        last_sent = last_ping = time.monotonic()
        while True:
            messages, done = await run_in_threadpool(_poll, sessions, job_id, cursor)
            for message in messages:
                yield message
            now = time.monotonic()
            if messages:
                last_sent = last_ping = now
            if done:
                yield _message("end", {"reason": "job ended"}, cursor)
                return
            if now >= deadline or await request.is_disconnected():
                return
            if now - last_ping >= PING_S:
                yield ": ping\n\n"
                last_ping = now
            await waiter.wait(min(POLL_S, max(0.0, deadline - now)))
            # Batch a burst of ingests (many hosts posting the same iteration) into one message.
            gap = MIN_GAP_S - (time.monotonic() - last_sent)
            if gap > 0:
                await asyncio.sleep(gap)
