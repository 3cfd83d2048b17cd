"""A job's live feed for the dashboard stream (``server.api.routes.stream``): what is new since
a cursor, read from the database. The route frames it as server-sent events and paces it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from contract.agent import PlanOut
from contract.api import EventOut
from contract.enums import JobStatus
from server.errors import NotFound
from server.models import Job
from server.services import plans, series

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


@dataclass(frozen=True)
class FeedMessage:
    """One message of the feed: its kind, its JSON-ready data and the cursor after it."""

    kind: str
    data: Any
    cursor: str


def open_cursor(
    session: Session,
    job_id: int,
    after: int | None,
    plan_version: int | None,
    event_after: int | None,
) -> Cursor:
    """A cursor at the given positions, or at what the job has now for those left out."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return Cursor(
        telemetry=series.max_telemetry_id(session, job_id) if after is None else after,
        plan_version=(job.plan_version or 0) if plan_version is None else plan_version,
        event=series.max_event_id(session, job_id) if event_after is None else event_after,
        settle_s=SETTLE_S if session.get_bind().dialect.name == "postgresql" else 0.0,
    )


def poll(session: Session, job_id: int, cursor: Cursor) -> tuple[list[FeedMessage], bool]:
    """Everything new since ``cursor`` (advancing it), and whether the job has ended with
    nothing left to send."""
    job = session.get(Job, job_id)
    if job is None:
        return [FeedMessage("end", {"reason": "job deleted"}, cursor.token())], True
    out: list[FeedMessage] = []
    rows = series.rows_after(session, job_id, cursor.telemetry, MAX_ROWS)
    fresh = cursor.fresh(rows, time.monotonic())
    if fresh:
        fresh.sort(key=lambda r: (r[1], r[0]))
        body = {"columns": series.STREAM_COLUMNS, "rows": fresh}
        out.append(FeedMessage("telemetry", body, cursor.token()))
    if (job.plan_version or 0) > cursor.plan_version:
        for plan in plans.after(session, job_id, cursor.plan_version):
            cursor.plan_version = plan.version
            payload = PlanOut.model_validate(plan).model_dump(mode="json")
            out.append(FeedMessage("plan", payload, cursor.token()))
    for ev in series.events_after(session, job_id, cursor.event):
        cursor.event = ev.id
        payload = EventOut.model_validate(ev).model_dump(mode="json")
        out.append(FeedMessage("event", payload, cursor.token()))
    if (job.status, job.frozen) != (cursor.status, cursor.frozen):
        cursor.status, cursor.frozen = job.status, job.frozen
        state = {
            "status": job.status,
            "frozen": job.frozen,
            "plan_version": job.plan_version,
            "pending_reason": job.pending_reason,
        }
        out.append(FeedMessage("job", state, cursor.token()))
    done = JobStatus(job.status).terminal and len(rows) < MAX_ROWS and not cursor.recent
    return out, done
