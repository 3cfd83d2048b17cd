"""API tokens: creation, revocation and authentication. Secrets are stored as SHA-256 only
(tokens are 256-bit random values, so a fast hash is enough).

Two kinds of secret: API tokens (``ef_...``, rows of ``api_tokens``: people, scripts and agents)
and worker credentials (``efw_...``, the ``token_hash`` of one rank in ``workers``), minted by
:func:`mint_worker_token` when a rank is handed to its agent and valid while its job lives."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session, object_session, sessionmaker

from contract.api import TokenCreate
from contract.enums import JobStatus, Role
from server.errors import Conflict, Forbidden, NotFound, Unauthorized
from server.models import ApiToken, Job, Worker, utcnow
from server.scale.cache import mark_tokens_changed
from server.services.audit import record
from server.services.paging import Paging, page

TOKEN_PREFIX = "ef_"
BOOTSTRAP_ADMIN = "bootstrap-admin"
"""The name of the admin token the server makes at start-up (``ensure_admin``)."""
WORKER_PREFIX = "efw_"
"""Worker credentials start with this, so they are looked up among workers, not tokens."""

# Which roles satisfy a requirement. Agent tokens read like viewers but are not operators;
# worker credentials satisfy none but their own (their rights are per job and rank).
SATISFIES: dict[Role, frozenset[Role]] = {
    Role.VIEWER: frozenset({Role.VIEWER, Role.OPERATOR, Role.ADMIN, Role.AGENT}),
    Role.OPERATOR: frozenset({Role.OPERATOR, Role.ADMIN}),
    Role.ADMIN: frozenset({Role.ADMIN}),
    Role.AGENT: frozenset({Role.AGENT}),
    Role.WORKER: frozenset({Role.WORKER}),
}


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name, role, (for agents) host and (for workers) job and
    rank."""

    token_id: int
    name: str
    role: Role
    host: str | None = None
    job_id: int | None = None
    rank: int | None = None

    def require(self, role: Role) -> None:
        if self.role is Role.WORKER:
            raise Forbidden(
                f"'{self.name}' is a worker credential: it may only read job {self.job_id}'s "
                f"plan and spec and post rank {self.rank}'s telemetry; this needs the "
                f"{role.value} role"
            )
        if self.role not in SATISFIES[role]:
            raise Forbidden(
                f"this needs the {role.value} role; token '{self.name}' is {self.role.value}"
            )

    def require_job_reader(self, job_id: int) -> None:
        """Viewers read every job; a worker credential only its own job."""
        if self.role is Role.WORKER:
            if self.job_id != job_id:
                raise Forbidden(
                    f"'{self.name}' is a worker credential of job {self.job_id}; it may not "
                    f"read job {job_id}"
                )
            return
        self.require(Role.VIEWER)


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
    if secret.startswith(WORKER_PREFIX):
        return _authenticate_worker(session, secret)
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == hash_token(secret))).first()
    return _principal(row)


def _principal(row: Any) -> Principal:
    """The principal of an ``api_tokens`` row (an entity, or a row of :data:`_TOKEN_QUERY`)."""
    if row is None:
        raise Unauthorized("unknown token")
    if row.revoked_at is not None:
        raise Unauthorized(f"token '{row.name}' was revoked")
    return Principal(token_id=row.id, name=row.name, role=Role(row.role), host=row.host)


def cache_key(secret: str) -> str:
    """What the token cache keys a credential by: its hash, marked when it is a worker's."""
    kind = "worker:" if secret.startswith(WORKER_PREFIX) else "api:"
    return kind + hash_token(secret)


_TOKEN_QUERY = select(
    ApiToken.token_hash,
    ApiToken.id,
    ApiToken.name,
    ApiToken.role,
    ApiToken.host,
    ApiToken.revoked_at,
)
_WORKER_QUERY = select(Worker.token_hash, Worker.id, Worker.job_id, Worker.rank, Job.status).join(
    Job, Worker.job_id == Job.id
)
_TOKENS_BY_HASH = _TOKEN_QUERY.where(ApiToken.token_hash.in_(bindparam("hashes", expanding=True)))
_WORKERS_BY_HASH = _WORKER_QUERY.where(Worker.token_hash.in_(bindparam("hashes", expanding=True)))
"""Built once, read as rows on a plain connection: the token cache refreshes every agent's
token every few seconds (``cache.TOKEN_REFRESH_AFTER_S``), so building statements and entities
on each refresh would be a steady cost to the API process."""


def authenticate_keys(
    sessions: sessionmaker[Session], keys: list[str]
) -> dict[str, Principal | Exception]:
    """Many credentials (by ``cache_key``) in at most two queries, on a connection of their
    own: each key's principal, or the ``Unauthorized`` its request gets."""
    api = {k.removeprefix("api:"): k for k in keys if k.startswith("api:")}
    worker = {k.removeprefix("worker:"): k for k in keys if k.startswith("worker:")}
    rows: dict[str, Any] = {}
    workers: dict[str | None, Any] = {}
    with sessions() as session:
        conn = session.connection()  # rows through Core: no ORM loading
        if api:
            rows = {row[0]: row for row in conn.execute(_TOKENS_BY_HASH, {"hashes": list(api)})}
        if worker:
            found = conn.execute(_WORKERS_BY_HASH, {"hashes": list(worker)})
            workers = {row[0]: row for row in found}
    out: dict[str, Principal | Exception] = {}
    for h, key in [*api.items(), *worker.items()]:
        try:
            out[key] = _principal(rows.get(h)) if h in api else _worker_principal(workers.get(h))
        except Unauthorized as exc:
            out[key] = exc
    return out


def _authenticate_worker(session: Session, secret: str) -> Principal:
    found = session.execute(_WORKER_QUERY.where(Worker.token_hash == hash_token(secret))).first()
    return _worker_principal(found)


def _worker_principal(found: Any) -> Principal:
    if found is None:
        raise Unauthorized(
            "unknown worker credential (a newer one replaced it, or its job is gone)"
        )
    _, worker_id, job_id, rank, status = found
    if JobStatus(status).terminal:
        raise Unauthorized(
            f"worker credential of job {job_id} rank {rank}: the job has ended ({status})"
        )
    return Principal(
        token_id=-worker_id,
        name=f"job-{job_id}-rank-{rank}",
        role=Role.WORKER,
        job_id=job_id,
        rank=rank,
    )


def mint_worker_token(worker: Worker) -> str:
    """A new credential for one rank; only its hash is kept (on the worker), and the one it
    replaces stops working."""
    secret = WORKER_PREFIX + secrets.token_urlsafe(32)
    session = object_session(worker)
    if worker.token_hash is not None and session is not None:  # a cached one must go too
        mark_tokens_changed(session, job_ids=[worker.job_id])
    worker.token_hash = hash_token(secret)
    return secret


def authenticate_with(sessions: sessionmaker[Session], secret: str | None) -> Principal:
    """Authenticate in a session of its own."""
    with sessions() as session:
        return authenticate(session, secret)


def create(
    session: Session, req: TokenCreate, *, by: str, secret: str | None = None
) -> tuple[ApiToken, str]:
    """Store a new token; returns the row and the secret (shown once)."""
    if req.role is Role.WORKER:
        raise Conflict(
            "worker credentials are minted by the control plane for each rank it places; "
            "they cannot be created",
            field="role",
        )
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
        mark_tokens_changed(session, token_ids=[row.id])
        record(session, by, "token.revoke", f"token:{row.id}", {"name": row.name})
    return row


def list_tokens(session: Session, paging: Paging) -> tuple[list[ApiToken], int]:
    return page(session, select(ApiToken).order_by(ApiToken.id), paging)


def ensure_admin(session: Session, secret: str | None) -> str | None:
    """Make sure an admin can log in. With ``secret`` (EVENFLOW_ADMIN_TOKEN) that token exists,
    and any other bootstrap admin token (one set before, or generated) is revoked: changing
    the variable rotates the token. Without it, a token is generated only if no admin exists
    yet. Returns a newly generated secret, to be printed once, or None."""
    if secret is not None:
        current = session.scalars(
            select(ApiToken).where(ApiToken.token_hash == hash_token(secret))
        ).first()
        if current is None:
            current, _ = create(
                session,
                TokenCreate(name=BOOTSTRAP_ADMIN, role=Role.ADMIN),
                by="system",
                secret=secret,
            )
        for old in session.scalars(
            select(ApiToken).where(
                ApiToken.name == BOOTSTRAP_ADMIN,
                ApiToken.created_by == "system",
                ApiToken.revoked_at.is_(None),
                ApiToken.id != current.id,
            )
        ):
            revoke(session, old.id, by="system")
        return None
    live_admin = session.scalars(
        select(ApiToken).where(ApiToken.role == Role.ADMIN.value, ApiToken.revoked_at.is_(None))
    ).first()
    if live_admin is not None:
        return None
    _, generated = create(session, TokenCreate(name=BOOTSTRAP_ADMIN, role=Role.ADMIN), by="system")
    return generated


def ensure_agent_tokens(session: Session, pairs: dict[str, str]) -> None:
    """Make each {host: secret} of the settings (``EVENFLOW_AGENT_TOKENS``) an agent token bound
    to that host; a secret set before for the host and changed since is revoked."""
    for host, secret in pairs.items():
        name = f"agent-{host}"
        row = session.scalars(
            select(ApiToken).where(ApiToken.token_hash == hash_token(secret))
        ).first()
        if row is not None:
            if row.role != Role.AGENT.value or row.host != host or row.revoked_at is not None:
                raise Conflict(
                    f"EVENFLOW_AGENT_TOKENS: the token for {host} is already token "
                    f"'{row.name}' ({row.role}{', revoked' if row.revoked_at else ''})"
                )
            continue
        for old in session.scalars(
            select(ApiToken).where(
                ApiToken.name == name,
                ApiToken.created_by == "system",
                ApiToken.revoked_at.is_(None),
            )
        ):
            revoke(session, old.id, by="system")
        create(
            session, TokenCreate(name=name, role=Role.AGENT, host=host), by="system", secret=secret
        )
