"""API tokens: creation, revocation and authentication. Secrets are stored as SHA-256 only
(tokens are 256-bit random values, so a fast hash is enough)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from contract.api import TokenCreate
from contract.enums import Role
from server.cache import mark_tokens_changed
from server.errors import Conflict, Forbidden, NotFound, Unauthorized
from server.models import ApiToken, utcnow
from server.services.audit import record

TOKEN_PREFIX = "ef_"

# Which roles satisfy a requirement. Agent tokens read like viewers but are not operators.
SATISFIES: dict[Role, frozenset[Role]] = {
    Role.VIEWER: frozenset({Role.VIEWER, Role.OPERATOR, Role.ADMIN, Role.AGENT}),
    Role.OPERATOR: frozenset({Role.OPERATOR, Role.ADMIN}),
    Role.ADMIN: frozenset({Role.ADMIN}),
    Role.AGENT: frozenset({Role.AGENT}),
}


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name, role and (for agents) host."""

    token_id: int
    name: str
    role: Role
    host: str | None = None

    def require(self, role: Role) -> None:
        if self.role not in SATISFIES[role]:
            raise Forbidden(
                f"this needs the {role.value} role; token '{self.name}' is {self.role.value}"
            )


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def require_secret(secret: str | None) -> str:
    if not secret:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return secret


def authenticate(session: Session, secret: str | None) -> Principal:
    secret = require_secret(secret)
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == hash_token(secret))).first()
    return _principal(row)


def _principal(row: ApiToken | None) -> Principal:
    if row is None:
        raise Unauthorized("unknown token")
    if row.revoked_at is not None:
        raise Unauthorized(f"token '{row.name}' was revoked")
    return Principal(token_id=row.id, name=row.name, role=Role(row.role), host=row.host)


def authenticate_hashes(
    sessions: sessionmaker[Session], hashes: list[str]
) -> dict[str, Principal | Exception]:
    """Many tokens (by hash) in one query, in a session of its own: each hash's principal, or
    the ``Unauthorized`` its request gets."""
    with sessions() as session:
        rows = {
            row.token_hash: row
            for row in session.scalars(select(ApiToken).where(ApiToken.token_hash.in_(hashes)))
        }
    out: dict[str, Principal | Exception] = {}
    for h in hashes:
        try:
            out[h] = _principal(rows.get(h))
        except Unauthorized as exc:
            out[h] = exc
    return out


def authenticate_with(sessions: sessionmaker[Session], secret: str | None) -> Principal:
    """Authenticate in a session of its own."""
    with sessions() as session:
        return authenticate(session, secret)


def create(
    session: Session, req: TokenCreate, *, by: str, secret: str | None = None
) -> tuple[ApiToken, str]:
    """Store a new token; returns the row and the secret (shown once)."""
    if req.role is Role.AGENT and req.host is None:
        raise Conflict("agent tokens are bound to a host: give 'host'", field="host")
    if req.role is not Role.AGENT and req.host is not None:
        raise Conflict("only agent tokens are bound to a host", field="host")
    secret = secret or new_secret()
    row = ApiToken(
        name=req.name,
        role=req.role.value,
        token_hash=hash_token(secret),
        prefix=secret[: len(TOKEN_PREFIX) + 4],
        host=req.host,
        created_by=by,
    )
    session.add(row)
    session.flush()
    record(
        session, by, "token.create", f"token:{row.id}", {"name": req.name, "role": req.role.value}
    )
    return row, secret


def revoke(session: Session, token_id: int, *, by: str) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"token {token_id} not found")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        mark_tokens_changed(session)
        record(session, by, "token.revoke", f"token:{row.id}", {"name": row.name})
    return row


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def ensure_admin(session: Session, secret: str | None) -> str | None:
    """Make sure an admin can log in. With ``secret`` (EVENFLOW_ADMIN_TOKEN) that token exists;
    without it, a token is generated only if no admin exists yet. Returns a newly generated
    secret, to be printed once, or None."""
    if secret is not None:
        if session.scalars(
            select(ApiToken).where(ApiToken.token_hash == hash_token(secret))
        ).first():
            return None
        create(
            session,
            TokenCreate(name="bootstrap-admin", role=Role.ADMIN),
            by="system",
            secret=secret,
        )
        return None
    live_admin = session.scalars(
        select(ApiToken).where(ApiToken.role == Role.ADMIN.value, ApiToken.revoked_at.is_(None))
    ).first()
    if live_admin is not None:
        return None
    _, generated = create(
        session, TokenCreate(name="bootstrap-admin", role=Role.ADMIN), by="system"
    )
    return generated
