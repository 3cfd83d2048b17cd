"""Which free devices a job gets: an integer program over devices and hosts.

With min-max batch balancing, a synchronous job's throughput is close to the *sum* of its devices'
speeds (every device is kept busy; that is the point of balancing), so a job prefers many fast
devices. Every host beyond the first adds cross-host all-reduce traffic, charged as a penalty p
in samples/s per extra host. With ``x_d`` = "device d is used" and ``y_h`` = "host h is used"::

    maximise    sum_d v_d x_d  -  p * (sum_h y_h - 1)
    subject to  x_d <= y_h(d)                          a used device's host counts as used
                min_workers <= sum_d x_d <= max_workers
                x_d = 0 for devices with less memory than the job needs

It is solved in the cheapest way that proves the answer optimal:

1. A greedy placement: hosts in order of their best devices' total speed, devices fastest
   first, a new host only while it pays for its penalty. When it meets an upper bound on every
   placement (``upper_bound``: for each size k, the k fastest devices less the penalty of the
   fewest hosts that could hold k), it is optimal, proven: on a fleet of uniform, whole hosts,
   the common case.
2. Otherwise (hosts partly taken, models mixed: the fleet's inventory once jobs come and go),
   ``by_hosts``: the program's structure makes it a knapsack over hosts (a placement is how
   many of each host's fastest devices it takes), solved exactly by dynamic programming in
   milliseconds even at 10,000 devices, where CBC takes seconds of a core per job, up to its
   time limit.
3. CBC, warm-started from the greedy placement (``warmStart``), only where the dynamic
   program's table would pass ``DP_MAX_CELLS`` (thousands of workers on a large inventory).

The status says what was established: ``optimal`` (proven), ``feasible`` (CBC's time limit hit,
best found so far) or ``infeasible`` (fewer eligible devices than ``min_workers``). A job that
does not fit is not an error here, it waits, so ``infeasible`` is a status and not an exception.

Several pending jobs are placed one at a time, higher priority first (ties in submission order),
each from the devices the earlier ones left.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pulp

from server.planner.errors import InvalidInput
from server.planner.ilp import SolveStatus, run_cbc
from server.planner.problem import IntArray

DeviceId = int | str

DEFAULT_HOST_PENALTY_SHARE = 0.01
"""Without an explicit penalty, each extra host costs 1% of the median eligible device speed:
enough to prefer fewer hosts among equals, too little to refuse a genuinely faster spread."""


@dataclass(frozen=True)
class FreeDevice:
    """A free device and its predicted speed for the job's workload."""

    id: DeviceId
    host: str
    model: str = ""
    memory_gb: float = 0.0
    samples_per_s: float = 1.0
    """From telemetry of similar jobs, or the ``profiles`` prior."""

    def __post_init__(self) -> None:
        speed = self.samples_per_s
        if not math.isfinite(speed) or speed < 0:
            raise InvalidInput(f"device {self.id}: samples_per_s must be finite and >= 0")


@dataclass(frozen=True)
class JobRequest:
    """What a pending job needs."""

    id: str
    min_workers: int
    max_workers: int | None = None
    """None means exactly ``min_workers``."""
    priority: int = 0
    host_penalty: float | None = None
    """Samples/s charged per host beyond the first; None for the default share."""
    min_memory_gb: float = 0.0

    def __post_init__(self) -> None:
        top = self.max_workers if self.max_workers is not None else self.min_workers
        if self.min_workers < 1 or top < self.min_workers:
            raise InvalidInput(
                f"job {self.id}: need 1 <= min_workers <= max_workers, got "
                f"{self.min_workers}..{self.max_workers}",
                field="workers",
            )
        if self.host_penalty is not None and not (
            math.isfinite(self.host_penalty) and self.host_penalty >= 0
        ):
            raise InvalidInput(f"job {self.id}: host_penalty must be >= 0", field="host_penalty")

    @property
    def most(self) -> int:
        return self.max_workers if self.max_workers is not None else self.min_workers


@dataclass(frozen=True)
class Placement:
    """The devices one job gets (none when ``status`` is infeasible)."""

    job_id: str
    device_ids: tuple[DeviceId, ...]
    hosts_used: tuple[str, ...]
    predicted_samples_per_s: float
    """Sum of the chosen devices' speeds."""
    status: SolveStatus
    objective: float
    """Predicted samples/s minus the host penalties: what the placement maximised."""
    reason: str = ""


def _value(chosen: Sequence[FreeDevice], penalty: float) -> float:
    hosts = {d.host for d in chosen}
    return sum(d.samples_per_s for d in chosen) - penalty * max(len(hosts) - 1, 0)


def greedy(job: JobRequest, devices: Sequence[FreeDevice], penalty: float) -> list[FreeDevice]:
    """A feasible, usually good placement (the ILP's warm start); [] if none exists."""
    if len(devices) < job.min_workers:
        return []
    by_host: dict[str, list[FreeDevice]] = {}
    for d in sorted(devices, key=lambda d: -d.samples_per_s):
        by_host.setdefault(d.host, []).append(d)
    hosts = sorted(by_host, key=lambda h: -sum(d.samples_per_s for d in by_host[h][: job.most]))
    chosen: list[FreeDevice] = []
    for h in hosts:
        room = job.most - len(chosen)
        if room <= 0:
            break
        take = by_host[h][:room]
        gain = sum(d.samples_per_s for d in take) - (penalty if chosen else 0.0)
        if len(chosen) >= job.min_workers and gain <= 0:
            continue
        chosen.extend(take)
    return chosen


DP_MAX_CELLS = 20_000_000
"""``by_hosts`` runs while its table (a row of ``max_workers + 1`` per device it may take, host by
host) stays under this many cells; a bigger job on a bigger inventory goes to CBC. A
256-worker job on 10,000 devices makes 2.6 million."""


def by_hosts(job: JobRequest, devices: Sequence[FreeDevice], penalty: float) -> list[FreeDevice]:
    """The best placement, exactly, by dynamic programming over hosts; [] if none exists.

    Given how many devices a placement takes from each host, its best devices there are the
    host's fastest, so a placement is a count per host: ``best[c]``, the most value of ``c``
    devices on the hosts seen so far, each host used costing ``penalty``, takes host h's ``n``
    fastest or none (``best[c] = max(best[c], best[c - n] + top_h(n) - penalty)``). The answer
    is the best ``c`` between ``min_workers`` and ``max_workers`` (plus the first host's
    penalty, which the objective does not charge), and the counts are read back host by host.
    Among equal values it keeps fewer devices and leaves later hosts out."""
    most = min(job.most, len(devices))
    if most < job.min_workers:
        return []
    by_host: dict[str, list[FreeDevice]] = {}
    for d in sorted(devices, key=lambda d: -d.samples_per_s):
        by_host.setdefault(d.host, []).append(d)
    best = np.full(most + 1, -np.inf)
    best[0] = 0.0
    taken: list[tuple[str, IntArray]] = []
    for host, ds in by_host.items():
        gains = np.cumsum([d.samples_per_s for d in ds[:most]]) - penalty
        new = best.copy()
        count = np.zeros(most + 1, dtype=np.int64)
        for n, gain in enumerate(gains.tolist(), start=1):
            candidate = best[: most + 1 - n] + gain
            better = candidate > new[n:]
            new[n:][better] = candidate[better]
            count[n:][better] = n
        best = new
        taken.append((host, count))
    c = job.min_workers + int(np.argmax(best[job.min_workers :]))
    if not math.isfinite(float(best[c])):
        return []
    chosen: list[FreeDevice] = []
    for host, count in reversed(taken):
        n = int(count[c])
        chosen.extend(by_host[host][:n])
        c -= n
    return chosen


def _by_hosts_cells(job: JobRequest, devices: Sequence[FreeDevice]) -> int:
    """The cells ``by_hosts``'s table holds: its rows are at most as long as there are devices
    to take (a job asking for 10,000 workers among 4,000 free devices needs 4,001 a row)."""
    most = min(job.most, len(devices))
    per_host = Counter(d.host for d in devices)
    return sum(min(n, most) for n in per_host.values()) * (most + 1)


def upper_bound(job: JobRequest, devices: Sequence[FreeDevice], penalty: float) -> float:
    """No placement of ``job`` on ``devices`` is worth more than this: over each allowed size k,
    the k fastest devices' speeds less the penalty of the fewest hosts that can hold k devices
    (each term bounds the placements of size k; both parts are the best any k could do)."""
    speeds = sorted((d.samples_per_s for d in devices), reverse=True)
    sizes = sorted(Counter(d.host for d in devices).values(), reverse=True)
    best, total, held, hosts = -math.inf, 0.0, 0, 0
    for k in range(1, min(job.most, len(speeds)) + 1):
        total += speeds[k - 1]
        while held < k:
            held, hosts = held + sizes[hosts], hosts + 1
        if k >= job.min_workers:
            best = max(best, total - penalty * (hosts - 1))
    return best


def place(
    job: JobRequest, devices: Iterable[FreeDevice], *, time_limit_s: float = 10.0, threads: int = 1
) -> Placement:
    """Best devices for one job among ``devices`` (see the module docstring)."""
    pool = list(devices)
    if len({d.id for d in pool}) != len(pool):
        raise InvalidInput("a device id appears twice", field="devices")
    eligible = [d for d in pool if d.memory_gb >= job.min_memory_gb]
    if len(eligible) < job.min_workers:
        return Placement(
            job.id,
            (),
            (),
            0.0,
            SolveStatus.INFEASIBLE,
            0.0,
            f"job {job.id} needs {job.min_workers} devices with >= {job.min_memory_gb} GB, "
            f"{len(eligible)} are free",
        )
    penalty = job.host_penalty
    if penalty is None:
        penalty = DEFAULT_HOST_PENALTY_SHARE * statistics.median(d.samples_per_s for d in eligible)
    start = greedy(job, eligible, penalty)
    value = _value(start, penalty)
    bound = upper_bound(job, eligible, penalty)
    if value >= bound - 1e-9 * max(1.0, abs(bound)):
        return _placement(
            job, start, penalty, SolveStatus.OPTIMAL, "the greedy placement meets the upper bound"
        )
    if _by_hosts_cells(job, eligible) <= DP_MAX_CELLS:
        exact = by_hosts(job, eligible, penalty)
        chosen = exact if _value(exact, penalty) > value else start
        reason = "exact over hosts (by_hosts); the greedy placement did not meet the bound"
        return _placement(job, chosen, penalty, SolveStatus.OPTIMAL, reason)
    return _by_cbc(job, eligible, start, penalty, time_limit_s=time_limit_s, threads=threads)


def _placement(
    job: JobRequest, chosen: Sequence[FreeDevice], penalty: float, status: SolveStatus, reason: str
) -> Placement:
    return Placement(
        job_id=job.id,
        device_ids=tuple(d.id for d in chosen),
        hosts_used=tuple(sorted({d.host for d in chosen})),
        predicted_samples_per_s=sum(d.samples_per_s for d in chosen),
        status=status,
        objective=_value(chosen, penalty),
        reason=reason,
    )


def _by_cbc(
    job: JobRequest,
    eligible: list[FreeDevice],
    start: list[FreeDevice],
    penalty: float,
    *,
    time_limit_s: float,
    threads: int,
) -> Placement:
    """The integer program, solved by CBC from the greedy ``start``."""
    # Stated as a minimisation of the negated value: PuLP 3.3's CBC warm start of a
    # maximisation returned the start itself as "optimal" (4 where 30 was possible; found by
    # test_the_bound_never_undercuts_a_placement_and_what_it_proves_is_optimal).
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x_{i}", cat="Binary") for i in range(len(eligible))]
    hosts = sorted({d.host for d in eligible})
    y = {h: pulp.LpVariable(f"y_{j}", cat="Binary") for j, h in enumerate(hosts)}
    prob += penalty * (pulp.lpSum(y.values()) - 1) - pulp.lpSum(
        d.samples_per_s * xi for d, xi in zip(eligible, x, strict=True)
    )
    for i, (d, xi) in enumerate(zip(eligible, x, strict=True)):
        prob += xi <= y[d.host], f"host_{i}"
    prob += pulp.lpSum(x) >= job.min_workers, "min_workers"
    prob += pulp.lpSum(x) <= job.most, "max_workers"
    picked = {id(d) for d in start}
    for d, xi in zip(eligible, x, strict=True):
        xi.setInitialValue(1 if id(d) in picked else 0)
    for h, yh in y.items():
        yh.setInitialValue(1 if any(d.host == h for d in start) else 0)
    status = run_cbc(prob, time_limit_s=time_limit_s, warm_start=True, threads=threads)

    reason = ""
    if status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        chosen = [d for d, xi in zip(eligible, x, strict=True) if (xi.varValue or 0.0) > 0.5]
        if status is SolveStatus.FEASIBLE:
            reason = f"time limit {time_limit_s} s reached; best placement found, not proven"
    elif status is SolveStatus.NO_SOLUTION:
        chosen, status = start, SolveStatus.FEASIBLE
        reason = "CBC found no placement within the time limit; greedy placement used"
    else:  # CBC says infeasible although the counts allow a placement: do not trust either
        raise AssertionError(f"CBC called a feasible placement infeasible for job {job.id}")
    if _value(start, penalty) > _value(chosen, penalty):  # never worse than the warm start
        chosen = start
    return _placement(job, chosen, penalty, status, reason)


def place_jobs(
    jobs: Iterable[JobRequest],
    devices: Iterable[FreeDevice],
    *,
    time_limit_s: float = 10.0,
    backfill: bool = True,
    threads: int = 1,
) -> tuple[Placement, ...]:
    """Place pending jobs by priority (higher first, ties in the given order).

    Each job takes from what the earlier ones left. With ``backfill`` a job that does not fit
    does not stop lower-priority jobs that do; without it, they wait behind it. Returns one
    placement per job, in the order they were considered.
    """
    ordered = sorted(enumerate(jobs), key=lambda pair: (-pair[1].priority, pair[0]))
    free = list(devices)
    out: list[Placement] = []
    blocked: str | None = None
    for _, job in ordered:
        if blocked is not None:
            out.append(
                Placement(
                    job.id, (), (), 0.0, SolveStatus.INFEASIBLE, 0.0, f"waits behind job {blocked}"
                )
            )
            continue
        placement = place(job, free, time_limit_s=time_limit_s, threads=threads)
        out.append(placement)
        if placement.status is SolveStatus.INFEASIBLE:
            if not backfill:
                blocked = job.id
            continue
        taken = set(placement.device_ids)
        free = [d for d in free if d.id not in taken]
    return tuple(out)
