"""Heartbeats worked out in the database, in groups when they queue (``server.slot_groups``).

The route (``server.api.routes.hosts``) answers a steady heartbeat from memory; any other is a
:class:`Beat` handed to the app's ``heartbeat_groups``, which works out the heartbeats waiting
together in one transaction (:func:`work_heartbeats`): each one's answer as ``hosts.answer``
builds it, in arrival order, then the jobs their reports concern advanced once, their report
locks taken in id order (``hosts.finish``), then one commit. Each heartbeat gets its own
outcome; a group that fails as a whole is worked again a heartbeat at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from sqlalchemy.orm import Session

from contract.agent import Heartbeat
from contract.enums import WorkerState
from server.api.deps import retrying_transaction
from server.context import AppContext
from server.host_answers import EVERY_HOST, changed_so_far, changes_of
from server.services import hosts
from server.services.tokens import Principal


@dataclass(frozen=True)
class Beat:
    """A heartbeat to work out in the database."""

    host_id: int
    heartbeat: Heartbeat
    principal: Principal
    now: datetime

    @property
    def alone(self) -> bool:
        """A heartbeat reporting a failure takes its jobs' report locks at once, as it may
        restart a job (``jobs.apply_worker_reports``): in a group it would take them in the
        middle of the group's, in another order than other groups, so it goes alone."""
        return any(r.state is WorkerState.FAILED for r in self.heartbeat.workers)


class Worked(NamedTuple):
    """A heartbeat's answer once its transaction committed."""

    answered: hosts.Answered
    own: frozenset[int]
    """The hosts whose answers that transaction's commit invalidated (``HostAnswers.put``)."""
    overtaken: bool
    """A later heartbeat of the same transaction changed this host after its answer was built:
    the answer was right when built, as it would have been committed first, but it must not
    be kept."""


def work_heartbeats(context: AppContext, beats: list[Beat]) -> list[Worked | BaseException]:
    """The ``beats``' answers, worked out in one transaction (tried again from the start when
    the database aborts it for another's sake); should it fail otherwise, each on its own."""
    try:
        return list(retrying_transaction(context, lambda session: _together(session, beats)))
    except Exception as exc:
        if len(beats) == 1:
            return [exc]
    return [work_heartbeats(context, [beat])[0] for beat in beats]


def _together(session: Session, beats: list[Beat]) -> list[Worked]:
    answered: list[hosts.Answered] = []
    changed: list[set[int]] = []
    for i, beat in enumerate(beats):
        if i:  # what the ones before changed is flushed: read it afresh
            session.expire_all()
        with changes_of(session) as by_this:
            answered.append(
                hosts.answer(session, beat.host_id, beat.heartbeat, beat.principal, beat.now)
            )
            session.flush()
        changed.append(by_this)
    hosts.finish(session, answered, max(beat.now for beat in beats))
    session.flush()  # all of it: what the commit invalidates is known before it
    own = changed_so_far(session)
    worked = []
    later: set[int] = set()
    for beat, answer, by_this in reversed(list(zip(beats, answered, changed, strict=True))):
        overtaken = beat.host_id in later or EVERY_HOST in later
        worked.append(Worked(answer, own, overtaken))
        later |= by_this
    return worked[::-1]
