"""The wire contract between the control plane, agents, training workers and API clients.

This module imports only pydantic (and the standard library), so an agent host or a training
worker needs none of the server's dependencies. The server imports these types; it never
defines its own copies of them.

Every request model refuses unknown fields and coerces nothing (``strict``): ``"5"`` is not an
integer here. Bounds on sizes and lengths are part of the contract, so a bad request is answered
with a 422 that names the field.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; an agent with another version is refused at registration."""

MAX_TELEMETRY_RECORDS = 5000
"""Largest telemetry batch one request may carry."""

MAX_PLAN_WAIT_S = 30.0
"""Longest a plan long-poll (``GET /jobs/{id}/plan?wait_s=``) is held; clients' read timeouts
must exceed it."""

MAX_WORKERS = 10_000
MAX_MS = 1e7
MAX_ID = 2**31 - 1
"""No timing above ~2.8 hours per iteration phase is plausible; larger values are input errors."""


def _refuse_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    return value


Text = Annotated[str, AfterValidator(_refuse_nul)]
"""Every string a client sends: PostgreSQL cannot store NUL characters, so they are refused."""
Name = Annotated[
    Text, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
]
Id = Annotated[int, Field(ge=1, le=MAX_ID)]
Batch = Annotated[int, Field(ge=0, le=10_000_000)]
Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]


class Request(BaseModel):
    """Base of everything a client sends: strict types, no unknown fields.

    Enum fields opt out of strictness so they accept their JSON string values.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Response(BaseModel):
    """Base of everything the server answers; lenient so older clients read newer servers."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)


# --------------------------------------------------------------------------- enums


class Role(StrEnum):
    """Token roles, each including the rights of those before it except ``agent``.

    viewer < operator < admin. ``agent`` is separate: it reads like a viewer and writes only for
    its own host and the jobs placed there.
    """

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    AGENT = "agent"


class HostStatus(StrEnum):
    ACTIVE = "active"
    LOST = "lost"


class DeviceKind(StrEnum):
    CUDA = "cuda"
    CPU = "cpu"


class DeviceStatus(StrEnum):
    FREE = "free"
    BUSY = "busy"
    OFFLINE = "offline"


class JobStatus(StrEnum):
    """Job lifecycle.

    ::

        PENDING --placed--> STARTING --all workers running--> RUNNING --> SUCCEEDED
           |                   |                                 |
           |                   +--------> FAILED <---------------+
           +-------------------+---------> CANCELLED <-----------+

    PENDING waits for free devices. STARTING has devices and waits for its agents to launch the
    workers. SUCCEEDED, FAILED and CANCELLED are terminal and free the devices.
    """

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.PENDING: frozenset({JobStatus.STARTING, JobStatus.CANCELLED, JobStatus.FAILED}),
    JobStatus.STARTING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


class WorkerState(StrEnum):
    """State of one rank of a job, as its agent reports it.

    ::

        ASSIGNED --agent picks it up--> LAUNCHING --process started--> RUNNING --> SUCCEEDED
           |                               |                             |
           +-------------------------------+--> FAILED (exit != 0) <-----+
           +-------------------------------+--> STOPPED (job cancelled) <+
    """

    ASSIGNED = "assigned"
    LAUNCHING = "launching"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)


WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.ASSIGNED: frozenset(
        {WorkerState.LAUNCHING, WorkerState.RUNNING, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.LAUNCHING: frozenset(
        {WorkerState.RUNNING, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.RUNNING: frozenset(
        {WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.STOPPED: frozenset(),
}


class PlanSource(StrEnum):
    INITIAL = "initial"
    AUTOMATIC = "automatic"
    MANUAL = "manual"


class PolicyName(StrEnum):
    """How a job's batches are balanced.

    equal          B split evenly, never changed (what plain DDP does; the baseline)
    proportional   b proportional to measured throughput, ignoring intercepts (LB-BSP-style)
    minmax         the exact min-max plan from fitted models, re-planned every K iterations
    static         the min-max plan computed once after warm-up, never changed
    adaptive       min-max after warm-up, then the straggler ladder (fine-tune, re-plan,
                   partial all-reduce exclusion) reacting to detected slowdowns
    """

    EQUAL = "equal"
    PROPORTIONAL = "proportional"
    MINMAX = "minmax"
    STATIC = "static"
    ADAPTIVE = "adaptive"


class OverrideKind(StrEnum):
    SET_BATCHES = "set_batches"
    PIN = "pin"
    EXCLUDE = "exclude"
    READMIT = "readmit"
    FREEZE = "freeze"
    UNFREEZE = "unfreeze"
    REBALANCE_NOW = "rebalance_now"


# --------------------------------------------------------------------------- hosts


class DeviceInfo(Request):
    index: int = Field(ge=0, le=1023)
    kind: DeviceKind = Field(strict=False)
    model: Text = Field(min_length=1, max_length=128)
    memory_mb: int = Field(ge=0, le=10_000_000)


class HostRegister(Request):
    protocol_version: int = Field(ge=0, le=MAX_ID)
    name: Name
    address: Text = Field(min_length=1, max_length=255)
    devices: list[DeviceInfo] = Field(min_length=1, max_length=256)

    @field_validator("devices")
    @classmethod
    def _unique_indices(cls, devices: list[DeviceInfo]) -> list[DeviceInfo]:
        seen: set[tuple[DeviceKind, int]] = set()
        for d in devices:
            key = (d.kind, d.index)
            if key in seen:
                raise ValueError(f"device {d.kind}:{d.index} listed twice")
            seen.add(key)
        return devices


class WorkerReport(Request):
    """What an agent says about one of its workers."""

    job_id: Id
    rank: int = Field(ge=0, lt=MAX_WORKERS)
    state: WorkerState = Field(strict=False)
    exit_code: int | None = Field(default=None, ge=-(2**31), le=MAX_ID)
    error: Text | None = Field(default=None, max_length=65_536)


class Heartbeat(Request):
    workers: list[WorkerReport] = Field(default_factory=list, max_length=1024)


class Assignment(Response):
    """One rank an agent must run (``desired='run'``) or stop (``desired='stop'``)."""

    job_id: int
    rank: int
    world_size: int
    device_index: int
    device_kind: DeviceKind
    master_addr: str
    master_port: int
    backend: Literal["nccl", "gloo"]
    desired: Literal["run", "stop"]
    spec: dict[str, Any]
    """The job's JobSpec as JSON."""


class HeartbeatAck(Response):
    host_id: int
    status: HostStatus
    assignments: list[Assignment] = []


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


# --------------------------------------------------------------------------- jobs


class Slowdown(Request):
    """Multiply a worker's emulated compute time by ``factor`` on iterations [from, to)."""

    from_iteration: int = Field(ge=0, le=10**12)
    to_iteration: int = Field(ge=1, le=10**12)
    factor: float = Field(gt=0, le=1000, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Slowdown:
        if self.to_iteration <= self.from_iteration:
            raise ValueError("to_iteration must be greater than from_iteration")
        return self


class EmulatedWorker(Request):
    """Emulated speed: pad real compute to factor * (intercept + per_sample * b)."""

    per_sample_ms: float = Field(ge=0, le=1e5, allow_inf_nan=False)
    intercept_ms: float = Field(default=0.0, ge=0, le=1e5, allow_inf_nan=False)
    slowdowns: list[Slowdown] = Field(default_factory=list, max_length=64)
    name: Name | None = None


ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class WorkloadSpec(Request):
    """What to train: a built-in workload or a user entrypoint ``module:function``."""

    builtin: Literal["mlp", "cnn-digits"] | None = None
    entrypoint: Text | None = Field(default=None, max_length=255)
    learning_rate: float = Field(default=0.05, gt=0, le=10, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    args: dict[Text, Text | int | float | bool] = Field(default_factory=dict, max_length=64)

    @model_validator(mode="after")
    def _one_of(self) -> WorkloadSpec:
        if (self.builtin is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of builtin or entrypoint")
        if self.entrypoint is not None and not ENTRYPOINT.match(self.entrypoint):
            raise ValueError("entrypoint must look like 'package.module:function'")
        return self


class PolicySpec(Request):
    name: PolicyName = Field(default=PolicyName.ADAPTIVE, strict=False)
    rebalance_every: int = Field(default=20, ge=1, le=1_000_000)
    """Re-plan cadence in iterations."""
    min_gain: float = Field(default=0.03, ge=0, le=1, allow_inf_nan=False)
    """Issue a new plan only if it predicts at least this fractional cut in iteration time."""
    explore_iterations: int = Field(default=10, ge=0, le=10_000)
    """Iterations at the start that perturb batch sizes so each worker's model is identifiable."""
    granularity: int = Field(default=1, ge=1, le=4096)


class JobSpec(Request):
    name: Name
    workload: WorkloadSpec
    global_batch: int = Field(ge=1, le=10_000_000)
    iterations: int | None = Field(default=None, ge=1, le=100_000_000)
    epochs: int | None = Field(default=None, ge=1, le=100_000)
    workers: int | None = Field(default=None, ge=1, le=1024)
    max_workers: int | None = Field(default=None, ge=1, le=1024)
    """With ``workers``: take up to this many devices when they are free (``workers`` is then
    the minimum); placement picks the count that maximises predicted throughput."""
    devices: list[Id] | None = Field(default=None, min_length=1, max_length=1024)
    """Explicit device ids (from GET /hosts); instead of ``workers``."""
    policy: PolicySpec = Field(default_factory=PolicySpec)
    emulation: list[EmulatedWorker] | None = Field(default=None, max_length=1024)
    """One entry per rank; labels the job as emulated everywhere it shows."""
    max_batch_per_worker: int | None = Field(default=None, ge=1, le=10_000_000)
    priority: int = Field(default=0, ge=-100, le=100)

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.iterations is None) == (self.epochs is None):
            raise ValueError("give exactly one of iterations or epochs")
        if (self.workers is None) == (self.devices is None):
            raise ValueError("give exactly one of workers or devices")
        if self.devices is not None and len(set(self.devices)) != len(self.devices):
            raise ValueError("devices lists a device twice")
        if self.max_workers is not None:
            if self.workers is None or self.max_workers < self.workers:
                raise ValueError("max_workers needs workers (the minimum) and must be at least it")
            if self.emulation is not None and self.max_workers != self.workers:
                raise ValueError(
                    "an emulated job has one emulation entry per rank: give no max_workers"
                )
        n = self.world_size
        if self.emulation is not None and len(self.emulation) != n:
            raise ValueError(f"emulation has {len(self.emulation)} entries for {n} workers")
        if (
            self.max_batch_per_worker is not None
            and self.max_batch_per_worker * n < self.global_batch
        ):
            raise ValueError("global_batch exceeds workers * max_batch_per_worker")
        if self.global_batch % self.policy.granularity:
            raise ValueError("global_batch must be a multiple of policy.granularity")
        return self

    @property
    def world_size(self) -> int:
        return self.workers if self.workers is not None else len(self.devices or [])


class WorkerOut(Response):
    rank: int
    device_id: int | None
    host_id: int | None
    state: WorkerState
    exit_code: int | None = None
    error: str | None = None


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
    plan_version: int | None = None
    frozen: bool = False
    workers: list[WorkerOut] = []


class JobList(Response):
    items: list[JobOut]
    total: int


# --------------------------------------------------------------------------- plans


class PlanOut(Response):
    job_id: int
    version: int
    batch_sizes: list[int]
    """Local batch size per rank; sums to ``global_batch``."""
    excluded: list[int] = []
    """Ranks out of the all-reduce group under this plan (partial all-reduce); their batch is 0.
    They only probe their speed off the critical path until a later plan readmits them."""
    global_batch: int
    source: PlanSource
    reason: str
    predicted_ms: float | None = None
    created_at: datetime
    created_by: str | None = None


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


# --------------------------------------------------------------------------- telemetry


class TelemetryRecord(Request):
    """One rank's timing of one iteration."""

    rank: int = Field(ge=0, lt=MAX_WORKERS)
    iteration: int = Field(ge=0, le=10**12)
    plan_version: Id
    batch_size: int = Field(ge=0, le=10_000_000)
    data_ms: Ms
    compute_ms: Ms
    sync_ms: Ms
    ts: float = Field(ge=0, le=1e11, allow_inf_nan=False)
    """Unix time (seconds) at the end of the iteration on the worker."""
    probe: bool = False
    """A timing an excluded rank took off the critical path (its gradients are discarded);
    ``batch_size`` is the probe's size, not part of the global batch."""


TELEMETRY_FIELDS = tuple(TelemetryRecord.model_fields)
"""The fields of a record, in the order of ``TelemetryColumns``' arrays."""


class TelemetryColumns(Request):
    """Records as one array per field (entry i of every array is record i): the same bounds as
    ``TelemetryRecord``, in half the bytes of the record objects and about a fifth of the server's
    parsing (``bench/ingest.py``). The form the runtime posts."""

    rank: list[Annotated[int, Field(ge=0, lt=MAX_WORKERS)]] = Field(
        min_length=1, max_length=MAX_TELEMETRY_RECORDS
    )
    iteration: list[Annotated[int, Field(ge=0, le=10**12)]]
    plan_version: list[Id]
    batch_size: list[Annotated[int, Field(ge=0, le=10_000_000)]]
    data_ms: list[Ms]
    compute_ms: list[Ms]
    sync_ms: list[Ms]
    ts: list[Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]]
    probe: list[bool] | None = None
    """Absent: no record is a probe."""

    @model_validator(mode="after")
    def _same_length(self) -> TelemetryColumns:
        n = len(self.rank)
        for name in TELEMETRY_FIELDS:
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"columns.{name} has {len(values)} values; columns.rank has {n}")
        return self

    def arrays(self) -> tuple[list[Any], ...]:
        """Every field's array in ``TELEMETRY_FIELDS`` order (``probe`` filled in)."""
        probe = self.probe if self.probe is not None else [False] * len(self.rank)
        return tuple(probe if n == "probe" else getattr(self, n) for n in TELEMETRY_FIELDS)


class TelemetryBatch(Request):
    """Timings of a job's ranks: as ``records`` (objects) or as ``columns`` (arrays), exactly
    one of the two."""

    records: list[TelemetryRecord] | None = Field(
        default=None, min_length=1, max_length=MAX_TELEMETRY_RECORDS
    )
    columns: TelemetryColumns | None = None
    urgent: bool = False
    """Sent ahead of the usual cadence because a rank's iteration or compute time jumped (a
    slowdown starting or ending): the control plane looks at the job at once."""

    @model_validator(mode="after")
    def _one_form(self) -> TelemetryBatch:
        if (self.records is None) == (self.columns is None):
            raise ValueError("give exactly one of records and columns")
        return self

    def arrays(self) -> tuple[list[Any], ...]:
        """Every field's values as one list each, in ``TELEMETRY_FIELDS`` order."""
        if self.columns is not None:
            return self.columns.arrays()
        records = self.records or []
        return tuple([getattr(r, n) for r in records] for n in TELEMETRY_FIELDS)

    def all_records(self) -> list[TelemetryRecord]:
        """The records as objects, whichever form the batch came in."""
        if self.records is not None:
            return self.records
        return [
            TelemetryRecord.model_construct(**dict(zip(TELEMETRY_FIELDS, values, strict=True)))
            for values in zip(*self.arrays(), strict=True)
        ]

    def columnar(self) -> TelemetryBatch:
        """The same batch as ``columns``: what goes on the wire."""
        if self.columns is not None:
            return self
        arrays: dict[str, Any] = dict(zip(TELEMETRY_FIELDS, self.arrays(), strict=True))
        if not any(arrays["probe"]):
            arrays["probe"] = None
        columns = TelemetryColumns.model_construct(None, **arrays)
        return TelemetryBatch.model_construct(records=None, columns=columns, urgent=self.urgent)

    def wire_json(self) -> str:
        """The body to post: the columnar form, absent fields left out."""
        return self.columnar().model_dump_json(exclude_none=True)


class TelemetryAck(Response):
    accepted: int
    duplicates: int


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


# ----------------------------------------------------------------- events, overrides, audit


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


# --------------------------------------------------------------------------- tokens


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


class ErrorOut(Response):
    """Every 4xx answer: a message for people and, where one field is at fault, its dotted path."""

    detail: str
    field: str | None = None
    errors: list[dict[str, Any]] | None = None
    """For validation errors: each problem with its location."""


# --------------------------------------------------------------------------- dashboard


class RankSeries(Response):
    """One rank's timings, downsampled: each entry is the mean over ``SeriesOut.bucket``
    consecutive iterations, placed at the bucket's first iteration."""

    rank: int
    iteration: list[int]
    batch_size: list[float]
    data_ms: list[float]
    compute_ms: list[float]
    sync_ms: list[float]
    plan_version: list[int]
    """The newest plan version seen in the bucket."""


class PlanEffect(Response):
    """When a plan version took effect: the first iteration any rank ran with it."""

    version: int
    iteration: int


class RankWindow(Response):
    """One rank's mean timings over the job's most recent iterations (``SeriesOut.window``)."""

    rank: int
    data_ms: float
    compute_ms: float
    sync_ms: float
    batch_size: float


class SeriesOut(Response):
    """A job's telemetry shaped for charts; the live stream resumes after ``last_id``."""

    job_id: int
    world_size: int
    bucket: int
    """Iterations per point."""
    first_iteration: int | None
    last_iteration: int | None
    last_id: int
    """Stream cursor: the newest telemetry row included here (0 when there is none)."""
    ranks: list[RankSeries]
    measured: dict[str, list[float]]
    """``iteration`` and ``iteration_ms``: per bucket, the mean over iterations of the slowest
    rank's data + compute + sync time, i.e. the measured synchronous iteration time."""
    plan_effects: list[PlanEffect]
    window: list[RankWindow]
    window_iterations: int
    """How many recent iterations ``window`` averages."""


class ThroughputOut(Response):
    """A job's recent training speed, from rank 0's worker-side timestamps."""

    job_id: int
    samples_per_s: float | None
    iteration: int | None
    """The newest iteration reported by rank 0."""
