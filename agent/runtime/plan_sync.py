"""Getting plans from the control plane, and switching every rank to a new plan at once.

Two parts, so the HTTP side never touches the training loop:

- :class:`PlanFetcher` runs on rank 0 only, in a daemon thread. It polls ``fetch_plan()`` and keeps
  the newest plan whose version is above the one it already knows. Errors are counted and logged,
  with exponential back-off, and never leave the thread.
- :class:`PlanAgreement` runs on every rank, at every iteration boundary. Rank 0 puts its newest
  candidate (or the current plan) into a tiny integer message ``[version, global_batch, length,
  sizes...]``; every rank decodes the *same* message and runs the *same* validation, so all ranks
  accept or all refuse, and a new version takes effect at the same iteration everywhere. A plan
  whose sizes are negative, do not sum to B, exceed the job's ``max_batch_per_worker``, or whose
  length is not the world size is refused (logged, counted) and the old plan kept.

Cost. The message normally rides in spare slots of the gradient all-reduce the iteration does
anyway (see :class:`~agent.runtime.gradients.GradientSync`), so agreement adds no collective; a
new plan takes effect one iteration after rank 0 saw it. Where the gradients cannot carry it (on
a GPU, where reading it back would synchronise the host, or with 16-bit gradients), it is a tiny
int64 broadcast, pipelined: started at boundary ``i``, waited for at ``i + every``, so its latency
hides behind compute. On NCCL jobs that broadcast goes over a gloo group so the control tensor
stays on the CPU. Nothing is allocated per iteration beyond a tensor of ``3 + world`` integers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from agent.runtime.gradients import CONTROL_MAX
from agent.wire import PlanOut

log = logging.getLogger(__name__)

FetchPlan = Callable[[], PlanOut | None]


@dataclass(frozen=True)
class Plan:
    """The part of a plan the runtime acts on: its version and one local batch size per rank."""

    version: int
    batch_sizes: tuple[int, ...]
    global_batch: int = -1
    """The plan's own statement of B (``PlanOut.global_batch``); -1 means 'use sum(sizes)'."""

    @classmethod
    def of(cls, plan: PlanOut | Plan) -> Plan:
        if isinstance(plan, Plan):
            return plan
        return cls(plan.version, tuple(plan.batch_sizes), plan.global_batch)


def plan_problem(
    plan: Plan, world_size: int, global_batch: int, max_batch: int | None = None
) -> str | None:
    """Why this plan must not be trained on, or ``None`` if it is fine.

    ``max_batch`` is the job's ``max_batch_per_worker`` (a memory cap), when it has one.
    """
    sizes = plan.batch_sizes
    if plan.version < 1:
        return f"version {plan.version} < 1"
    if len(sizes) != world_size:
        return f"{len(sizes)} batch sizes for {world_size} ranks"
    if any(b < 0 for b in sizes):
        return f"negative batch size in {list(sizes)}"
    if sum(sizes) != global_batch:
        return f"batch sizes sum to {sum(sizes)}, global batch is {global_batch}"
    if plan.global_batch not in (-1, global_batch):
        return f"plan is for global batch {plan.global_batch}, job has {global_batch}"
    if max_batch is not None and max(sizes) > max_batch:
        return f"batch size {max(sizes)} above max_batch_per_worker {max_batch}"
    return None


class PlanFetcher:
    """Polls ``fetch_plan`` in a daemon thread; :meth:`latest` never blocks, nothing raises."""

    def __init__(
        self,
        fetch_plan: FetchPlan,
        *,
        interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        known_version: int = 0,
    ) -> None:
        self._fetch = fetch_plan
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self._known = known_version
        self._latest: PlanOut | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evenflow-plan-fetcher", daemon=True)
        self.fetches = 0
        self.errors = 0

    def start(self) -> PlanFetcher:
        self._thread.start()
        return self

    def latest(self) -> PlanOut | None:
        """The newest plan fetched with a version above the initial known one, if any."""
        with self._lock:
            return self._latest

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        delay = self.interval_s
        while not self._stop.is_set():
            try:
                plan = self._fetch()
                self.fetches += 1
                delay = self.interval_s
                if plan is not None and plan.version > self._known:
                    with self._lock:
                        self._known = plan.version
                        self._latest = plan
            except Exception as exc:  # never into the loop; a dead fetcher only means old plans
                self.errors += 1
                delay = min(max(delay, self.interval_s) * 2, self.max_backoff_s)
                if self.errors == 1 or self.errors % 20 == 0:
                    log.warning("plan fetch failed (%d so far): %r", self.errors, exc)
            self._stop.wait(delay)


class ControlChannel(Protocol):
    """Carries a few small integers from rank 0 to every rank on a collective that runs anyway.

    :class:`~agent.runtime.gradients.GradientSync` is one: its all-reduce has control slots.
    """

    control_capacity: int

    def send_control(self, values: list[int] | None) -> None: ...

    def received_control(self) -> list[int] | None: ...


class PlanAgreement:
    """Every rank calls :meth:`at_boundary` before every iteration, in the same order.

    ``propose`` (rank 0 only; ignored elsewhere) returns the newest candidate plan or ``None``;
    typically ``PlanFetcher.latest``. ``history`` lists ``(iteration, version)`` each time the plan
    in force changed, starting with the initial plan at iteration ``start_iteration``.

    Three transports, all deciding identically on every rank:

    - *channel* (:meth:`use_channel`): the message rides in the gradient all-reduce of the
      iteration, so the agreement costs no collective at all; a candidate seen at boundary ``i``
      is in force from ``i + 1``. The runtime uses it whenever the gradients can carry it.
    - *pipelined* broadcast (default otherwise): one tiny async broadcast per ``every``
      boundaries, waited for at the next one, so its latency hides behind compute; a candidate
      seen at boundary ``i`` is in force from ``i + every``.
    - *blocking* broadcast (``pipelined=False``): in force at once, at the price of a round trip.
    """

    def __init__(
        self,
        initial: Plan,
        *,
        rank: int,
        world_size: int,
        global_batch: int,
        propose: Callable[[], PlanOut | Plan | None] | None = None,
        group: dist.ProcessGroup | None = None,
        every: int = 1,
        pipelined: bool = True,
        start_iteration: int = 0,
        max_batch: int | None = None,
    ) -> None:
        problem = plan_problem(initial, world_size, global_batch, max_batch)
        if problem:
            raise ValueError(f"initial plan v{initial.version} refused: {problem}")
        if every < 1:
            raise ValueError("every must be at least 1")
        self.rank = rank
        self.world_size = world_size
        self.global_batch = global_batch
        self.max_batch = max_batch
        self.current = initial
        self.every = every
        self.pipelined = pipelined
        self._propose = propose if rank == 0 else None
        self._group = group
        self._buf = torch.zeros(self.message_length, dtype=torch.int64)
        self._work: dist.Work | None = None
        self._in_flight = False
        self._channel: ControlChannel | None = None
        self._unsendable: set[int] = set()
        self.refused: dict[int, str] = {}
        """Version -> reason, for every plan version refused (the same on every rank)."""
        self.history: list[tuple[int, int]] = [(start_iteration, initial.version)]

    @property
    def message_length(self) -> int:
        """Integers in one agreement message: version, global batch, length, sizes."""
        return 3 + self.world_size

    @property
    def transport(self) -> str:
        if self._channel is not None:
            return "channel"
        return "pipelined" if self.pipelined else "blocking"

    def use_channel(self, channel: ControlChannel) -> bool:
        """Agree through ``channel`` from now on; ``False`` (and no change) if it cannot.

        Call it on every rank alike, before the first boundary or between two of them.
        """
        if channel.control_capacity < self.message_length:
            return False
        self.close()
        self._channel = channel
        return True

    def at_boundary(self, iteration: int) -> Plan:
        """The plan to train iteration ``iteration`` on; the same on every rank."""
        if self._channel is not None:
            received = self._channel.received_control()
            if received is not None:
                self._apply(iteration, received[: self.message_length])
            self._channel.send_control(self._encode())
            return self.current
        if iteration % self.every:
            return self.current
        if self.pipelined:
            if self._in_flight:
                self.close()
                self._apply(iteration, self._buf.tolist())
            self._broadcast(iteration, async_op=True)
        else:
            self._broadcast(iteration, async_op=False)
            self._apply(iteration, self._buf.tolist())
        return self.current

    def close(self) -> None:
        """Wait for an outstanding broadcast (every rank must call this, like at_boundary)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._in_flight = False

    def _broadcast(self, iteration: int, *, async_op: bool) -> None:
        message = self._encode()
        if message is not None:
            self._buf.copy_(torch.tensor(message))
        if dist.is_initialized():
            self._work = dist.broadcast(self._buf, src=0, group=self._group, async_op=async_op)
        self._in_flight = async_op

    def _encode(self) -> list[int] | None:
        """Rank 0's message: the newest acceptable-looking candidate, else the current plan."""
        if self._propose is None:
            return None
        plan = self.current
        try:
            candidate = self._propose()
        except Exception as exc:  # a broken proposer must not stop training
            log.warning("plan proposer failed: %r", exc)
            candidate = None
        if candidate is not None:
            c = Plan.of(candidate)
            fresh = c.version not in self.refused and c.version not in self._unsendable
            if c.version > self.current.version and fresh:
                plan = c
        message = self._message(plan)
        if self._channel is not None and any(abs(v) >= CONTROL_MAX for v in message):
            # Float slots carry integers exactly only below 2**24; never send a rounded plan.
            log.error("plan v%d has values too large to send; ignored", plan.version)
            self._unsendable.add(plan.version)
            return self._message(self.current)
        return message

    def _message(self, plan: Plan) -> list[int]:
        sizes = list(plan.batch_sizes)[: self.world_size]
        sizes += [0] * (self.world_size - len(sizes))
        return [plan.version, plan.global_batch, len(plan.batch_sizes), *sizes]

    def _apply(self, iteration: int, message: list[int]) -> None:
        version, gb, length, *sizes = message
        if version <= self.current.version:
            return
        if length != self.world_size:
            problem: str | None = f"{length} batch sizes for {self.world_size} ranks"
        else:
            problem = plan_problem(
                Plan(version, tuple(sizes), gb), self.world_size, self.global_batch, self.max_batch
            )
        if problem is not None:
            if version not in self.refused:
                self.refused[version] = problem
                log.warning("plan v%d refused at iteration %d: %s", version, iteration, problem)
            return
        self.current = Plan(version, tuple(sizes), gb)
        self.history.append((iteration, version))
        log.info("plan v%d in force from iteration %d: %s", version, iteration, sizes)


def agree_initial(
    plan: PlanOut | Plan | None,
    *,
    rank: int,
    world_size: int,
    global_batch: int,
    group: dist.ProcessGroup | None = None,
    max_batch: int | None = None,
) -> Plan:
    """Rank 0's initial plan, broadcast to all (blocking, once).

    Every rank raises the same ``ValueError`` when rank 0 has no plan or an unusable one, so a job
    fails at start on all ranks alike rather than hanging the others.
    """
    buf = torch.zeros(3 + world_size, dtype=torch.int64)
    if rank == 0 and plan is not None:
        p = Plan.of(plan)
        sizes: Sequence[int] = list(p.batch_sizes)[:world_size]
        buf.copy_(
            torch.tensor(
                [p.version, p.global_batch, len(p.batch_sizes), *sizes]
                + [0] * (world_size - len(sizes))
            )
        )
    if dist.is_initialized():
        dist.broadcast(buf, src=0, group=group)
    version, gb, length, *rest = buf.tolist()
    if version == 0 and length == 0:
        raise ValueError("rank 0 has no initial plan")
    if length != world_size:
        raise ValueError(f"initial plan v{version} refused: {length} sizes for {world_size} ranks")
    initial = Plan(version, tuple(rest), gb)
    problem = plan_problem(initial, world_size, global_batch, max_batch)
    if problem:
        raise ValueError(f"initial plan v{version} refused: {problem}")
    return initial
