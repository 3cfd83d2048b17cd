"""The fast paths (``server.scale``): what answers a fleet's heartbeats and telemetry posts."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from contract.agent import Heartbeat
from contract.enums import HostStatus, WorkerState
from server.api.bodies import parse
from server.scale import AgentPaths
from server.scale.heartbeat_groups import Beat
from server.services import hosts

if TYPE_CHECKING:
    from server.context import AppContext
    from server.services.telemetry import Post
    from server.services.tokens import Principal


class FastPaths(AgentPaths):
    """Heartbeats answered from memory while nothing they depend on changed, else worked out
    in groups; telemetry posts written in groups by the writer thread."""

    def __init__(self, context: AppContext) -> None:
        self.context = context
        answers = context.metrics.heartbeat_answers
        self._from_memory, self._from_database = (
            answers.labels("memory"),
            answers.labels("database"),
        )
        """The answers' counters, looked up once: a label lookup per heartbeat costs more than
        the count."""

    async def heartbeat(self, host_id: int, raw: bytes, principal: Principal) -> bytes:
        """The one place a heartbeat is answered: from memory on a cache hit, else in the
        database. Its host counts as alive from its arrival to its answer (``Liveness``)."""
        liveness = self.context.liveness
        alive = liveness.arrived(host_id, principal.token_id, datetime.now(UTC))
        try:
            return await self._answer(host_id, raw, principal)
        finally:
            if alive:
                liveness.answered(host_id, datetime.now(UTC))

    async def _answer(self, host_id: int, raw: bytes, principal: Principal) -> bytes:
        context = self.context
        answers = context.host_answers
        body = answers.get_raw(host_id, raw, principal)  # the same bytes: not even parsed
        if body is None:
            heartbeat = parse(Heartbeat, raw)
            now = datetime.now(UTC)
            body = answers.get(host_id, heartbeat, principal, raw)  # the same report reworded
            if body is None:
                return await self._worked_out(host_id, heartbeat, raw, principal, now)
            context.liveness.seen(host_id, now)
        self._from_memory.inc()
        return body

    async def _worked_out(
        self, host_id: int, heartbeat: Heartbeat, raw: bytes, principal: Principal, now: datetime
    ) -> bytes:
        """A cache miss: worked out in the database (in a group), its answer kept when its
        commit alone changed its host."""
        context = self.context
        answers, metrics = context.host_answers, context.metrics
        self._from_database.inc()
        metrics.heartbeat_misses.labels(answers.why_missed(host_id, heartbeat, principal)).inc()
        generation = answers.generation(host_id)
        worked = await context.heartbeat_groups.work_out(
            Beat(
                host_id,
                lambda session: hosts.heartbeat(session, host_id, heartbeat, principal, now),
                now,
                alone=any(r.state is WorkerState.FAILED for r in heartbeat.workers),
            )
        )
        ack, fewer_alike, _ = worked.answered
        context.liveness.seen(host_id, now)  # written with the next batch, as from memory
        context.liveness.owned(host_id, principal.token_id)  # its next ones noted on arrival
        body = ack.model_dump_json().encode()
        own = worked.own  # None: a heartbeat after it in its group changed its host
        if any(a.worker_token for a in ack.assignments):
            answers.launched(host_id)  # never repeated: each credential retires the last
        elif own is not None and ack.status is HostStatus.ACTIVE:
            answers.put(
                host_id,
                heartbeat,
                principal,
                body,
                generation,
                raw=raw,
                own=own,
                fewer_alike=fewer_alike,
            )
        return body

    async def telemetry(self, post: Post) -> tuple[int, int]:
        """Stored with the other posts that arrive together, in one transaction (no database
        slot or worker thread of this request's own: the writer's thread does the work)."""
        return await self.context.telemetry_writer.store(post)
