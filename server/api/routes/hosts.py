"""Hosts register with their devices and send heartbeats; people list them."""

from __future__ import annotations

from fastapi import APIRouter

from contract.agent import Heartbeat, HeartbeatAck, HostRegister
from contract.api import HostOut, Page
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
    in_transaction,
)
from server.api.statuses import declare
from server.services import hosts

router = APIRouter(prefix="/hosts", tags=["hosts"], route_class=JSONRoute)


@router.post("/register", status_code=201, responses=declare(409))
def register(
    req: HostRegister,
    session: SessionDep,
    principal: Authenticated,
    now: Now,
    settings: SettingsDep,
) -> HostOut:
    """Register (or refresh) a host and its devices; refused with 409 on a protocol mismatch,
    or while another agent instance holds the host and heartbeats (unless `replace`)."""
    live_after_s = settings.host_lost_after_s
    return HostOut.model_validate(
        hosts.register(session, req, principal, now, live_after_s=live_after_s)
    )


@router.post("/{host_id}/heartbeat", responses=declare(409))
async def heartbeat(
    req: Heartbeat, context: Context, principal: Authenticated, now: Now, host_id: PathId
) -> HeartbeatAck:
    """Report liveness and worker states; the answer lists the ranks this host must run or stop."""
    return await in_transaction(
        context, lambda session: hosts.heartbeat(session, host_id, req, principal, now)
    )


@router.get("")
def list_hosts(session: SessionDep, _: Viewer, paging: PagingDep) -> Page[HostOut]:
    """Hosts with their devices, by id."""
    rows, total = hosts.list_hosts(session, paging)
    return Page(items=[HostOut.model_validate(h) for h in rows], total=total)


@router.get("/{host_id}")
def get_host(session: SessionDep, _: Viewer, host_id: PathId) -> HostOut:
    """One host with its devices."""
    return HostOut.model_validate(hosts.get(session, host_id))
