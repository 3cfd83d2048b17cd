"""The public REST API's bodies: hosts, jobs, what-if plans, models, events, overrides, audit and
tokens, as people and scripts read and write them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field, field_validator

from contract.agent import PlanOut
from contract.base import MAX_WORKERS, Batch, Name, Request, Response, Text
from contract.enums import (
    DeviceKind,
    DeviceStatus,
    HostStatus,
    JobStatus,
    OverrideKind,
    Role,
    WorkerState,
)


class DeviceOut(Response):
    id: int
    index: int
    kind: DeviceKind
    model: str
    memory_mb: int
    status: DeviceStatus
    job_id: int | None = None


class HostOut(Response):
    id: int
    name: str
    address: str
    status: HostStatus
    protocol_version: int
    registered_at: datetime
    last_heartbeat: datetime
    devices: list[DeviceOut] = []


class WorkerOut(Response):
    rank: int
    device_id: int | None
    host_id: int | None
    state: WorkerState
    exit_code: int | None = None
    error: str | None = None


class RestartOut(Response):
    """One restart of a job after a failure."""

    attempt: int
    """The attempt this restart began (the first start is attempt 0)."""
    at: datetime
    reason: str
    resumed_from: int | None = None
    """The checkpoint's iteration the new attempt resumes at (None: from iteration 0)."""
    iterations_lost: int | None = None
    """Iterations done after that checkpoint and run again (None when unknown)."""


class CheckpointOut(Response):
    """A checkpoint a job's rank wrote."""

    id: int
    job_id: int
    attempt: int
    rank: int
    iteration: int
    size_bytes: int
    url: str
    write_ms: float
    created_at: datetime


class ArtifactOut(Response):
    """A file a job left (``GET /jobs/{id}/artifacts``): where it is and whether the server holds
    its bytes (``GET /jobs/{id}/artifacts/{artifact_id}/content``)."""

    id: int
    job_id: int
    attempt: int
    rank: int
    name: str
    size_bytes: int
    url: str
    host: str | None
    """The host whose disk holds it (None: on shared storage)."""
    stored: bool
    """The server holds a copy of its bytes."""
    created_at: datetime


class ContextOut(Response):
    """A code archive uploaded for jobs to run (``POST /api/v1/contexts``)."""

    sha256: str
    """What a job's ``workload.context`` names it by."""
    size_bytes: int
    created_at: datetime
    created_by: str
    new: bool = False
    """Whether this upload stored it (False: an archive of the same bytes was there)."""


class RankLogOut(Response):
    """One rank's end as its agent reported it: the root cause and the last lines of its log."""

    rank: int
    state: WorkerState
    exit_code: int | None = None
    error: str | None = None
    """Root-cause traceback (its error file), or the log's last lines without one."""
    log_tail: str | None = None
    """The last lines of its log (bounded), uploaded when it ended; while it runs, only while
    its job's logs are followed (``POST .../logs/follow``)."""
    log_end: int | None = None
    """Where ``log_tail`` ends in the log, in bytes: of two tails of a growing log, the later
    one's last ``log_end`` difference bytes are the new lines."""


class DepartureOut(Response):
    """A rank that left a running job for good: it was out of the all-reduce group (partial
    all-reduce) when it died, so the others went on without it and no restart was counted."""

    rank: int
    attempt: int
    """The attempt it left (a restart places every rank anew)."""
    at: datetime
    reason: str


class JobOut(Response):
    id: int
    name: str
    status: JobStatus
    owner: str
    spec: dict[str, Any]
    emulated: bool
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    pending_reason: str | None = None
    """Why a pending job waits for devices ("needs 4 devices, 2 free, 2 busy with job 7");
    None once it is placed."""
    plan_version: int | None = None
    frozen: bool = False
    workers: list[WorkerOut] = []
    attempt: int = 0
    """Starts after the first (one per restart)."""
    restarts: int = 0
    restart_history: list[RestartOut] = []
    departures: list[DepartureOut] = []
    """Ranks that left the job for good while the others went on (no restart): an excluded
    rank that died when the job could do without it."""

    @field_validator("departures", mode="before")
    @classmethod
    def _none_is_empty(cls, v: object) -> object:
        return [] if v is None else v  # a job stored before departures were recorded


T = TypeVar("T")


class Page(Response, Generic[T]):
    """What every list endpoint answers: one page of ``items`` (at most the request's
    ``limit``, from its ``offset``) and the ``total`` matching the request's filters."""

    items: list[T]
    total: int


JobList = Page[JobOut]


SolvePolicy = Literal["minmax", "equal", "proportional"]
"""The planner's one-shot policies (static and adaptive are ways of running a job, not solvers)."""


class SolveWorker(Request):
    """One worker of a what-if plan: its performance model and constraints."""

    id: Text = Field(min_length=1, max_length=128)
    per_sample_ms: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    intercept_ms: float = Field(default=0.0, ge=0, le=1e7, allow_inf_nan=False)
    floor_ms: float = Field(default=0.0, ge=0, le=1e7, allow_inf_nan=False)
    min_batch: int = Field(default=0, ge=0, le=10_000_000)
    max_batch: int | None = Field(default=None, ge=0, le=10_000_000)
    pinned_batch: int | None = Field(default=None, ge=0, le=10_000_000)


class SolveRequest(Request):
    """A stateless what-if: the plan a policy would make for these workers."""

    global_batch: int = Field(ge=1, le=100_000_000)
    policy: SolvePolicy = "minmax"
    granularity: int = Field(default=1, ge=1, le=65_536)
    workers: list[SolveWorker] = Field(min_length=1, max_length=MAX_WORKERS)


class SolveResponse(Response):
    batch_sizes: dict[str, int]
    predicted_ms: dict[str, float]
    makespan_ms: float
    lower_bound_ms: float
    optimal: bool
    policy: SolvePolicy
    solve_ms: float


class ModelOut(Response):
    """A worker's fitted performance model: t(b) = max(floor, intercept + per_sample * b)."""

    rank: int
    identifiable: bool
    """False while the worker has been seen at one batch size only; the numbers are then a guess."""
    per_sample_ms: float | None
    intercept_ms: float | None
    floor_ms: float | None
    r2: float | None = None
    relative_rmse: float | None = None
    observations: int = 0
    distinct_batch_sizes: int = 0
    reason: str = ""
    memory_cap: int | None = None
    """Most samples one pass may hold (None: no cap); a larger share runs as accumulated passes."""
    device_memory_mb: int | None = None
    memory_base_mb: float | None = None
    """Fitted memory model ``mem(b) = base + per_sample * b`` (a labelled guess when
    ``memory_identifiable`` is false)."""
    memory_per_sample_mb: float | None = None
    memory_identifiable: bool = False
    memory_max_relative_error: float | None = None
    """Largest relative gap between the fitted and measured peak memory."""
    predicted_memory_mb: float | None = None
    """Predicted peak memory of the rank's largest pass under the plan in force."""
    oom_batch: int | None = None
    """Smallest pass size that ran out of memory on this rank."""
    memory_reason: str = ""


class TelemetryOut(Response):
    probe: bool = False
    rank: int
    iteration: int
    plan_version: int
    batch_size: int
    data_ms: float
    compute_ms: float
    sync_ms: float
    ts: float
    peak_memory_mb: float | None = None
    """Peak device memory of the iteration's compute (None: not measured)."""
    oom_batch: int | None = None
    """A pass of this size ran out of memory in the iteration (it was redone in smaller ones)."""
    pass_size: int | None = None
    """The iteration's largest pass (None: one pass of ``batch_size``)."""


class EventOut(Response):
    id: int
    job_id: int
    rank: int | None
    kind: str
    severity: float
    start_iteration: int
    end_iteration: int | None
    action: str
    detail: dict[str, Any] = {}
    created_at: datetime


class OverrideCreate(Request):
    kind: OverrideKind = Field(strict=False)
    reason: Text = Field(min_length=1, max_length=1000)
    batch_sizes: list[Batch] | None = Field(default=None, max_length=MAX_WORKERS)
    rank: int | None = Field(default=None, ge=0, lt=MAX_WORKERS)
    batch_size: int | None = Field(default=None, ge=0, le=10_000_000)
    preview: bool = False
    """Compute and return the resulting plan without applying it."""


class OverrideOut(Response):
    id: int | None
    job_id: int
    kind: OverrideKind
    reason: str
    payload: dict[str, Any]
    created_by: str
    created_at: datetime | None
    applied: bool
    plan: PlanOut | None = None
    current_predicted_ms: float | None = None


class AuditOut(Response):
    id: int
    at: datetime
    actor: str
    action: str
    target: str
    detail: dict[str, Any] = {}


class TokenCreate(Request):
    name: Name
    role: Role = Field(strict=False)
    host: Name | None = None
    """For agent tokens: the host name this token may register and write for."""


class TokenOut(Response):
    id: int
    name: str
    role: Role
    prefix: str
    host: str | None = None
    created_at: datetime
    created_by: str
    revoked_at: datetime | None = None


class TokenCreated(TokenOut):
    token: str
    """The secret, shown once."""
