"""Hosts register with their devices and send heartbeats; people list them."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from contract.agent import Heartbeat, HeartbeatAck, HostRegister
from contract.api import HostOut, Page
from contract.enums import HostStatus, WorkerState
from server.api.bodies import JSONRoute
from server.api.deps import (
    Authenticated,
    Context,
    Now,
    PagingDep,
    PathId,
    SessionDep,
    SettingsDep,
    Viewer,
)
from server.api.gate import RAW_BODY_STATE
from server.scale.heartbeat_groups import Beat
from server.api.statuses import declare
from server.services import hosts

router = APIRouter(prefix="/hosts", tags=["hosts"], route_class=JSONRoute)


@router.post("/register", status_code=201, responses=declare(409))
def register(
    req: HostRegister,
    session: SessionDep,
    context: Context,
    principal: Authenticated,
    now: Now,
    settings: SettingsDep,
) -> HostOut:
    """Register (or refresh) a host and its devices; refused with 409 on a protocol mismatch,
    or while another agent instance holds the host and heartbeats (unless `replace`)."""
    live_after_s = settings.host_lost_after_s
    host = hosts.register(session, req, principal, now, live_after_s=live_after_s)
    # Its heartbeats are noted on arrival from the first, not only once one has been answered
    # by the database: a fleet registering at once queues its first heartbeats for database
    # slots, and 1,250 hosts so waiting were marked lost (bench/fleet.py).
    context.liveness.owned(host.id, principal.token_id)
    return HostOut.model_validate(host)


@router.post("/{host_id}/heartbeat", response_model=HeartbeatAck, responses=declare(409))
async def heartbeat(
    req: Heartbeat,
    context: Context,
    principal: Authenticated,
    now: Now,
    host_id: PathId,
    request: Request,
) -> Response:
    """Report liveness and worker states; the answer lists the ranks this host must run or stop."""
    answers = context.host_answers
    raw = request.scope.get("state", {}).get(RAW_BODY_STATE)  # a repeat is answered there
    body = answers.get(host_id, req, principal, raw)
    if body is not None:  # steady: the same report, nothing changed (``server.scale.host_answers``)
        context.liveness.seen(host_id, now)
        context.metrics.heartbeat_answers.labels("memory").inc()
        return Response(body, media_type="application/json")
    context.metrics.heartbeat_answers.labels("database").inc()
    context.metrics.heartbeat_misses.labels(answers.why_missed(host_id, req, principal)).inc()
    generation = answers.generation(host_id)
    worked = await context.heartbeat_groups.work_out(
        Beat(
            host_id,
            lambda session: hosts.heartbeat(session, host_id, req, principal, now),
            now,
            alone=any(r.state is WorkerState.FAILED for r in req.workers),
        )
    )
    ack, fewer_alike, _ = worked.answered
    context.liveness.seen(host_id, now)  # written with the next batch, as from memory
    context.liveness.owned(host_id, principal.token_id)  # its next heartbeats noted on arrival
    body = ack.model_dump_json().encode()
    own = worked.own  # None: a heartbeat after it in its group changed its host
    if any(a.worker_token for a in ack.assignments):
        answers.launched(host_id)  # never repeated: each credential retires the last
    elif own is not None and ack.status is HostStatus.ACTIVE:
        answers.put(
            host_id,
            req,
            principal,
            body,
            generation,
            raw=raw,
            own=own,
            fewer_alike=fewer_alike,
        )
    return Response(body, media_type="application/json")


@router.get("")
def list_hosts(session: SessionDep, _: Viewer, paging: PagingDep) -> Page[HostOut]:
    """Hosts with their devices, by id."""
    rows, total = hosts.list_hosts(session, paging)
    return Page(items=[HostOut.model_validate(h) for h in rows], total=total)


@router.get("/{host_id}")
def get_host(session: SessionDep, _: Viewer, host_id: PathId) -> HostOut:
    """One host with its devices."""
    return HostOut.model_validate(hosts.get(session, host_id))
