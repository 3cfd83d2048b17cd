"""The steady heartbeat, answered from memory.

Every host heartbeats every 2 s, hundreds of requests a second for a fleet, almost all of them
*steady*: the agent reports what it reported last time and the answer is the one it got last
time. Working that answer out costs three statements and a commit (a fourth wrote the host's
time), more than one API process's core can give a fleet (decision record 0003). So
each API process keeps, per host, the last heartbeat it answered and its answer
(:class:`HostAnswers`), and answers the same heartbeat again from memory while nothing the
answer depends on has changed. Liveness, the one thing a steady heartbeat still
writes, goes to the database in batches (:class:`Liveness`).

What an answer depends on, and so what invalidates it (:func:`track`, on every session of the
process: API workers and the controller alike):

- the host's row (status, agent instance, name; its address is every job's rank 0 address, so
  a changed address invalidates every host), its devices' (index, kind),
- its ranks' rows (job, rank, state, device, host, worker credential),
- their jobs' rows (status, attempt, rendezvous port, spec, logs followed until) and the number and places of their
  ranks (a rank added or removed changes the world size every host of the job is told).

A flush that changes any of these notes the hosts concerned (a job's hosts: one query for the
hosts of its live ranks, the only ones whose answers list it; a job that ends once all its
ranks have reported their ends concerns no host); when the transaction commits, they are
dropped from this process's answers and published on the ``hosts`` bus (``server.notify``), so
every other API process, on this machine or (PostgreSQL) another, drops them within
milliseconds. A heartbeat that changes anything is worked out in the database (its report
differs from the last); the answer it gets is kept if nothing but its own commit changed the
host meanwhile, since that answer was built after its own changes (``HostAnswers.put``'s
``own``), so the next heartbeat like it is answered from memory, and so is one with only some
of its reports (``Answer.fewer_alike``): what an agent sends once a change has been carried
(the real agent reports a state only until a heartbeat has taken it; the fleet bench drops a
rank the answer no longer lists). A notification that could not be delivered is not lost
silently: the listener is told, and drops every answer (``server.notify.LOST``, and a
``LISTEN`` that broke). An answer also expires after ``ttl_s`` whatever happens, a backstop for
a change missed anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, bindparam, event, select, text, update
from sqlalchemy.orm import Session, object_session, sessionmaker
from sqlalchemy.orm.attributes import History, get_history
from sqlalchemy.orm.base import PASSIVE_NO_INITIALIZE

from contract.agent import Heartbeat
from contract.enums import JobStatus, WorkerState
from server.models import Device, Host, Job, Worker

log = logging.getLogger("evenflow.host_answers")

T = TypeVar("T")

EVERY_HOST = 0
"""The id a change notification carries when every host's answer is affected (a host's address
changed: it is the rank 0 address of its jobs, on other hosts too). No host has id 0."""

_CHANGED = "evenflow.changed_hosts"

_RELEVANT: dict[type, frozenset[str]] = {
    Host: frozenset({"status", "agent_instance", "name", "address"}),
    Device: frozenset({"index", "kind", "host_id"}),
    Worker: frozenset({"job_id", "rank", "state", "device_id", "host_id", "token_hash"}),
    Job: frozenset({"status", "attempt", "master_port", "spec", "logs_followed_until"}),
}
"""The columns a heartbeat's answer reads (``server.services.hosts.heartbeat``); a change to any
other (telemetry marks, pending reasons, last heartbeats) leaves every answer as it was. What a
device holds and its status are not among them: an answer lists the live ranks on the host's
devices, and a device changes hands only with ranks placed on it or ended there (a rank's own
change), so a job's devices released at its end change no answer."""

_WORLD = frozenset({"job_id", "rank", "host_id"})
"""A rank's columns whose change concerns every host of its job (world size, rank 0 address)."""

_LIVE = tuple(s.value for s in WorkerState if not s.terminal)
_HOSTS_OF_JOBS = (
    select(Worker.host_id)
    .where(Worker.job_id.in_(bindparam("job_ids", expanding=True)), Worker.state.in_(_LIVE))
    .distinct()
)
"""The hosts whose answers list a job: those of its live ranks (as the flush left them). A host
whose rank of the job ended earlier was told so then and is told nothing of the job since; one
whose rank ends or moves in the same flush is concerned by that rank's own change."""


def _history(obj: Any, name: str) -> History:
    """A column's history in this flush, as ``inspect(obj).attrs[name].history`` says it,
    without that building a view of every attribute of the object at each call (a placement
    pass flushes hundreds of devices)."""
    return get_history(obj, name, passive=PASSIVE_NO_INITIALIZE)


def _changed(obj: Any, names: frozenset[str]) -> set[str]:
    changed = {name for name in names if _history(obj, name).has_changes()}
    if isinstance(obj, Job) and "status" in changed and not _ends_or_resumes(obj):
        changed.discard("status")
    return changed


def _ends_or_resumes(job: Job) -> bool:
    """Whether a job's status change crossed between live and ended: an answer says ``run`` or
    ``stop`` (and launches a rank only while its job is live), nothing more of the status, so
    a job going from ``starting`` to ``running`` (when its last rank reports running: every
    one of its hosts at once) leaves every answer as it was."""
    history = _history(job, "status")
    before = [*history.deleted, *history.unchanged][:1]
    if not before or not history.added:
        return True
    return JobStatus(before[0]).terminal != JobStatus(history.added[0]).terminal


def _old_and_new(obj: Any, name: str) -> set[Any]:
    history = _history(obj, name)
    return {*history.added, *history.unchanged, *history.deleted} - {None}


def _concerned(
    obj: Any, changed: set[str] | frozenset[str], new: bool
) -> tuple[set[int], set[int]]:
    """The hosts, and the jobs (all of whose hosts), whose answers a change to ``obj``'s
    ``changed`` columns concerns."""
    if isinstance(obj, Host):
        every = "address" in changed and not new  # (a new host is no rank 0 yet)
        return {obj.id, EVERY_HOST} if every else {obj.id}, set()
    if isinstance(obj, Device):
        return _old_and_new(obj, "host_id"), set()
    if isinstance(obj, Worker):
        jobs = _old_and_new(obj, "job_id") if changed & _WORLD else set()
        return _old_and_new(obj, "host_id"), jobs
    # a job: its ranks' hosts (a new job has none yet; ranks placed with it are new too)
    return set(), set() if new else {obj.id}


_DELETED = "evenflow.deleted_ranks"


def _on_delete(_mapper: Any, _connection: Any, target: Any) -> None:
    """A rank or device deleted in a flush, orphans of a job's restart included (which the
    session's ``deleted`` does not list): kept for ``_after_flush``."""
    session = object_session(target)
    if session is not None:
        session.info.setdefault(_DELETED, []).append(
            _concerned(target, _RELEVANT[type(target)], False)
        )


for _model in (Worker, Device):
    event.listen(_model, "after_delete", _on_delete)


def _after_flush(session: Session, _context: Any) -> None:
    hosts: set[int] = set()
    jobs: set[int] = set()
    for more_hosts, more_jobs in session.info.pop(_DELETED, []):
        hosts |= more_hosts
        jobs |= more_jobs
    for objs, new in ((session.new, True), (session.dirty, False)):
        for obj in objs:
            names = _RELEVANT.get(type(obj))
            if names is None:
                continue
            changed = names if new else _changed(obj, names)
            if not changed:
                continue
            more_hosts, more_jobs = _concerned(obj, changed, new)
            hosts |= more_hosts
            jobs |= more_jobs
    if jobs and EVERY_HOST not in hosts:
        rows = session.connection().execute(_HOSTS_OF_JOBS, {"job_ids": sorted(jobs)})
        hosts |= {row[0] for row in rows if row[0] is not None}
    if hosts:
        session.info.setdefault(_CHANGED, set()).update(hosts)


def changed_so_far(session: Session) -> frozenset[int]:
    """The hosts (:data:`EVERY_HOST` for all) whose answers the changes ``session`` has flushed
    so far concern: what its commit will invalidate, if nothing more is flushed before it."""
    return frozenset(session.info.get(_CHANGED, ()))


def own_changes(session: Session, work: Callable[[Session], T]) -> tuple[T, frozenset[int]]:
    """``work(session)``, flushed, and the hosts (:data:`EVERY_HOST` for all) whose answers its
    own changes concern, apart from those of work done before it in the same transaction (a
    group of heartbeats, ``server.scale.heartbeat_groups``): what the transaction's commit will
    invalidate on its account. The session still holds them all, for that commit."""
    earlier = session.info.pop(_CHANGED, set())
    try:
        done = work(session)
        session.flush()  # all of it: what the commit invalidates is known before it
        own = frozenset(session.info.get(_CHANGED, ()))
    finally:
        session.info.setdefault(_CHANGED, set()).update(earlier)
    return done, own


def track(sessions: sessionmaker[Session], *listeners: Callable[[set[int]], None]) -> None:
    """Tell ``listeners`` the ids of the hosts whose heartbeat answer each committed
    transaction of ``sessions`` may have changed (:data:`EVERY_HOST` for all of them)."""

    def after_commit(session: Session) -> None:
        changed: set[int] = session.info.pop(_CHANGED, set())
        if not changed:
            return
        for listener in listeners:
            try:
                listener(changed)
            except Exception:  # a listener must never fail the commit that called it
                log.exception("host change listener failed")

    def after_rollback(session: Session) -> None:
        session.info.pop(_CHANGED, None)
        session.info.pop(_DELETED, None)

    event.listen(sessions, "after_flush", _after_flush)
    event.listen(sessions, "after_commit", after_commit)
    event.listen(sessions, "after_rollback", after_rollback)


@dataclass(frozen=True)
class Answer:
    """A heartbeat and the answer it got."""

    heartbeat: Heartbeat
    principal: object
    """Who sent it (``server.services.tokens.Principal``): another token goes through the
    checks again."""
    body: bytes
    expires: float
    raw: bytes | None = None
    """The request body the heartbeat came in, when known: a repeat of the same bytes is
    answered before the request is routed or parsed (``server.api.gate``)."""
    fewer_alike: bool = False
    """Whether a heartbeat with only some of its reports gets the same answer
    (``server.services.hosts.Answered``)."""

    def answers(self, heartbeat: Heartbeat) -> bool:
        """Whether this answer is the one ``heartbeat`` gets: it repeats the one answered, or
        (``fewer_alike``) repeats some of its reports and no others, from the same agent."""
        if heartbeat == self.heartbeat:
            return True
        return (
            self.fewer_alike
            and heartbeat.instance == self.heartbeat.instance
            and all(report in self.heartbeat.workers for report in heartbeat.workers)
        )


class HostAnswers:
    """The last steady answer per host, valid until a change to the host is committed (here or
    in another process, :meth:`invalidate`) or ``ttl_s`` passes. Thread-safe; an answer built
    from reads that a commit may have overtaken is never stored (:meth:`generation`)."""

    def __init__(
        self, ttl_s: float, maxsize: int = 65_536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.maxsize, self.clock = ttl_s, maxsize, clock
        self._answers: dict[int, Answer] = {}
        self._generations: dict[int, int] = {}
        self._epoch = 0
        """Bumped when every answer is dropped at once."""
        self._launched: set[int] = set()
        """Hosts whose last answer handed out launch credentials, so was not kept
        (:meth:`launched`): why their next heartbeat goes to the database."""
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(
        self, host_id: int, heartbeat: Heartbeat, principal: object, raw: bytes | None = None
    ) -> bytes | None:
        """The answer to give again, when ``heartbeat`` repeats the last one answered for the
        host (or only some of its reports, :meth:`Answer.answers`), with the same token, and
        nothing has changed since. One with fewer reports takes the last one's place, its body
        ``raw`` with it, so that its repeats are answered before the route."""
        answer = self._answers.get(host_id)
        if answer is None or self._why_not(answer, heartbeat, principal) is not None:
            self.misses += 1
            return None
        self.hits += 1
        if heartbeat != answer.heartbeat:
            with self._lock:
                if self._answers.get(host_id) is answer:  # not dropped or replaced meanwhile
                    self._answers[host_id] = replace(answer, heartbeat=heartbeat, raw=raw)
        return answer.body

    def why_missed(self, host_id: int, heartbeat: Heartbeat, principal: object) -> str:
        """Why :meth:`get` had no answer for ``heartbeat``: ``launch`` (the host's last answer
        handed out launch credentials, which are never repeated), ``none`` (none held: the
        host's first heartbeat here, or a change dropped it), ``expired`` (``ttl_s`` passed),
        ``token`` (another credential sent it) or ``report`` (it reports something new)."""
        answer = self._answers.get(host_id)
        if answer is None:
            return "launch" if host_id in self._launched else "none"
        return self._why_not(answer, heartbeat, principal) or "report"

    def _why_not(self, answer: Answer, heartbeat: Heartbeat, principal: object) -> str | None:
        """Why ``answer`` is not the one ``heartbeat`` gets, or None when it is."""
        if answer.expires < self.clock():
            return "expired"
        if answer.principal != principal:
            return "token"
        if not answer.answers(heartbeat):
            return "report"
        return None

    def get_raw(self, host_id: int, raw: bytes, principal: object) -> bytes | None:
        """The answer to give again when ``raw`` is, byte for byte, the body of the last
        heartbeat answered for the host, with the same token, and nothing has changed since
        (a real agent sends the same bytes while its report is the same). None: go through
        the route (which still answers from memory an equal report worded otherwise)."""
        answer = self._answers.get(host_id)
        if (
            answer is None
            or answer.raw != raw
            or answer.expires < self.clock()
            or answer.principal != principal
        ):
            return None
        self.hits += 1
        return answer.body

    def generation(self, host_id: int) -> tuple[int, int]:
        """Take it before reading what an answer is built from; :meth:`put` with it."""
        return self._epoch, self._generations.get(host_id, 0)

    def put(
        self,
        host_id: int,
        heartbeat: Heartbeat,
        principal: object,
        body: bytes,
        generation: tuple[int, int],
        raw: bytes | None = None,
        own: frozenset[int] = frozenset(),
        fewer_alike: bool = False,
    ) -> None:
        """Keep an answer, unless the host was invalidated since ``generation`` was taken;
        ``raw``: the request body the heartbeat was read from; ``fewer_alike``: whether it also
        answers a heartbeat with only some of the same reports (``Answer.fewer_alike``).

        ``own``: the hosts that the heartbeat's own transaction invalidated when it committed
        (``changed_so_far`` once it had flushed everything), for an answer built after those
        changes, in the same transaction. Its own invalidation of the host is then no reason
        to refuse the answer (it reflects that change): a heartbeat reporting a rank running
        is kept, and the next one like it answered from memory, not worked out once more.
        Any other invalidation since ``generation`` (another transaction's commit, here or in
        another process) still refuses it."""
        if self.ttl_s <= 0 or EVERY_HOST in own:
            return
        epoch, gen = generation
        expected = (epoch, gen + 1 if host_id in own else gen)
        with self._lock:
            if expected != (self._epoch, self._generations.get(host_id, 0)):
                return
            if len(self._answers) >= self.maxsize:
                self._answers.clear()
            expires = self.clock() + self.ttl_s
            self._answers[host_id] = Answer(heartbeat, principal, body, expires, raw, fewer_alike)
            self._launched.discard(host_id)

    def launched(self, host_id: int) -> None:
        """The host was answered with launch credentials, and the answer not kept: each one
        retires the last, so the next heartbeat goes to the database whatever it says. Only
        for :meth:`why_missed`: at a job's start that is one of a host's two database
        heartbeats, which counted as ``none``, as if a change had dropped an answer."""
        with self._lock:
            if len(self._launched) >= self.maxsize:
                self._launched.clear()
            self._launched.add(host_id)

    def invalidate(self, host_ids: Iterable[int]) -> None:
        """Drop the answers of ``host_ids`` (all of them with :data:`EVERY_HOST`)."""
        with self._lock:
            for host_id in host_ids:
                if host_id == EVERY_HOST:
                    self._answers.clear()
                    self._generations.clear()
                    self._launched.clear()
                    self._epoch += 1
                    continue
                self._answers.pop(host_id, None)
                self._launched.discard(host_id)
                if len(self._generations) >= self.maxsize:
                    self._generations.clear()
                    self._epoch += 1
                self._generations[host_id] = self._generations.get(host_id, 0) + 1

    def clear(self) -> None:
        self.invalidate([EVERY_HOST])


LIVENESS_FLUSH_S = 1.0
"""How often the heartbeats noted on arrival have their liveness written."""

_ALIVE_IF_NEWER = (
    update(Host)
    .where(Host.id == bindparam("host_id"), Host.last_heartbeat < bindparam("seen"))
    .values(last_heartbeat=bindparam("seen"))
)
_ALIVE_IF_NEWER_PG = text(
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS integer[]), CAST(:seen AS timestamptz[]))"
    " AS v(id, seen)),"
    " free AS (SELECT hosts.id FROM hosts JOIN v ON hosts.id = v.id"
    " FOR NO KEY UPDATE OF hosts SKIP LOCKED),"
    " written AS (UPDATE hosts SET last_heartbeat = v.seen FROM v, free"
    " WHERE hosts.id = v.id AND hosts.id = free.id AND hosts.last_heartbeat < v.seen)"
    " SELECT id FROM free"
)
"""PostgreSQL: every host's time in one statement (not one per host), run on its own
(autocommit), so it holds the rows for as long as the statement runs and no longer; and it
never waits for a row another transaction holds (a host coming back, whose heartbeat writes its
status and time at its commit; the reaper marking hosts lost): it skips it, says which rows it
took, and the others go out with the next flush. Waiting, it would hold every row it had
already written meanwhile, heartbeats of those hosts would queue behind it holding their
database slots, and the reaper could mark heartbeating hosts lost.

``NO KEY UPDATE``, the lock its own update takes (the time is no key): ``FOR UPDATE`` also
conflicts with the ``KEY SHARE`` lock that a row referencing the host takes to its commit (a
rank placed there, inserted with its job's placement), so every host a placement pass was
placing ranks on was skipped, again each flush while passes followed one another."""


class Liveness:
    """Last heartbeat times of hosts, noted when their heartbeats arrive and written in one
    statement per :data:`LIVENESS_FLUSH_S` rather than one per heartbeat, those the database
    worked out too (only a host coming back writes its time with its status). A time never
    moves back (one written meanwhile may be later).

    A heartbeat is noted on arrival (``arrived``, by ``FastPaths.heartbeat``), before it waits
    for anything, when it comes with the credential that the host's last heartbeat answered by the database
    here came with (``owned``), and again at every flush until it is answered (``answered``):
    a host is alive while it talks to us or waits for our answer, however long its heartbeat
    waits for a database slot. Noted only at its commit, a heartbeat that waited more than
    about half of ``host_lost_after_s`` would let its host be marked lost while it was
    heartbeating, and the restarts that followed would load the server further."""

    def __init__(self) -> None:
        self._seen: dict[int, datetime] = {}
        self._flushing: dict[int, datetime] = {}
        self._owners: dict[int, int] = {}
        """Host id -> the token id of its last heartbeat answered by the database here."""
        self._waiting: dict[int, int] = {}
        """Host id -> its heartbeats noted on arrival and not answered yet."""
        self._lock = threading.Lock()
        self.held = 0
        """Hosts the last flush left for the next (their rows held by other transactions)."""

    def seen(self, host_id: int, now: datetime) -> None:
        """A heartbeat of the host was answered, having arrived at ``now`` (a later time noted
        already stays)."""
        with self._lock:
            if self._seen.get(host_id, now) <= now:
                self._seen[host_id] = now

    def owned(self, host_id: int, token_id: int) -> None:
        """The host's heartbeat with this credential was authorised and answered."""
        self._owners[host_id] = token_id

    def arrived(self, host_id: int, token_id: int, now: datetime) -> bool:
        """A heartbeat for the host arrived with this credential: noted, and kept noted until
        :meth:`answered`, if it is the owner's (returns whether it was)."""
        if self._owners.get(host_id) != token_id:
            return False
        with self._lock:
            self._seen[host_id] = now
            self._waiting[host_id] = self._waiting.get(host_id, 0) + 1
        return True

    def answered(self, host_id: int, now: datetime) -> None:
        """A heartbeat ``arrived`` noted has its answer (or failed) ``now``: its host was alive
        until then, so ``now`` goes out with the next flush: not only its time of arrival,
        which may be seconds older than what a flush wrote while it waited (its host would
        look silent again right after its answer)."""
        with self._lock:
            left = self._waiting.pop(host_id, 1) - 1
            if left:
                self._waiting[host_id] = left
            if self._seen.get(host_id, now) <= now:
                self._seen[host_id] = now

    def pending(self) -> int:
        with self._lock:
            return len(self._seen.keys() | self._waiting.keys())

    def flush(self, conn: Connection) -> int:
        """Write what was seen since the last flush on ``conn`` (the caller commits, unless it
        is in autocommit), and now for the hosts whose heartbeats are waiting for their
        answers; returns how many hosts it wrote (on PostgreSQL, one whose row another
        transaction holds is left for the next flush). Should the write or its commit fail,
        :meth:`restore` puts the times back for the next flush."""
        now = datetime.now(UTC)
        with self._lock:
            seen, self._seen = self._seen, {}
            seen.update(dict.fromkeys(self._waiting, now))
            self._flushing = seen
        if seen and conn.dialect.name == "postgresql":
            ids = sorted(seen)
            params = {"ids": ids, "seen": [seen[h] for h in ids]}
            taken = set(conn.execute(_ALIVE_IF_NEWER_PG, params).scalars())
            held = {h: t for h, t in seen.items() if h not in taken}
            if held:  # rows other transactions hold: with the next flush
                self._put_back(held)
            self.held = len(held)
            return len(seen) - len(held)
        self.held = 0
        if seen:
            rows = [{"host_id": h, "seen": t} for h, t in sorted(seen.items())]
            conn.execute(_ALIVE_IF_NEWER, rows)
        return len(seen)

    def restore(self) -> None:
        """The last flush was not committed: its times go out with the next one (a later
        heartbeat's time, seen meanwhile, wins)."""
        self._put_back(self._flushing)
        with self._lock:
            self._flushing = {}

    def _put_back(self, times: dict[int, datetime]) -> None:
        with self._lock:
            for host_id, at in times.items():
                if self._seen.get(host_id, at) <= at:
                    self._seen[host_id] = at
