"""Database models (SQLAlchemy 2.0, typed). The schema itself is owned by Alembic (`migrations/`);
a test checks that these models and the migrations agree.

Enumerations are stored as short strings (not native enums) so adding a state needs no
type migration on PostgreSQL; the wire contract's StrEnums are the source of the values, and the
mapping (``StrEnumColumn``) hands back their members. ``Job.job_spec`` reads the stored spec
as a ``JobSpec``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from contract.enums import (
    DeviceKind,
    DeviceStatus,
    HostStatus,
    JobStatus,
    OverrideKind,
    PlanSource,
    Role,
    WorkerState,
)
from contract.spec import JobSpec

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# An auto-incrementing 64-bit key: SQLite only auto-increments INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite hands back naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


E = TypeVar("E", bound=StrEnum)


class StrEnumColumn(TypeDecorator[E]):
    """A StrEnum stored as its value in a VARCHAR: the column is a plain ``String(length)`` (no
    native enum, no CHECK), so adding a member needs no migration. Binds take a member or its
    value (Core inserts pass strings); an unknown value is refused before it reaches the
    database, and reads hand back the member."""

    impl = String
    cache_ok = True

    def __init__(self, enum: type[E], length: int) -> None:
        super().__init__(length)
        self.enum = enum
        self._members: dict[str, E] = {m.value: m for m in enum}
        """Value -> member: a read looks its member up here. Calling the enum class goes
        through ``EnumType.__call__`` at a microsecond a value, a fifth of a fleet
        controller's placement pass (10,000 devices loaded with their kind and status)."""

    def process_bind_param(self, value: E | str | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        member = self._members.get(value)  # a member hashes and compares as its value
        return (member if member is not None else self.enum(value)).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> E | None:
        if value is None:
            return None
        member = self._members.get(value)
        return member if member is not None else self.enum(value)  # unknown: ValueError


PENDING_REASON_LENGTH = 500
"""Why a job waits, in words (``server.services.scheduler.explain`` keeps within it)."""


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Host(Base):
    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    status: Mapped[HostStatus] = mapped_column(
        StrEnumColumn(HostStatus, 16), default=HostStatus.ACTIVE
    )
    protocol_version: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    agent_instance: Mapped[str | None] = mapped_column(String(64), default=None)
    """The id of the agent process that holds this host (``HostRegister.instance``): another
    instance is refused while this one heartbeats, unless it registers with ``replace``."""

    devices: Mapped[list[Device]] = relationship(
        back_populates="host", order_by="Device.index", cascade="all, delete-orphan"
    )


class Device(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("host_id", "kind", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    host_id: Mapped[int] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    kind: Mapped[DeviceKind] = mapped_column(StrEnumColumn(DeviceKind, 8))
    model: Mapped[str] = mapped_column(String(128))
    memory_mb: Mapped[int] = mapped_column(Integer)
    status: Mapped[DeviceStatus] = mapped_column(
        StrEnumColumn(DeviceStatus, 16), default=DeviceStatus.FREE
    )
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="SET NULL"), index=True, default=None
    )

    host: Mapped[Host] = relationship(back_populates="devices")


def departed_ranks(departures: list[dict[str, Any]] | None, attempt: int) -> frozenset[int]:
    """The ranks of ``attempt`` that have left their job for good, of a job's ``departures``
    (``Job.departed``, for a caller that read the columns as a row)."""
    return frozenset(int(d["rank"]) for d in departures or [] if d["attempt"] == attempt)


class Blob(Base):
    """Bytes uploaded to the control plane (a job's code archive, an artifact of its outputs),
    named by their SHA-256 and kept in ``blob_chunks``, so every server sharing the database
    serves them (PostgreSQL included)."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    chunks: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))


class BlobChunk(Base):
    """One piece of a blob, in order: read and written a piece at a time, so no server holds a
    whole blob in memory."""

    __tablename__ = "blob_chunks"

    sha256: Mapped[str] = mapped_column(
        String(64), ForeignKey("blobs.sha256", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]] = mapped_column(Json)
    status: Mapped[JobStatus] = mapped_column(
        StrEnumColumn(JobStatus, 16), default=JobStatus.PENDING, index=True
    )
    priority: Mapped[int] = mapped_column(Integer, default=0)
    emulated: Mapped[bool] = mapped_column(Boolean, default=False)
    frozen: Mapped[bool] = mapped_column(Boolean, default=False)
    """Automatic rebalancing is suspended by an operator."""
    controls: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    """Operators' standing constraints: ``{"pins": {rank: batch}, "excluded": [rank, ...]}``."""
    plan_version: Mapped[int | None] = mapped_column(Integer, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    pending_reason: Mapped[str | None] = mapped_column(String(PENDING_REASON_LENGTH), default=None)
    """Why a pending job waits ("needs 4 devices, 2 free, 2 busy with job 7"); None otherwise."""
    master_port: Mapped[int | None] = mapped_column(Integer, default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    """Which start of the job runs now: 0, then one more per restart after a failure. The
    workers (and their credentials) are those of this attempt only."""
    restart_history: Mapped[list[dict[str, Any]]] = mapped_column(Json, default=list)
    """One ``contract.api.RestartOut`` (as JSON) per restart, oldest first."""
    departures: Mapped[list[dict[str, Any]] | None] = mapped_column(Json, default=list)
    """One ``contract.api.DepartureOut`` (as JSON) per rank that left the job for good while
    the others went on (``server.services.departures``), oldest first, every attempt's."""
    settled_through: Mapped[int | None] = mapped_column(Integer, default=None)
    """The last iteration every rank had reported when the rebalancer first decided on
    identified models in this attempt (exploring is over); None while it explores. Kept in the
    job, not only in the controller's memory, so that a controller that takes over does not
    take a job settled after warm-up (``static``, ``adaptive``) for one still exploring."""

    logs_followed_until: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
    """Until when someone follows the job's logs (``jobs logs --follow``): till then its agents
    upload the live log tails of its running ranks with their heartbeats."""

    context: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    """The code archive the job runs (``spec.workload.context``), kept beside the spec so an
    agent's right to read an archive is one indexed lookup."""

    workers: Mapped[list[Worker]] = relationship(
        back_populates="job", order_by="Worker.rank", cascade="all, delete-orphan"
    )

    @property
    def job_spec(self) -> JobSpec:
        """The stored spec, validated: typed fields instead of reading the JSON by key."""
        return JobSpec.model_validate(self.spec)

    @property
    def restarts(self) -> int:
        return len(self.restart_history or [])

    @property
    def departed(self) -> frozenset[int]:
        """Ranks of the current attempt that have left the job for good."""
        return departed_ranks(self.departures, self.attempt)


class Worker(Base):
    """One rank of a job, placed on one device."""

    __tablename__ = "workers"
    __table_args__ = (
        UniqueConstraint("job_id", "rank"),
        # a heartbeat's live ranks of its host (``hosts._placed_here``); host_id alone too
        Index("ix_workers_host_state", "host_id", "state"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    device_id: Mapped[int | None] = mapped_column(
        ForeignKey("devices.id", ondelete="SET NULL"), default=None
    )
    host_id: Mapped[int | None] = mapped_column(
        ForeignKey("hosts.id", ondelete="SET NULL"), default=None
    )
    state: Mapped[WorkerState] = mapped_column(
        StrEnumColumn(WorkerState, 16), default=WorkerState.ASSIGNED
    )
    exit_code: Mapped[int | None] = mapped_column(Integer, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    log_tail: Mapped[str | None] = mapped_column(Text, default=None)
    log_end: Mapped[int | None] = mapped_column(BigInteger, default=None)
    """Where ``log_tail`` ends in the rank's log, in bytes."""
    """The last lines of the rank's log, uploaded by its agent when it failed or was stopped."""
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, default=None)
    """SHA-256 of this rank's worker credential (``server.services.tokens``): minted when the
    rank is handed to its agent, valid only while the job lives."""

    job: Mapped[Job] = relationship(back_populates="workers")


class Plan(Base):
    """A versioned batch plan of a job: the local batch size of every rank."""

    __tablename__ = "plans"
    __table_args__ = (UniqueConstraint("job_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    batch_sizes: Mapped[list[int]] = mapped_column(Json)
    excluded: Mapped[list[int]] = mapped_column(Json, default=list)
    """Ranks out of the all-reduce group under this plan."""
    departed: Mapped[list[int] | None] = mapped_column(Json, default=list)
    """Ranks of ``excluded`` that have left the job for good (their process is gone): never
    readmitted, never waited for."""
    global_batch: Mapped[int] = mapped_column(Integer)
    source: Mapped[PlanSource] = mapped_column(StrEnumColumn(PlanSource, 16))
    reason: Mapped[str] = mapped_column(Text)
    predicted_ms: Mapped[float | None] = mapped_column(Float, default=None)
    created_by: Mapped[str | None] = mapped_column(String(128), default=None)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    memory_caps: Mapped[list[int | None] | None] = mapped_column(Json, default=None)
    """Per rank, the most samples one pass may hold under this plan; None: no rank has a cap."""


class IterationTelemetry(Base):
    """One rank's timing of one iteration. (job, iteration, rank) is unique: retries dedupe."""

    __tablename__ = "iteration_telemetry"
    __table_args__ = (
        # Also the index of every read of a job's iterations (a range, all ranks or one): no
        # query reads by rank first, and each index is one more b-tree every row updates
        # (migration 0028 dropped a (job_id, iteration) index beside it).
        UniqueConstraint("job_id", "iteration", "rank"),
        # The control loop reads a job's rows newer than an id every round: a range scan
        # here, instead of every row of the job through the key above.
        Index("ix_iteration_telemetry_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    iteration: Mapped[int] = mapped_column(BigInteger)
    plan_version: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[int] = mapped_column(Integer)
    data_ms: Mapped[float] = mapped_column(Float)
    compute_ms: Mapped[float] = mapped_column(Float)
    sync_ms: Mapped[float] = mapped_column(Float)
    ts: Mapped[float] = mapped_column(Float)
    """Worker-side unix time at the end of the iteration."""
    probe: Mapped[bool] = mapped_column(Boolean, default=False)
    peak_memory_mb: Mapped[float | None] = mapped_column(Float, default=None)
    """Peak device memory of the iteration's compute; None where it is not measured."""
    oom_batch: Mapped[int | None] = mapped_column(Integer, default=None)
    """Size of a pass that ran out of memory in the iteration; None when none did."""
    pass_size: Mapped[int | None] = mapped_column(Integer, default=None)
    """The iteration's largest pass (what its peak memory belongs to); None: not reported."""


class TelemetryRollup(Base):
    """Telemetry older than the retention window (``server.services.retention``), one row per
    rank and bucket of iterations: the count and the mean, min and max of each timing.

    ``rank`` is :data:`JOB_RANK` for the job-level row of a bucket, whose ``iteration_ms`` is the
    slowest rank's iteration time (what the job waited for) and whose other columns are means
    over all ranks. Readers weight means by ``count``; late rows of a bucket already rolled up
    add a second row for it, which the weighting also covers."""

    __tablename__ = "telemetry_rollups"
    __table_args__ = (
        Index("ix_telemetry_rollups_job_rank_first", "job_id", "rank", "first_iteration"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    first_iteration: Mapped[int] = mapped_column(BigInteger)
    last_iteration: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(Integer)
    batch_size: Mapped[float] = mapped_column(Float)
    data_ms: Mapped[float] = mapped_column(Float)
    compute_ms: Mapped[float] = mapped_column(Float)
    compute_min_ms: Mapped[float] = mapped_column(Float)
    compute_max_ms: Mapped[float] = mapped_column(Float)
    sync_ms: Mapped[float] = mapped_column(Float)
    iteration_ms: Mapped[float] = mapped_column(Float)
    iteration_min_ms: Mapped[float] = mapped_column(Float)
    iteration_max_ms: Mapped[float] = mapped_column(Float)
    plan_version_min: Mapped[int] = mapped_column(Integer)
    plan_version_max: Mapped[int] = mapped_column(Integer)
    last_ts: Mapped[float] = mapped_column(Float)


class JobMetric(Base):
    """One value of a named training metric (the global ``loss``, or one user code logged)
    reported by one rank at one iteration. (job, name, rank, iteration) is unique: retries
    dedupe, the first value stored wins. Reads go through that key's index by job and name."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "name", "rank", "iteration"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int] = mapped_column(Integer)
    iteration: Mapped[int] = mapped_column(BigInteger)
    value: Mapped[float] = mapped_column(Float)


JOB_RANK = -1
"""``TelemetryRollup.rank`` of a bucket's job-level row."""


class Checkpoint(Base):
    """A checkpoint a job's rank wrote and reported (the file itself lives at ``url``)."""

    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    iteration: Mapped[int] = mapped_column(BigInteger)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    url: Mapped[str] = mapped_column(Text)
    write_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Artifact(Base):
    """A file a job's rank left in its output directory (or its final model): where it is, and
    the blob holding a copy of its bytes when the rank uploaded one."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "rank", "name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    url: Mapped[str] = mapped_column(Text)
    host: Mapped[str | None] = mapped_column(String(255), default=None)
    blob: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("blobs.sha256", ondelete="SET NULL"), default=None
    )
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class StragglerEvent(Base):
    __tablename__ = "straggler_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int | None] = mapped_column(Integer, default=None)
    kind: Mapped[str] = mapped_column(String(32))
    severity: Mapped[float] = mapped_column(Float)
    start_iteration: Mapped[int] = mapped_column(BigInteger)
    end_iteration: Mapped[int | None] = mapped_column(BigInteger, default=None)
    action: Mapped[str] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Override(Base):
    """An operator's manual intervention on a job's balancing."""

    __tablename__ = "overrides"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[OverrideKind] = mapped_column(StrEnumColumn(OverrideKind, 32))
    reason: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    applied: Mapped[bool] = mapped_column(Boolean, default=False)
    plan_version: Mapped[int | None] = mapped_column(Integer, default=None)


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(128))
    detail: Mapped[dict[str, Any]] = mapped_column(Json, default=dict)


class ApiToken(Base):
    """A bearer token. Only its SHA-256 is stored; the secret is shown once at creation."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[Role] = mapped_column(StrEnumColumn(Role, 16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    host: Mapped[str | None] = mapped_column(String(128), default=None)
    """Agent tokens: the host name they may register and write for."""
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)


class ControllerFence(Base):
    """One row: the turn of the database's active controller (``server.controller``), taken
    on every backend (``/metrics``: ``evenflow_controller_epoch``) and checked on PostgreSQL.

    The controller lock on PostgreSQL is a session advisory lock on a connection of its own.
    Should that connection alone break (the server or a pooler ending an idle session, a
    network blip) while the controller's process goes on, the lock is free, a standby takes it,
    and the first controller would write on through its other connections until it next checks
    its lock, after a round that may take seconds (a minute on a starved machine). So each
    controller takes a new ``epoch`` when it takes the lock, and each of its write transactions
    first reads the epoch ``FOR SHARE`` and stops if it is not its own: one begun before the
    takeover holds the row, so the new controller's epoch waits for it to end; one begun after
    sees the new epoch and writes nothing."""

    __tablename__ = "controller_fence"

    id: Mapped[int] = mapped_column(primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    holder: Mapped[str | None] = mapped_column(String(200), default=None)
    """Which controller took the epoch: host name and process id."""
    since: Mapped[datetime | None] = mapped_column(UTCDateTime, default=None)
