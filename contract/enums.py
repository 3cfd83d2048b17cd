"""The states and kinds every side of the contract names: roles, host, device, job and worker
states (with their transitions), plan sources, policies and override kinds.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Token roles, each including the rights of those before it except ``agent``.

    viewer < operator < admin. ``agent`` is separate: it reads like a viewer and writes only for
    its own host and the ranks placed there. ``worker`` is the credential of one rank of one
    job, minted by the control plane when it hands the rank to its agent (never through
    ``/tokens``): it reads its own job's plan and spec and posts its own rank's telemetry,
    nothing else, and dies when the job ends.
    """

    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    AGENT = "agent"
    WORKER = "worker"


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
           ^ |                 |                                 |
           | |                 +--------> FAILED <---------------+
           | +-----------------+---------> CANCELLED <-----------+
           +-----restarted-----+---------------------------------+

    PENDING waits for free devices. STARTING has devices and waits for its agents to launch the
    workers. A rank's failure or a lost host sends a STARTING or RUNNING job back to PENDING as
    its next attempt while its ``max_restarts`` allows, else to FAILED. SUCCEEDED, FAILED and
    CANCELLED are terminal and free the devices.
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
    JobStatus.STARTING: frozenset(
        {JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PENDING}
    ),
    JobStatus.RUNNING: frozenset(
        {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.PENDING}
    ),
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
