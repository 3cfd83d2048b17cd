"""Hosts register with their devices and send heartbeats; people list them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from contract.agent import Heartbeat, HeartbeatAck, HostRegister
from contract.api import HostOut, Page
from server.api import raw
from server.api.bodies import JSONRoute, documented_body
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
    # slots, and hosts left waiting there would be marked lost.
    context.liveness.owned(host.id, principal.token_id)
    return HostOut.model_validate(host)


@raw.post(
    "/hosts/{host_id}/heartbeat",
    tags=["hosts"],
    response_model=HeartbeatAck,
    openapi_extra=documented_body(Heartbeat),
    responses=declare(409),
)
async def heartbeat(
    request: Request, context: Context, principal: Authenticated, host_id: PathId
) -> bytes:
    """Report liveness and worker states; the answer lists the ranks this host must run or stop."""
    return await context.paths.heartbeat(host_id, await request.body(), principal)


@router.get("")
def list_hosts(session: SessionDep, _: Viewer, paging: PagingDep) -> Page[HostOut]:
    """Hosts with their devices, by id."""
    rows, total = hosts.list_hosts(session, paging)
    return Page(items=[HostOut.model_validate(h) for h in rows], total=total)


@router.get("/{host_id}")
def get_host(session: SessionDep, _: Viewer, host_id: PathId) -> HostOut:
    """One host with its devices."""
    return HostOut.model_validate(hosts.get(session, host_id))
