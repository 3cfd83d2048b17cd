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
client goes away; browsers reconnect by themselves. One token holds at most
``Settings.max_streams_per_token`` streams open at once per server process (429 past it).

It is left out of the OpenAPI schema: a schema-driven client (or fuzzer) would wait on it for
its whole duration.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Receive, Scope, Send

from server.api.bodies import JSONRoute
from server.api.deps import Context, PathId, Viewer
from server.context import AppContext
from server.errors import TooMany
from server.services import feed
from server.services.feed import Cursor

router = APIRouter(prefix="/jobs", tags=["dashboard"], route_class=JSONRoute)

POLL_S = 0.25
MIN_GAP_S = 0.05
PING_S = 15.0


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
    principal: Viewer,
    job_id: PathId,
    after: int | None = Query(None, ge=0, le=2**63 - 1),
    plan_version: int | None = Query(None, ge=0, le=2**31 - 1),
    event_after: int | None = Query(None, ge=0, le=2**31 - 1),
    max_s: float = Query(60.0, gt=0, le=3600),
    last_event_id: str | None = Header(None, max_length=100),
) -> StreamingResponse:
    """Live telemetry, plans, events and job state of one job (server-sent events); 429 past
    the token's cap of open streams."""
    slots, token = context.stream_slots, principal.token_id
    if not slots.take(token):
        raise TooMany(
            f"token '{principal.name}' already holds {slots.cap} live streams, the most one "
            "token may (EVENFLOW_MAX_STREAMS_PER_TOKEN); close one first"
        )
    try:
        resumed = _parse_cursor(last_event_id)
        if resumed is not None:
            after, plan_version, event_after = resumed
        cursor = await run_in_threadpool(
            _open, context.sessions, job_id, after, plan_version, event_after
        )
    except BaseException:
        slots.give_back(token)
        raise
    return _SlotStream(
        _events(request, context, job_id, cursor, max_s),
        release=lambda: slots.give_back(token),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _SlotStream(StreamingResponse):
    """A stream that gives its slot back when it ends, however it ends (the client left, the
    server stopped, or the body never started)."""

    def __init__(self, content: AsyncIterator[str], *, release: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _open(
    sessions: sessionmaker[Session],
    job_id: int,
    after: int | None,
    plan_version: int | None,
    event_after: int | None,
) -> Cursor:
    with sessions() as session:
        return feed.open_cursor(session, job_id, after, plan_version, event_after)


def _message(kind: str, data: Any, cursor: str) -> str:
    body = json.dumps(data, separators=(",", ":"), default=str)
    return f"event: {kind}\nid: {cursor}\ndata: {body}\n\n"


def _poll(sessions: sessionmaker[Session], job_id: int, cursor: Cursor) -> tuple[list[str], bool]:
    """Everything new since ``cursor`` as SSE messages (advancing it), and whether the job has
    ended with nothing left to send."""
    with sessions() as session:
        messages, done = feed.poll(session, job_id, cursor)
    return [_message(m.kind, m.data, m.cursor) for m in messages], done


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
                yield _message("end", {"reason": "job ended"}, cursor.token())
                return
            # At its deadline, or when this server stops, the stream closes and the browser
            # reconnects after ``retry`` (to another server, or this one back).
            if now >= deadline or context.stopping or await request.is_disconnected():
                return
            if now - last_ping >= PING_S:
                yield ": ping\n\n"
                last_ping = now
            await waiter.wait(min(POLL_S, max(0.0, deadline - now)))
            # Batch a burst of ingests (many hosts posting the same iteration) into one message.
            gap = MIN_GAP_S - (time.monotonic() - last_sent)
            if gap > 0:
                await asyncio.sleep(gap)
