"""API tokens (admin only)."""

from __future__ import annotations

from fastapi import APIRouter

from contract.api import Page, TokenCreate, TokenCreated, TokenOut
from server.api.bodies import JSONRoute
from server.api.deps import Admin, PagingDep, PathId, SessionDep
from server.api.statuses import declare
from server.services import tokens

router = APIRouter(prefix="/tokens", tags=["tokens"], route_class=JSONRoute)


@router.post("", status_code=201, responses=declare(409))
def create_token(req: TokenCreate, session: SessionDep, principal: Admin) -> TokenCreated:
    """Create a token; its secret is in this answer and nowhere else."""
    row, secret = tokens.create(session, req, by=principal.name)
    return TokenCreated.model_validate(
        {**TokenOut.model_validate(row).model_dump(), "token": secret}
    )


@router.get("")
def list_tokens(session: SessionDep, _: Admin, paging: PagingDep) -> Page[TokenOut]:
    """Tokens by id, revoked ones included (never their secrets)."""
    rows, total = tokens.list_tokens(session, paging)
    return Page(items=[TokenOut.model_validate(t) for t in rows], total=total)


@router.delete("/{token_id}")
def revoke_token(session: SessionDep, principal: Admin, token_id: PathId) -> TokenOut:
    """Revoke a token; it stops working at once."""
    return TokenOut.model_validate(tokens.revoke(session, token_id, by=principal.name))
