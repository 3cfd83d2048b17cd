"""Who is in the gradient all-reduce group: exclusion, probing, readmission (partial all-reduce).

A plan may name ``excluded`` ranks (their batch is 0). From the boundary where it is agreed, the
active ranks all-reduce among themselves and never wait for an excluded one; the excluded rank
probes its speed off the critical path, and a later plan readmits it. One rank's states::

               plan agreed at boundary i excludes me
      ACTIVE ------------------------------------------> EXCLUDED <--+
        ^                                                 |  |       | tick (t, version) from
        |   join notice (j, plan, root, group log):       |  +-------+ the leader: probe once,
        |   replay missed group creations, regroup,       |            report it as iteration t
        |   re-synchronise from root, train iteration j   |
        +-------------------------------------------------+
                                                          | end notice (the job's last iteration
                                                          v is done): re-synchronise, leave loop
                                          (an abort notice, from an active rank that failed or
                                          left the loop early: raise, as the active ranks do)

Roles at a boundary where the active set changes from ``A`` to ``A'`` (all deterministic, so
every rank computes the same): the *notifier* is ``min(A)`` (it drove the agreement); the new
*leader* is ``min(A')``; the *root* of re-synchronisation is ``min(A & A')`` (plans keeping no rank
of ``A`` are refused). Readmitted ranks are ``A' - A``.

Groups. ``torch.distributed.new_group`` names a group by a per-process counter, so every rank must
make the same sequence of calls; ranks outside the new group return at once, without any
communication (gloo, and NCCL without eager init; ``TORCH_DIST_INIT_BARRIER=1`` would break this),
while members connect to each other only. So a group for ``A'`` is created at the boundary where
it is agreed, by every rank in step there (all of ``A``, plus readmitted ranks): excluded ranks
take no part. Each creation is appended to a *creation log* that every rank in step holds
identically; a readmitted rank replays the entries it missed (as a non-member, locally) before
the next creation, so the counters agree again. A set of ranks gets its group once and keeps it
(the log decides, the same everywhere), so flapping between two sets costs one creation each.
(``use_local_synchronization=True`` would avoid the replay, but it names groups by the number
of groups a process already has, which differs between ranks after an exclusion.) Under NCCL a
subgroup has both backends (``cpu:gloo,cuda:nccl``) so the same group carries the CPU control
messages. The whole world uses the default group and the job's control group; nothing is made.

Mailbox. Notices to an excluded rank travel through the job's rendezvous store (the
``torch.distributed`` TCPStore, world-level and asynchronous): one key per rank, last writer wins,
under a prefix unique to this context (a nonce agreed in :meth:`Membership.setup`). The leader
writes ticks every ``probe_every`` iterations; the notifier writes the join notice before making
the group; the excluded rank polls the key between probes and never blocks anyone. The active
ranks wait for a readmitted rank only at its join (group connect and re-synchronisation), at most
one probe plus one poll interval late. (A store key rather than a posted ``irecv``: there is no
send left unmatched when the leader changes while a rank is out, and last-writer-wins is exactly
"the newest iteration".)

Cost: making a subgroup takes milliseconds, once per distinct set of active ranks, and
switching to a known one next to nothing; a tick or notice is one store write; re-synchronisation
sends parameters and optimizer state from one rank, so it grows with the model. The straggler
ladder prices both (``server.services.stragglers``).
"""

from __future__ import annotations

import enum
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agent.runtime.plan_sync import RuntimePlan, encode_plan

log = logging.getLogger("evenflow.runtime.membership")

Ranks = tuple[int, ...]


class GroupRole(enum.Enum):
    """Whether this rank is in the all-reduce group (see the module docstring's diagram)."""

    ACTIVE = "active"
    EXCLUDED = "excluded"


@dataclass(frozen=True)
class ExclusionOptions:
    """How an excluded rank probes and waits."""

    probe_every: int = 4
    """The leader sends a tick every this many iterations; each tick allows one probe."""
    probe_max_batch: int = 64
    """Cap on a probe's batch (the plan's mean local batch, capped)."""
    poll_s: float = 0.002
    """Sleep between two reads of the mailbox."""
    silence_timeout_s: float = 600.0
    """An excluded rank that hears nothing new for this long raises (the job is gone)."""


@dataclass(frozen=True)
class Notice:
    """A message to an excluded rank. ``kind`` is ``tick``, ``join``, ``end`` or ``abort``."""

    kind: str
    iteration: int
    """tick: the active ranks' iteration; join and end: the iteration to rejoin at."""
    version: int
    plan: tuple[int, ...] = ()
    """join: the agreement message of the plan in force from ``iteration``; end: of the plan
    in force at the end (who is still in the job)."""
    root: int = -1
    """join and end: the rank re-synchronisation comes from."""
    log: tuple[Ranks, ...] = ()
    """join and end: the group creation log so far."""

    def dumps(self) -> str:
        return json.dumps([self.kind, self.iteration, self.version, self.plan, self.root, self.log])

    @classmethod
    def loads(cls, raw: bytes | str) -> Notice:
        kind, iteration, version, plan, root, creations = json.loads(raw)
        return cls(kind, iteration, version, tuple(plan), root, tuple(map(tuple, creations)))


@dataclass(frozen=True)
class Transition:
    """One change of the active set, as every rank in step sees it."""

    iteration: int
    active: Ranks
    readmitted: Ranks
    root: int
    """The rank whose parameters and optimizer state the readmitted ranks receive."""
    group: dist.ProcessGroup | None
    """The gradient group of ``active`` (``None``: the default group, or not a member)."""
    control: dist.ProcessGroup | None
    """The group the agreement (and CPU tensors of re-synchronisation) use."""


class Membership:
    """One rank's side of the group state machine; see the module docstring."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        options: ExclusionOptions = ExclusionOptions(),
        timeout: timedelta | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.timeout = timeout
        """The collective timeout of the groups made here (None: torch's default)."""
        self.role = GroupRole.ACTIVE
        self.log: list[Ranks] = []
        """Every subgroup created so far (rank sets, in creation order); the same on all ranks
        in step."""
        self.regroup_ms: list[float] = []
        """Host time of each change of group on this rank (creation or switch)."""
        self._world = (group, control_group)
        self._groups: dict[Ranks, dist.ProcessGroup] = {}
        self._store = store
        self._mailbox: dist.Store | None = None

    @property
    def excluded(self) -> bool:
        """Out of the all-reduce group under the plan in force (probing now and then)."""
        return self.role is GroupRole.EXCLUDED

    def setup(self, initial: RuntimePlan) -> None:
        """Collective over the whole world, every rank in step (``ctx.prepare``): agree this
        context's mailbox prefix, and make the group of the initial plan's active ranks."""
        if not dist.is_initialized():  # one process: only a given store can be the mailbox
            if self._store is not None:
                self._mailbox = dist.PrefixStore("evenflow/local/", self._store)
            return
        nonce = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        dist.broadcast(nonce, src=0, group=self._world[1])
        store = self._store or dist.distributed_c10d._get_default_store()
        self._mailbox = dist.PrefixStore(f"evenflow/{int(nonce.item())}/", store)
        self.groups_for(initial.active)
        self.role = GroupRole.ACTIVE if self.rank in initial.active else GroupRole.EXCLUDED

    def groups_for(
        self, active: Ranks
    ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """(gradient group, control group) of ``active``; makes it on first use.

        Every rank in step must call this at the same point (non-members return at once).
        """
        if len(active) == self.world_size:
            return self._world
        if active not in self.log:
            backend = None if dist.get_backend() == "gloo" else "cpu:gloo,cuda:nccl"
            group = dist.new_group(list(active), backend=backend, timeout=self.timeout)
            self.log.append(active)
            if self.rank in active:
                self._groups[active] = group
        group = self._groups.get(active)
        return group, group

    def switch(self, iteration: int, old: RuntimePlan, new: RuntimePlan) -> Transition:
        """Every rank of ``old.active`` calls this at the boundary where ``new`` was agreed."""
        start = time.perf_counter()
        readmitted = tuple(r for r in new.active if r not in old.active)
        root = min(set(old.active) & set(new.active))
        if self.rank == old.leader:  # the notifier: before the group, which waits for them
            notice = Notice(
                "join", iteration, new.version, tuple(encode_plan(new, self.world_size)), root
            )
            for r in readmitted:
                self._post(r, notice, with_log=True)
        group, control = self.groups_for(new.active)
        self.role = GroupRole.ACTIVE if self.rank in new.active else GroupRole.EXCLUDED
        self.regroup_ms.append((time.perf_counter() - start) * 1000.0)
        if self.role is GroupRole.EXCLUDED:
            log.info("rank %d: excluded from iteration %d", self.rank, iteration)
        return Transition(iteration, new.active, readmitted, root, group, control)

    def rejoin(self, notice: Notice, active: Ranks) -> Transition:
        """An excluded rank that received a join or end notice: replay the group creations it
        missed, then take its part in making the new group."""
        start = time.perf_counter()
        for ranks in notice.log[len(self.log) :]:
            assert self.rank not in ranks, "an excluded rank missed a group it belongs to"
            backend = None if dist.get_backend() == "gloo" else "cpu:gloo,cuda:nccl"
            # Not a member: local and immediate.
            dist.new_group(list(ranks), backend=backend, timeout=self.timeout)
            self.log.append(ranks)
        group, control = self.groups_for(active)
        self.role = GroupRole.ACTIVE
        self.regroup_ms.append((time.perf_counter() - start) * 1000.0)
        readmitted = (self.rank,)  # as far as this rank knows; the root knows them all
        return Transition(notice.iteration, active, readmitted, notice.root, group, control)

    def tick(self, iteration: int, plan: RuntimePlan) -> None:
        """The leader tells excluded ranks where the job is, every ``probe_every`` iterations."""
        if not plan.excluded or self.rank != plan.leader:
            return
        if iteration % self.options.probe_every:
            return
        notice = Notice("tick", iteration, plan.version)
        for r in plan.excluded:
            self._post(r, notice, with_log=False)

    def end(self, iteration: int, plan: RuntimePlan) -> Transition:
        """Every active rank, after the job's last iteration, when ranks still in the job are
        excluded: the leader tells them (the notice carries the plan, so they know who is
        still in), and all re-synchronise in the group of the ranks still in the job: the
        world, unless some departed (their process is gone; nobody waits for them)."""
        waiting = tuple(r for r in plan.excluded if r not in plan.departed)
        if self.rank == plan.leader:
            message = tuple(encode_plan(plan, self.world_size))
            notice = Notice("end", iteration, plan.version, message, root=plan.leader)
            for r in waiting:
                self._post(r, notice, with_log=True)
        group, control = self.groups_for(plan.members)
        return Transition(iteration, plan.members, waiting, plan.leader, group, control)

    def abort(self, iteration: int, plan: RuntimePlan) -> None:
        """An active rank whose loop failed tells the excluded ranks (best effort, never raises),
        so they fail now rather than at their silence timeout."""
        if self._mailbox is None or self.role is not GroupRole.ACTIVE:
            return
        try:
            for r in plan.excluded:
                self._post(r, Notice("abort", iteration, plan.version), with_log=False)
        except Exception as exc:
            log.warning("rank %d: could not tell excluded ranks of the failure: %r", self.rank, exc)

    def wait(self, since: int, probe: Callable[[int, int], None]) -> Notice:
        """Excluded from iteration ``since``: probe on each new tick until a join or end notice.

        ``probe(iteration, version)`` runs at most once per tick, with strictly increasing
        iterations, all in ``[since, join)``: they never collide with this rank's other rows.
        """
        probed = since - 1
        heard = time.monotonic()
        while True:
            notice = self._read()
            if notice is not None and notice.iteration >= since:
                if notice.kind == "abort":
                    raise RuntimeError(
                        f"rank {self.rank}: the active ranks stopped at iteration "
                        f"{notice.iteration} while this rank was excluded"
                    )
                if notice.kind != "tick":
                    return notice
                if notice.iteration > probed:
                    probed = notice.iteration
                    heard = time.monotonic()
                    probe(notice.iteration, notice.version)
                    continue
            if time.monotonic() - heard > self.options.silence_timeout_s:
                raise TimeoutError(
                    f"rank {self.rank}: excluded since iteration {since} and no word from the "
                    f"active ranks for {self.options.silence_timeout_s:.0f} s"
                )
            time.sleep(self.options.poll_s)

    def _key(self, rank: int) -> str:
        return f"mailbox/{rank}"

    def _post(self, rank: int, notice: Notice, *, with_log: bool) -> None:
        if with_log:
            notice = Notice(
                notice.kind,
                notice.iteration,
                notice.version,
                notice.plan,
                notice.root,
                tuple(self.log),
            )
        assert self._mailbox is not None, "Membership.setup() was not called"
        self._mailbox.set(self._key(rank), notice.dumps())

    def _read(self) -> Notice | None:
        assert self._mailbox is not None, "Membership.setup() was not called"
        key = self._key(self.rank)
        if not self._mailbox.check([key]):
            return None
        return Notice.loads(self._mailbox.get(key))
