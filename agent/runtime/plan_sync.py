"""Switching every rank to a new plan at once, and refusing bad plans everywhere.

:class:`PlanAgreement` runs on every rank of the all-reduce group, at every iteration boundary.
The *leader* (the lowest rank in the group; rank 0 unless a plan excluded it) puts its newest
candidate (or the current plan) into a tiny integer message (:func:`encode_plan`)::

    [version, global_batch, length, n_excluded, size_0 .. size_{W-1}, excl_0 .. excl_{W-1},
     cap_0 .. cap_{W-1}, gone_0 .. gone_{W-1}]

where ``excl_r`` counts how often rank ``r`` is listed as excluded, ``cap_r`` is rank ``r``'s
memory cap, the most samples one forward/backward pass may hold (0: none; a rank whose share is
larger runs it as several passes and accumulates the gradients, the update unchanged), and
``gone_r`` is 1 when rank ``r`` has *departed*: it was excluded and its process died, so it is
never readmitted and the job's end does not wait for it (``server.services.departures``). Every rank decodes the *same*
message and runs the *same* validation, so all accept or all refuse, and a new version takes effect
at the same iteration everywhere. Refused (logged, counted, old plan kept): sizes negative, not
summing to B, above the job's ``max_batch_per_worker``, a length that is not the world size; an
excluded rank listed twice, out of range, or given samples; every rank excluded; a departed rank
not excluded, or readmitted (departed in the current plan, not in the new one); and a membership
change that keeps no rank of the current group (nobody would hold the current parameters).

Candidates come from ``propose`` (a :class:`~agent.runtime.fetcher.PlanFetcher`'s ``latest``);
every rank may hold one, only the leader's is called.

Membership. When an agreed plan changes the set of active ranks, the agreement calls its
``regroup`` hook (:class:`~agent.runtime.membership.Membership` through the context) between
receiving the plan and sending the next message, so the next message already travels in the new
group; a rank the plan excludes sends nothing until it is readmitted (:meth:`PlanAgreement.
resume`). Without a hook, plans that exclude ranks are refused.

Cost. The message normally rides in spare slots of the gradient all-reduce the iteration does
anyway (see :class:`~agent.runtime.gradients.GradientSync`), so agreement adds no collective; a
new plan takes effect one iteration after the leader saw it. Where the gradients cannot carry it
(on a GPU, where reading it back would synchronise the host, or with 16-bit gradients), it is a
tiny int64 broadcast, pipelined: started at boundary ``i``, waited for at ``i + every``, so its
latency hides behind compute. On NCCL jobs that broadcast goes over a gloo group so the control
tensor stays on the CPU. Nothing is allocated per iteration beyond a tensor of ``4 + 4 * world``
integers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from agent.runtime.fetcher import FetchPlan, PlanFetcher
from agent.runtime.gradients import CONTROL_MAX, ControlValues
from contract.agent import PlanOut

__all__ = [
    "FetchPlan",
    "PlanAgreement",
    "PlanFetcher",
    "RuntimePlan",
    "agree_initial",
    "decode_plan",
    "encode_plan",
    "message_length",
    "plan_problem",
]

log = logging.getLogger("evenflow.runtime.plan_sync")


@dataclass(frozen=True)
class RuntimePlan:
    """The part of a plan the runtime acts on: its version and one local batch size per rank."""

    version: int
    batch_sizes: tuple[int, ...]
    global_batch: int = -1
    """The plan's own statement of B (``PlanOut.global_batch``); -1 means 'use sum(sizes)'."""
    excluded: tuple[int, ...] = ()
    """Ranks out of the all-reduce group under this plan (their batch is 0)."""
    memory_caps: tuple[int, ...] = ()
    """Per rank, the most samples one pass may hold (0: no cap); empty when no rank has one."""
    departed: tuple[int, ...] = ()
    """Excluded ranks whose process is gone for good: nobody waits for them, the end included."""

    @classmethod
    def of(cls, plan: PlanOut | RuntimePlan) -> RuntimePlan:
        if isinstance(plan, RuntimePlan):
            return plan
        caps = tuple(c or 0 for c in plan.memory_caps or ())
        return cls(
            plan.version,
            tuple(plan.batch_sizes),
            plan.global_batch,
            tuple(plan.excluded),
            caps if any(caps) else (),
            tuple(sorted(plan.departed or ())),
        )

    def cap_of(self, rank: int) -> int | None:
        """Rank ``rank``'s memory cap (most samples per pass), or None."""
        cap = self.memory_caps[rank] if rank < len(self.memory_caps) else 0
        return cap or None

    @property
    def active(self) -> tuple[int, ...]:
        """The ranks in the all-reduce group, ascending (every rank not excluded)."""
        out = set(self.excluded)
        return tuple(r for r in range(len(self.batch_sizes)) if r not in out)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks still in the job, ascending: every rank that has not departed."""
        gone = set(self.departed)
        return tuple(r for r in range(len(self.batch_sizes)) if r not in gone)

    @property
    def leader(self) -> int:
        """The lowest active rank: it proposes plans and is the root of re-synchronisation."""
        return self.active[0]


def plan_problem(
    plan: RuntimePlan, world_size: int, global_batch: int, max_batch: int | None = None
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
    problem = _exclusion_problem(plan, world_size)
    if problem is not None:
        return problem
    if sum(sizes) != global_batch:
        return f"batch sizes sum to {sum(sizes)}, global batch is {global_batch}"
    if plan.global_batch not in (-1, global_batch):
        return f"plan is for global batch {plan.global_batch}, job has {global_batch}"
    if max_batch is not None and max(sizes) > max_batch:
        return f"batch size {max(sizes)} above max_batch_per_worker {max_batch}"
    caps = plan.memory_caps
    if caps and (len(caps) != world_size or min(caps) < 0):
        return f"memory caps {list(caps)} are not one count >= 0 per rank"
    return None


def _exclusion_problem(plan: RuntimePlan, world_size: int) -> str | None:
    excluded, sizes = plan.excluded, plan.batch_sizes
    if len(set(excluded)) != len(excluded):
        return f"a rank is excluded twice in {list(excluded)}"
    if any(not 0 <= r < world_size for r in excluded):
        return f"excluded ranks {list(excluded)} outside 0..{world_size - 1}"
    if len(excluded) == world_size:
        return "every rank is excluded"
    stray = [r for r in plan.departed if r not in excluded]
    if stray:
        return f"departed rank {stray[0]} is not excluded"
    given = [r for r in excluded if sizes[r]]
    if given:
        return f"excluded rank {given[0]} is given {sizes[given[0]]} samples"
    return None


def message_length(world_size: int) -> int:
    """Integers in one agreement message (see the module docstring)."""
    return 4 + 4 * world_size


def encode_plan(plan: RuntimePlan, world_size: int) -> list[int]:
    """The plan as an agreement message; lengths or ranks that do not fit are kept detectable."""
    sizes = list(plan.batch_sizes)[:world_size]
    sizes += [0] * (world_size - len(sizes))
    flags = [0] * world_size
    for r in plan.excluded:
        if 0 <= r < world_size:
            flags[r] += 1
    caps = list(plan.memory_caps)[:world_size]
    caps += [0] * (world_size - len(caps))
    gone = [0] * world_size
    for r in plan.departed:
        if 0 <= r < world_size:
            gone[r] = 1
    head = [plan.version, plan.global_batch, len(plan.batch_sizes), len(plan.excluded)]
    return head + sizes + flags + caps + gone


def decode_plan(message: Sequence[int], world_size: int) -> tuple[RuntimePlan, str | None]:
    """The plan in a message, and what is wrong with its shape (before :func:`plan_problem`)."""
    version, gb, length, n_excluded = message[:4]
    sizes = tuple(message[4 : 4 + world_size])
    flags = message[4 + world_size : 4 + 2 * world_size]
    excluded = tuple(r for r, n in enumerate(flags) for _ in range(n))
    caps = tuple(message[4 + 2 * world_size : 4 + 3 * world_size])
    gone = message[4 + 3 * world_size : 4 + 4 * world_size]
    departed = tuple(r for r, g in enumerate(gone) if g)
    plan = RuntimePlan(version, sizes, gb, excluded, caps if any(caps) else (), departed)
    if length != world_size:
        return plan, f"{length} batch sizes for {world_size} ranks"
    if n_excluded != len(excluded):
        return plan, f"{n_excluded} excluded ranks named, {len(excluded)} of them in range"
    return plan, None


class ControlChannel(Protocol):
    """Carries a few small integers from one rank to every rank on a collective that runs anyway.

    :class:`~agent.runtime.gradients.GradientSync` is one: its all-reduce has control slots.
    """

    control_capacity: int

    def send_control(self, values: ControlValues) -> None:
        """``values`` may be a callable: asked for them only as the collective starts."""

    def received_control(self) -> list[int] | None: ...


Regroup = Callable[[int, RuntimePlan, RuntimePlan], tuple[dist.ProcessGroup | None, int]]
"""``regroup(iteration, old, new) -> (control group, leader)`` when the active set changes."""


class PlanAgreement:
    """Every active rank calls :meth:`at_boundary` before every iteration, in the same order.

    ``propose`` returns the newest candidate plan or ``None`` (typically ``PlanFetcher.latest``);
    only the leader's is called. ``history`` lists ``(iteration, version)`` each time the plan in
    force changed, starting with the initial plan at iteration ``start_iteration``.

    Three transports, all deciding identically on every rank:

    - *channel* (:meth:`use_channel`): the message rides in the gradient all-reduce of the
      iteration, so the agreement costs no collective at all; the leader encodes it as that
      all-reduce starts, so a candidate it holds by then (even one that arrived during the
      iteration's compute) is in force from ``i + 1``. The runtime uses it whenever the
      gradients can carry it.
    - *pipelined* broadcast (default otherwise): one tiny async broadcast per ``every``
      boundaries, waited for at the next one, so its latency hides behind compute; a candidate
      seen at boundary ``i`` is in force from ``i + every``.
    - *blocking* broadcast (``pipelined=False``): in force at once, at the price of a round trip.
    """

    def __init__(
        self,
        initial: RuntimePlan,
        *,
        rank: int,
        world_size: int,
        global_batch: int,
        propose: Callable[[], PlanOut | RuntimePlan | None] | None = None,
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
        self.leader = initial.leader
        """The rank whose candidates are sent (the lowest active rank)."""
        self._propose = propose
        self._group = group
        self._regroup: Regroup | None = None
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
        """Integers in one agreement message (see the module docstring)."""
        return message_length(self.world_size)

    @property
    def transport(self) -> str:
        if self._channel is not None:
            return "channel"
        return "pipelined" if self.pipelined else "blocking"

    @property
    def active(self) -> bool:
        """Whether this rank is in the all-reduce group under the current plan."""
        return self.rank not in self.current.excluded

    def use_channel(self, channel: ControlChannel) -> bool:
        """Agree through ``channel`` from now on; ``False`` (and no change) if it cannot.

        Call it on every rank alike, before the first boundary or between two of them.
        """
        if channel.control_capacity < self.message_length:
            return False
        self.close()
        self._channel = channel
        return True

    def on_regroup(self, regroup: Regroup | None) -> None:
        """Install the hook that changes groups when the active set changes (see the module)."""
        self._regroup = regroup

    def set_group(self, group: dist.ProcessGroup | None, leader: int) -> None:
        """The group the agreement runs in, and its leader (before any boundary, every rank)."""
        self._group, self.leader = group, leader

    def at_boundary(self, iteration: int) -> RuntimePlan:
        """The plan to train iteration ``iteration`` on; the same on every active rank."""
        if self._channel is not None:
            received = self._channel.received_control()
            if received is not None:
                self._apply(iteration, received[: self.message_length])
            self._send(iteration)
            return self.current
        if iteration % self.every:
            return self.current
        if self.pipelined:
            if self._in_flight:
                self.close()
                self._apply(iteration, self._buf.tolist())
        else:
            self._broadcast(async_op=False)
            self._apply(iteration, self._buf.tolist())
        self._send(iteration)
        return self.current

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the agreement runs in (``None``: the default group)."""
        return self._group

    def resume(self, iteration: int, plan: RuntimePlan, group: dist.ProcessGroup | None) -> None:
        """Readmitted at ``iteration`` under ``plan``: do what the others do after receiving at
        that boundary (send the next message, in the new group)."""
        self.current = plan
        self._group, self.leader = group, plan.leader
        self._send(iteration)

    def close(self) -> None:
        """Wait for an outstanding broadcast (every rank must call this, like at_boundary)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._in_flight = False

    def _send(self, iteration: int) -> None:
        if not self.active:
            return
        if self._channel is not None:
            # Encoded as the all-reduce starts, not now: a candidate that arrives during this
            # iteration's compute still rides in this iteration's all-reduce.
            self._channel.send_control(self._encode if self.rank == self.leader else None)
        elif self.pipelined and iteration % self.every == 0:
            self._broadcast(async_op=True)

    def _broadcast(self, *, async_op: bool) -> None:
        message = self._encode()
        if message is not None:
            self._buf.copy_(torch.tensor(message))
        if dist.is_initialized():
            self._work = dist.broadcast(
                self._buf, src=self.leader, group=self._group, async_op=async_op
            )
        self._in_flight = async_op

    def _encode(self) -> list[int] | None:
        """The leader's message: the newest acceptable-looking candidate, else the current plan."""
        if self.rank != self.leader:
            return None
        plan = self.current
        candidate = None
        if self._propose is not None:
            try:
                candidate = self._propose()
            except Exception as exc:  # a broken proposer must not stop training
                log.warning("plan proposer failed: %r", exc)
        if candidate is not None:
            c = RuntimePlan.of(candidate)
            fresh = c.version not in self.refused and c.version not in self._unsendable
            if c.version > self.current.version and fresh:
                plan = c
        message = encode_plan(plan, self.world_size)
        if self._channel is not None and any(abs(v) >= CONTROL_MAX for v in message):
            # Float slots carry integers exactly only below 2**24; never send a rounded plan.
            log.error("plan v%d has values too large to send; ignored", plan.version)
            self._unsendable.add(plan.version)
            return encode_plan(self.current, self.world_size)
        return message

    def _apply(self, iteration: int, message: list[int]) -> None:
        plan, problem = decode_plan(message, self.world_size)
        if plan.version <= self.current.version:
            return
        old = self.current
        regroup = plan.active != old.active
        if problem is None:
            problem = plan_problem(plan, self.world_size, self.global_batch, self.max_batch)
        back = sorted(set(old.departed) - set(plan.departed))
        if problem is None and back:
            problem = f"rank {back[0]} has departed; a plan cannot readmit it"
        if problem is None and regroup:
            if self._regroup is None:
                problem = "this runtime cannot change the all-reduce group (no membership)"
            elif not set(plan.active) & set(old.active):
                problem = f"no rank of the current group {list(old.active)} stays active"
        if problem is not None:
            if plan.version not in self.refused:
                self.refused[plan.version] = problem
                log.warning(
                    "plan v%d refused at iteration %d: %s", plan.version, iteration, problem
                )
            return
        self.current = plan
        self.history.append((iteration, plan.version))
        log.info("plan v%d in force from iteration %d: %s", plan.version, iteration, plan)
        if regroup:
            assert self._regroup is not None
            self._group, self.leader = self._regroup(iteration, old, plan)


def agree_initial(
    plan: PlanOut | RuntimePlan | None,
    *,
    rank: int,
    world_size: int,
    global_batch: int,
    group: dist.ProcessGroup | None = None,
    max_batch: int | None = None,
) -> RuntimePlan:
    """Rank 0's initial plan, broadcast to all (blocking, once).

    Every rank raises the same ``ValueError`` when rank 0 has no plan or an unusable one, so a job
    fails at start on all ranks alike rather than hanging the others.
    """
    buf = torch.zeros(message_length(world_size), dtype=torch.int64)
    if rank == 0 and plan is not None:
        buf.copy_(torch.tensor(encode_plan(RuntimePlan.of(plan), world_size)))
    if dist.is_initialized():
        dist.broadcast(buf, src=0, group=group)
    message = buf.tolist()
    initial, problem = decode_plan(message, world_size)
    if initial.version == 0 and message[2] == 0:
        raise ValueError("rank 0 has no initial plan")
    if problem is None:
        problem = plan_problem(initial, world_size, global_batch, max_batch)
    if problem:
        raise ValueError(f"initial plan v{initial.version} refused: {problem}")
    return initial
