"""A rank's side of partial all-reduce: leaving the group, sitting out, coming back.

:class:`Readmission` is a part of :class:`~agent.runtime.context.EvenflowContext` (its base
class): the agreement's regroup hook, the excluded rank's wait (probing its speed on each tick)
until it is readmitted or the job ends, the re-synchronisation of parameters, optimizer state,
registered state and the job's records, and the end of the loop, where ranks still excluded get
the trained model. A sharded stream's positions live here too: a rank that leaves the group
hands how far it read its shards to the others, so checkpoints written while it is out still
hold them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.checkpoint import LoadState, SaveState
from agent.runtime.datasets import Source, to_device
from agent.runtime.ddp import OverlapSync
from agent.runtime.emulation import Emulator
from agent.runtime.fsdp import ShardedSync
from agent.runtime.gradients import GradientSync
from agent.runtime.membership import GroupRole, Membership, Notice, Transition
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan, decode_plan
from agent.runtime.probes import ProbeLoss, forward_sum, probe, probe_size
from agent.runtime.resync import resync
from agent.runtime.sampler import Sampler
from agent.runtime.stats import ContextStats
from agent.runtime.timing import IterationTiming
from contract.spec import JobSpec

log = logging.getLogger("evenflow.runtime.context")


class Readmission:
    """The membership half of :class:`~agent.runtime.context.EvenflowContext`."""

    rank: int
    world_size: int
    iteration: int
    device: torch.device
    spec: JobSpec
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    agreement: PlanAgreement
    membership: Membership
    emulator: Emulator | None
    stats: ContextStats
    probe_loss: ProbeLoss | None
    _sync: GradientSync | OverlapSync | ShardedSync | None
    _sampler: Sampler | None
    _source: Source | None
    _states: dict[str, tuple[SaveState, LoadState]]
    _frozen: dict[int, int]
    _after: tuple[tuple[int, ...], Any, Any] | None
    _probe_failed: bool
    ended: bool
    _emit: Any

    def _end(self) -> None:
        """After the last iteration (or an early stop): ranks still excluded are re-synchronised
        so that every rank ends with the trained model."""
        assert self._sync is not None
        self.ended = True
        final = self.agreement.current
        if self.membership.role is GroupRole.ACTIVE and set(final.excluded) - set(final.departed):
            self.agreement.close()
            tr = self.membership.end(self.iteration, final)
            self._resync(tr, False)
            self._sync.group = tr.group
            self._after = (final.members, tr.group, tr.control)

    def _positions(self) -> dict[int, int] | None:
        """Positions only the ranks know (a sharded stream's): gathered from every active rank
        (a collective among them), with those of excluded ranks as of their exclusion."""
        assert self._source is not None
        mine = self._source.rank_state()
        if mine is None:
            return None
        merged = dict(self._frozen)
        for state in self._gather(mine, self.agreement.group):
            for shard, n in state.items():
                merged[shard] = max(merged.get(shard, 0), n)
        return merged

    def _gather(self, state: dict[int, int], group: Any) -> list[dict[int, int]]:
        if not dist.is_initialized():
            return [state]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, state, group=group)
        return out

    # ------------------------------------------------------------------------ membership

    def _regroup(self, iteration: int, old: RuntimePlan, new: RuntimePlan) -> tuple[Any, int]:
        """The agreement's hook, on every rank of ``old.active``, when ``new`` changes them."""
        assert self._sync is not None
        leaving = set(old.active) - set(new.active)
        mine = self._source.rank_state() if self._source is not None else None
        if leaving and mine is not None:  # a sharded stream: keep the leavers' positions
            for shard, n in (
                p for state in self._gather(mine, self.agreement.group) for p in state.items()
            ):
                self._frozen[shard] = max(self._frozen.get(shard, 0), n)
        tr = self.membership.switch(iteration, old, new)
        if self.membership.role is GroupRole.ACTIVE:
            self._sync.group = tr.group
            if tr.readmitted:
                self._resync(tr, False)
        return tr.control, new.leader

    def _sit_out(self, since: int) -> bool:
        """Excluded from ``since``: probe until readmitted (then ``self.iteration`` is the join
        iteration and the agreement is in step; False) or until the job's end, early or not
        (then ``self.iteration`` is where it ended; True)."""
        assert self._sync is not None
        notice: Notice = self.membership.wait(since, self._probe)
        if notice.kind == "join":
            plan, problem = decode_plan(notice.plan, self.world_size)
            assert problem is None, problem  # the active ranks accepted it
            tr = self.membership.rejoin(notice, plan.active)
            self._resync(tr, True)
            self._sync.group = tr.group
            self.agreement.resume(notice.iteration, plan, tr.control)
        else:  # the end: re-synchronised among the ranks still in the job
            members = tuple(range(self.world_size))
            if notice.plan:
                members = decode_plan(notice.plan, self.world_size)[0].members
            tr = self.membership.rejoin(notice, members)
            self._resync(tr, True)
            self._sync.group = tr.group
            self._after = (members, tr.group, tr.control)
        self.stats.exclusions.append((since, notice.iteration))
        self.iteration = notice.iteration
        log.info("rank %d: readmitted at iteration %d", self.rank, notice.iteration)
        self.ended = notice.kind != "join"
        return self.ended

    def _resync(self, tr: Transition, apply: bool) -> None:
        assert self.model is not None and self.optimizer is not None
        t0 = time.perf_counter()
        s, a = self.stats, self.agreement
        records: tuple[Any, ...] | None = None
        if self.rank == tr.root:
            states = {name: save() for name, (save, _) in self._states.items()}
            records = (a.history, a.refused, s.global_samples, s.losses, s._loss_stride)
            records += (s._loss_calls, states)
        records = resync(
            self.model,
            self.optimizer,
            rank=self.rank,
            root=tr.root,
            apply=apply,
            group=tr.group,
            control=tr.control,
            extra=records,
        )
        if apply:  # the job's records and the user's state, so every rank ends with the same
            history, refused, samples, losses, stride, calls, states = records
            a.history, a.refused, s.global_samples = history, refused, samples
            s.losses, s._loss_stride, s._loss_calls = losses, stride, calls
            for name, (_, load) in self._states.items():
                if name in states:
                    load(states[name])
        self.stats.resync_ms.append((time.perf_counter() - t0) * 1000.0)

    def _probe(self, iteration: int, version: int) -> None:
        """One speed probe while excluded; best effort (a failing probe stops probing)."""
        assert self.model is not None and self._sync is not None and self._sampler is not None
        source = self._source
        if self._probe_failed or source is None:
            return
        sampler, plan = self._sampler, self.agreement.current
        b = probe_size(
            len(plan.active),
            self.spec.global_batch,
            self.membership.options.probe_max_batch,
            self.spec.max_batch_per_worker,
            sampler.dataset_size,
        )
        idx = sampler.permutation(sampler.position(iteration)[0])[:b]
        try:
            timing = probe(
                lambda: to_device(source.load(idx), self.device),
                self.probe_loss or forward_sum(self.model),
                iteration=iteration,
                batch_size=b,
                device=self.device,
                emulator=self.emulator,
            )
        except Exception as exc:
            log.warning("rank %d: speed probe failed, probing stops: %r", self.rank, exc)
            self._probe_failed = True
            return
        finally:
            self._sync.zero_grad()  # a probe's gradients are never used
        self.stats.probes += 1
        self._emit(
            [
                IterationTiming(
                    iteration, version, b, timing.data_ms, timing.compute_ms, 0, time.time()
                )
            ],
            probe=True,
        )
