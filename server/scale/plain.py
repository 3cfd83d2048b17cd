"""The plain path (``server.scale``): each heartbeat and telemetry post on its own.

What the fast paths must be indistinguishable from: no answer kept, no group, no batch. A
heartbeat is parsed and worked out in a transaction of its own, which writes its host's time
too; the jobs its reports may have moved on are advanced once that has committed, as the
groups do. A telemetry post is judged and stored in a transaction of its own.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import update

from contract.agent import Heartbeat
from server.api.bodies import parse
from server.db import run_retrying
from server.models import Host
from server.scale import AgentPaths
from server.scale.heartbeat_groups import TRANSACTION_ATTEMPTS
from server.services import hosts, rank_reports, telemetry

if TYPE_CHECKING:
    from server.context import AppContext
    from server.services.telemetry import Post
    from server.services.tokens import Principal


class PlainPaths(AgentPaths):
    """Every heartbeat and telemetry post in a database slot, a worker thread and a
    transaction of its own."""

    def __init__(self, context: AppContext) -> None:
        self.context = context

    async def heartbeat(self, host_id: int, raw: bytes, principal: Principal) -> bytes:
        heartbeat = parse(Heartbeat, raw)
        now = datetime.now(UTC)
        async with self.context.db_slots.take(first=False):
            answered = await run_in_threadpool(self._work_out, host_id, heartbeat, principal, now)
        return answered.ack.model_dump_json().encode()

    def _work_out(
        self, host_id: int, heartbeat: Heartbeat, principal: Principal, now: datetime
    ) -> hosts.Answered:
        context = self.context

        def once() -> hosts.Answered:
            with context.transaction(write=True) as session:
                answered = hosts.heartbeat(session, host_id, heartbeat, principal, now)
                session.execute(
                    update(Host)
                    .where(Host.id == host_id, Host.last_heartbeat < now)
                    .values(last_heartbeat=now)
                )
                return answered

        answered = run_retrying(once, TRANSACTION_ATTEMPTS, "heartbeat")
        if answered.to_advance:

            def advance() -> None:
                with context.transaction(write=True) as session:
                    ready = rank_reports.ready_to_advance(session, answered.to_advance)
                    rank_reports.advance_jobs(session, ready, now)

            run_retrying(advance, TRANSACTION_ATTEMPTS, "jobs advanced by a heartbeat")
        return answered

    async def telemetry(self, post: Post) -> tuple[int, int]:
        async with self.context.db_slots.take():
            return await run_in_threadpool(self._store, post)

    def _store(self, post: Post) -> tuple[int, int]:
        context = self.context
        with context.write_lock, context.engine.begin() as conn:
            outcome = telemetry.ingest_many(conn, [post])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
