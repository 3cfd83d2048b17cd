"""The agent protocol: host registration, heartbeats and their assignments, the plan a training
leader polls, and the telemetry workers post.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from contract.base import (
    MAX_ID,
    MAX_METRIC_VALUE,
    MAX_TELEMETRY_RECORDS,
    MAX_WORKERS,
    Id,
    Ms,
    Name,
    Request,
    Response,
    Text,
)
from contract.enums import DeviceKind, HostStatus, PlanSource, WorkerState


class DeviceInfo(Request):
    index: int = Field(ge=0, le=1023)
    kind: DeviceKind = Field(strict=False)
    model: Text = Field(min_length=1, max_length=128)
    memory_mb: int = Field(ge=0, le=10_000_000)


AgentInstance = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""The id of one agent process (a uuid4 hex per start)."""

WORKER_EXIT_JOB_ENDED = 3
"""A worker's exit status when it stopped because its job had ended on the control plane
(its telemetry was answered 409 or its credential refused): the agent reports it stopped."""

WORKER_ORPHAN_EXIT_S = 10.0
"""A worker exits within this long of its agent's death (``agent.runtime.parent``): the control
plane counts on it before it shows the devices of a silent host's ended jobs free."""


WORKER_EXIT_FATAL = 4
"""A worker's exit status when the job cannot run as specified wherever it is placed (its
checkpoint path cannot be written): the control plane fails the job without restarting it."""

WORKER_EXIT_AGENT_GONE = 5
"""A worker's exit status when its agent died (``agent.runtime.parent``), and what an agent
started again reports for a rank its dead predecessor ran (``error`` then says so in words):
the control plane restarts the job, naming the agent's end as the reason."""


class HostRegister(Request):
    protocol_version: int = Field(ge=0, le=MAX_ID)
    name: Name
    address: Text = Field(min_length=1, max_length=255)
    devices: list[DeviceInfo] = Field(min_length=1, max_length=256)
    instance: AgentInstance | None = None
    """This agent process. While another instance holds the host and heartbeats, registering
    is refused with 409, unless ``replace``."""
    replace: bool = False
    """Take the host over from a live instance (``evenflow agent --replace``): the old
    instance's heartbeats are then refused with 409 and it exits."""

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


LOG_TAIL_CHARS = 32_768
"""The most of a rank's log an agent uploads (its last lines)."""


class WorkerReport(Request):
    """What an agent says about one of its workers."""

    job_id: Id
    rank: int = Field(ge=0, lt=MAX_WORKERS)
    state: WorkerState = Field(strict=False)
    exit_code: int | None = Field(default=None, ge=-(2**31), le=MAX_ID)
    signal: str | None = Field(default=None, pattern=r"^SIG[A-Z0-9+]{1,16}$")
    """The signal that killed the process (``SIGKILL``), when one did."""
    error: Text | None = Field(default=None, max_length=65_536)
    attempt: int = Field(default=0, ge=0, le=MAX_ID)
    """The job attempt the rank was launched for (``Assignment.attempt``); reports about an
    earlier attempt's processes are ignored."""
    log_tail: Text | None = Field(default=None, max_length=LOG_TAIL_CHARS)
    """The last lines of the rank's log (at most ``LOG_TAIL_CHARS``), sent with a rank that
    ended, succeeded or not: what it printed before it ended; and, while the job's logs are
    followed (``Assignment.follow_log_until``), with a running rank as its log grows."""
    log_end: int | None = Field(default=None, ge=0, le=2**62)
    """Where ``log_tail`` ends in the log, in bytes from its start: what a follower uses to
    print only the lines that are new since the tail it saw before."""


class Heartbeat(Request):
    workers: list[WorkerReport] = Field(default_factory=list, max_length=1024)
    instance: AgentInstance | None = None
    """The agent process sending it; refused with 409 once another instance holds the host."""


class Assignment(Response):
    """One rank an agent must run (``desired='run'``) or stop (``desired='stop'``)."""

    job_id: int
    rank: int
    world_size: int
    device_index: int
    device_kind: DeviceKind
    master_addr: str
    master_port: int
    """Rank 0's rendezvous port; 0 until rank 0 has bound one (it picks a free port and
    publishes it; the other ranks look it up, ``PUT/GET /jobs/{id}/rendezvous``)."""
    backend: Literal["nccl", "gloo"]
    desired: Literal["run", "stop"]
    spec: dict[str, Any]
    """The job's JobSpec as JSON."""
    worker_token: str | None = None
    """The rank's own credential (role ``worker``), given to its process as ``EVENFLOW_TOKEN``.
    Sent while the rank is still to be launched (each such answer mints a new one and retires
    the one before); None once it runs, and for ranks to stop."""
    attempt: int = 0
    """Which start of the job this is: 0, then one more for each restart after a failure. A
    rank of a new attempt is a new process (fresh credential and rendezvous), even where the
    same rank of an earlier attempt ran on this host."""
    follow_log_until: datetime | None = None
    """Someone follows the job's logs until then: the agent uploads the rank's live log tail
    with its heartbeats (``WorkerReport.log_tail`` of a running rank) while its log grows."""


class RendezvousIn(Request):
    """Rank 0's worker tells the control plane the port its rendezvous store bound."""

    port: int = Field(ge=1, le=65535)


class RendezvousOut(Response):
    """Where a job's ranks meet: rank 0's host address and the port it bound (None until rank
    0 has published it)."""

    job_id: int
    address: str
    port: int | None


class HeartbeatAck(Response):
    host_id: int
    status: HostStatus
    assignments: list[Assignment] = []


class PlanOut(Response):
    job_id: int
    version: int
    batch_sizes: list[int]
    """Local batch size per rank; sums to ``global_batch``."""
    excluded: list[int] = []
    """Ranks out of the all-reduce group under this plan (partial all-reduce); their batch is 0.
    They only probe their speed off the critical path until a later plan readmits them."""
    departed: list[int] = []
    """Ranks of ``excluded`` that have left the job for good (their process is gone): no later
    plan readmits them and the others never wait for them, the job's end included."""

    @field_validator("departed", mode="before")
    @classmethod
    def _none_is_empty(cls, v: object) -> object:
        return [] if v is None else v  # a plan stored before departures were recorded

    global_batch: int
    source: PlanSource
    reason: str
    predicted_ms: float | None = None
    created_at: datetime
    created_by: str | None = None
    memory_caps: list[int | None] | None = None
    """Per rank, the most samples one forward/backward pass may hold (from its fitted memory
    model and its device's memory, less the headroom); None: no cap known. A rank whose batch is
    larger runs it as several passes and accumulates the gradients."""


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
    peak_memory_mb: float | None = Field(default=None, ge=0, le=1e9, allow_inf_nan=False)
    """Peak device memory of the iteration's compute (CUDA: ``max_memory_allocated`` after a
    reset; emulated: the worker's memory formula); None where it is not measured (CPU)."""
    oom_batch: int | None = Field(default=None, ge=1, le=10_000_000)
    """The size of a pass that ran out of device memory in this iteration (the rank then redid
    the iteration in smaller passes); None when none did."""
    pass_size: int | None = Field(default=None, ge=1, le=10_000_000)
    """The largest pass the iteration ran (its batch, unless it accumulated over passes): what
    ``peak_memory_mb`` belongs to. None: not reported (one pass of ``batch_size``)."""


TELEMETRY_FIELDS = tuple(TelemetryRecord.model_fields)
"""The fields of a record, in the order of ``TelemetryColumns``' arrays."""


class TelemetryColumns(Request):
    """Records as one array per field (entry i of every array is record i): the same bounds as
    ``TelemetryRecord``, in half the bytes of the record objects and a fraction of the server's
    parsing. The form the runtime posts."""

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
    peak_memory_mb: (
        list[Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] | None] | None
    ) = None
    """Absent: no record measured its peak memory."""
    oom_batch: list[Annotated[int, Field(ge=1, le=10_000_000)] | None] | None = None
    """Absent: no record ran out of memory."""
    pass_size: list[Annotated[int, Field(ge=1, le=10_000_000)] | None] | None = None
    """Absent: no record reported its largest pass."""

    @model_validator(mode="after")
    def _same_length(self) -> TelemetryColumns:
        n = len(self.rank)
        for name in TELEMETRY_FIELDS:
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"columns.{name} has {len(values)} values; columns.rank has {n}")
        return self

    def arrays(self) -> tuple[list[Any], ...]:
        """Every field's array in ``TELEMETRY_FIELDS`` order (the optional ones filled in)."""
        n = len(self.rank)
        filled: dict[str, list[Any]] = {
            "probe": self.probe if self.probe is not None else [False] * n,
            "peak_memory_mb": self.peak_memory_mb
            if self.peak_memory_mb is not None
            else [None] * n,
            "oom_batch": self.oom_batch if self.oom_batch is not None else [None] * n,
            "pass_size": self.pass_size if self.pass_size is not None else [None] * n,
        }
        return tuple(filled[f] if f in filled else getattr(self, f) for f in TELEMETRY_FIELDS)


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
        for optional in ("peak_memory_mb", "oom_batch", "pass_size"):
            if all(m is None for m in arrays[optional]):
                arrays[optional] = None
        columns = TelemetryColumns.model_construct(None, **arrays)
        return TelemetryBatch.model_construct(records=None, columns=columns, urgent=self.urgent)

    def wire_json(self) -> str:
        """The body to post: the columnar form, absent fields left out."""
        return self.columnar().model_dump_json(exclude_none=True)


class CheckpointReport(Request):
    """A checkpoint a job's rank has written (``POST /jobs/{id}/checkpoints``)."""

    rank: int = Field(ge=0, lt=MAX_WORKERS)
    iteration: int = Field(ge=1, le=10**12)
    """Iterations done when it was written: a resume runs this one next."""
    size_bytes: int = Field(ge=0, le=2**62)
    url: Text = Field(min_length=1, max_length=2048)
    write_ms: Ms = 0.0


class ArtifactReport(Request):
    """A file a job's rank left in its output directory, or its final model
    (``POST /jobs/{id}/artifacts``)."""

    rank: int = Field(ge=0, lt=MAX_WORKERS)
    name: str = Field(min_length=1, max_length=512)
    """Its path relative to the output directory (``final.pt`` for ``ctx.save_final()``): not
    absolute, no ``..``, no NUL or backslash."""
    size_bytes: int = Field(ge=0, le=2**62)
    url: Text = Field(min_length=1, max_length=2048)
    """Where it is: a path on the rank's host, or the URL of shared storage."""
    shared: bool = False
    """On storage other hosts reach (a shared path, an object store), not the rank's disk."""

    @field_validator("name")
    @classmethod
    def _relative(cls, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/") or "\x00" in name or "\\" in name:
            raise ValueError("must be a path inside the output directory (no '/' first, no '..')")
        return name


class TelemetryAck(Response):
    accepted: int
    duplicates: int


class MetricPoint(Request):
    """One value of a named training metric, reported by one rank at one iteration.

    ``loss`` (:data:`~contract.base.LOSS_METRIC`) is the job's global mean loss, exact, which
    the plan's leader rank reports every few iterations; other names are what user code logs
    with ``ctx.log(name, value)``. (job, name, rank, iteration) is unique: a retried batch
    never duplicates, and the first value stored wins."""

    rank: int = Field(ge=0, lt=MAX_WORKERS)
    iteration: int = Field(ge=0, le=10**12)
    name: Name
    value: float = Field(ge=-MAX_METRIC_VALUE, le=MAX_METRIC_VALUE, allow_inf_nan=False)


class MetricBatch(Request):
    points: list[MetricPoint] = Field(min_length=1, max_length=MAX_TELEMETRY_RECORDS)


class MetricAck(Response):
    accepted: int
    duplicates: int
