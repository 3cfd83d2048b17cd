"""The controller's work queue: which job a round sweeps next (urgent, then hot, then due), the
back-off of a job whose sweep failed, and the pace of the work that is not urgent.

Shaped after client-go's rate-limiting work queue (kubernetes sample-controller): a job handed
out by :meth:`WorkQueue.next` is not handed out again before :meth:`WorkQueue.done`, and one
whose sweep failed comes back only after an exponential back-off of its own. Pure: the
database's answers come from the caller (:class:`RoundHooks`) and the clock is injectable.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

HOT_S = 20.0
"""A job poked as urgent stays *hot* this long (and one with an open straggler event while it
is open): new telemetry of a hot job has it swept again within ``HOT_CHECK_S``, mid-round. An
iteration is judged once every rank has reported it, and the ranks on other hosts report it
with their regular batches, after the urgent one."""

HOT_CHECK_S = 0.5
"""How often a round asks for the newest telemetry of hot jobs (one query), or for the live
jobs when an urgent one is not among them; also the longest one wait for the pace."""

SWEEP_RETRY_FIRST_S = 1.0
SWEEP_RETRY_MAX_S = 30.0
"""A job whose sweeps keep failing is tried again after 1, 2, 4, ... s, at most this long: each
try takes the job up afresh from the database, so one failing job does not cost that every
round."""

ROUND_GIVES_UP_AFTER = 3
"""A round ends once this many sweeps in a row have failed: the database is likely away, and
every job left would fail the same way."""


class CpuPace:
    """Paces work to ``cores`` of one core: work that took ``c`` seconds of CPU is paid back in
    ``c / cores`` seconds, and the next may start once it is (``wait_s``). Time with nothing to
    do earns credit for at most ``burst_s`` seconds of CPU, so a small cluster's rounds (a few
    jobs, milliseconds each) never wait."""

    def __init__(
        self, cores: float, burst_s: float = 0.1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if cores <= 0:
            raise ValueError("cores must be positive")
        self.cores, self.burst_s, self.clock = cores, burst_s, clock
        self._credit = burst_s
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self._credit = min(self.burst_s, self._credit + self.cores * (now - self._at))
        self._at = now

    def wait_s(self) -> float:
        """How long until the next piece of work may start."""
        self._refill()
        return 0.0 if self._credit >= 0 else -self._credit / self.cores

    def spend(self, cpu_s: float) -> None:
        self._refill()
        self._credit -= cpu_s


def _no_news(jobs: list[int]) -> Mapping[int, int]:
    return {}


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class RoundHooks:
    """What a round's :meth:`WorkQueue.next` asks its caller for, on the caller's thread: the
    answers that need the database (the queue reads none itself), and a turn before each step
    (the controller checks its lock there)."""

    live_jobs: Callable[[], Iterable[int]] = tuple
    """The jobs live now: asked when an urgent job is not live in the round (it may have
    started since), at most every ``HOT_CHECK_S``."""
    newest_telemetry: Callable[[list[int]], Mapping[int, int]] = _no_news
    """The newest telemetry row id of each of these hot jobs (those with any)."""
    open_events: Callable[[], Iterable[int]] = tuple
    """The jobs with an open straggler event: hot while it is open."""
    before_each: Callable[[], None] = _nothing
    """Called before each step, including the steps that only wait for the pace."""


@dataclass
class RoundTally:
    """What a round did, for its stats (``RoundStats``) and to forget the jobs gone."""

    live: set[int]
    """The live jobs as the round last knew them (those started during it included)."""
    taken: int
    """Jobs the round took up, each counted once (one in back-off is passed over)."""
    paced_s: float
    """How long the round waited for the pace."""
    urgent_waits_s: list[float]
    """How long each job poked as urgent waited to be taken up (since the last tally)."""


@dataclass
class _Round:
    live: set[int]
    due: deque[int]
    next_hot: float
    """When the round next asks for hot jobs' newest telemetry."""
    next_live: float
    """When the round may next ask for the live jobs."""
    taken: set[int] = field(default_factory=set)
    urgent: deque[int] = field(default_factory=deque)
    """Urgent and hot jobs of this round, in the order they are taken up."""
    failed_in_a_row: int = 0
    paced_s: float = 0.0


class WorkQueue:
    """The order of a controller's sweeps: jobs poked as urgent first (also those poked again
    after their sweep), then hot jobs with new telemetry, then the round's due jobs, each once
    per round and paced (``CpuPace``). A job whose sweep failed waits out its back-off.

    :meth:`add_urgent` and :meth:`has_urgent` may be called from any thread; the rounds
    (:meth:`start_round`, :meth:`next`, :meth:`done`, :meth:`end_round`) run on one."""

    def __init__(
        self,
        pace: CpuPace | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], object] = time.sleep,
    ) -> None:
        self.pace = pace
        """Paces the work that is not urgent; None: never waits."""
        self.clock = clock
        self._wait = wait
        """Waits for the pace, up to the seconds given; the controller's returns on a poke."""
        self._lock = threading.Lock()
        self._urgent: set[int] = set()
        """Jobs poked as urgent since a round last took them up."""
        self._poked_at: dict[int, float] = {}
        """Urgent job -> when it was first poked since a round took it up."""
        self._hot: dict[int, float] = {}
        """Job -> until when it is hot for having been poked (``HOT_S``)."""
        self._hot_seen: dict[int, int] = {}
        """Hot job -> its newest telemetry row id when a round last looked."""
        self._backoff: dict[int, tuple[int, float]] = {}
        """Job whose last sweep failed -> (failures in a row, clock time of its next try)."""
        self._urgent_waits: list[float] = []
        self._round: _Round | None = None
        self.processing: set[int] = set()
        """Jobs handed out and not yet done."""

    def add_urgent(self, ids: Iterable[int]) -> None:
        """Take these jobs up before any due one, even if this round took them already (a
        straggler's ranks report one by one); each stays hot for ``HOT_S``. Any thread."""
        ids = set(ids)
        now = self.clock()
        until = now + HOT_S
        with self._lock:
            self._urgent |= ids
            self._hot.update(dict.fromkeys(ids, until))
            for job_id in ids:
                self._poked_at.setdefault(job_id, now)

    def has_urgent(self) -> bool:
        """Whether a job poked as urgent waits to be taken up (other work may stop for it)."""
        with self._lock:
            return bool(self._urgent)

    def hot(self, open_events: Iterable[int] = ()) -> set[int]:
        """The jobs hot now: poked within ``HOT_S``, or with an open event (``open_events``)."""
        now = self.clock()
        with self._lock:
            self._hot = {j: until for j, until in self._hot.items() if until > now}
            hot = set(self._hot)
        return hot | set(open_events)

    def new_turn(self) -> None:
        """Forget the back-off and the telemetry seen: a new turn takes every job up afresh."""
        self._backoff.clear()
        self._hot_seen.clear()

    def backoff_s(self, job_id: int) -> float:
        """How long until a job in back-off may be tried again (0: it may now)."""
        _, next_try = self._backoff.get(job_id, (0, 0.0))
        return max(0.0, next_try - self.clock())

    def forget(self, job_id: int) -> None:
        """End a job's back-off: it is tried at once, its next failure waits the first wait."""
        self._backoff.pop(job_id, None)

    def start_round(self, due: Iterable[int], live: Iterable[int]) -> None:
        """Begin a round over ``due`` among ``live``; jobs of a round that ended early (its
        sweep raised) are no longer in processing."""
        self.processing.clear()
        look = self.clock() + HOT_CHECK_S
        self._round = _Round(set(live), deque(due), next_hot=look, next_live=look)

    @property
    def gave_up(self) -> bool:
        """Whether ``ROUND_GIVES_UP_AFTER`` sweeps in a row failed: the round is over."""
        return self._round is not None and self._round.failed_in_a_row >= ROUND_GIVES_UP_AFTER

    def next(self, hooks: RoundHooks | None = None) -> int | None:
        """The job to sweep next, or None once the round is over: urgent and hot jobs first,
        then the due ones, each waiting for the pace. A job in back-off is passed over."""
        r = self._round
        if r is None:
            raise RuntimeError("no round under way (start_round)")
        hooks = hooks or RoundHooks()
        while not self.gave_up:
            hooks.before_each()
            news: list[int] = []
            if self.clock() >= r.next_hot:
                news = self._hot_news(r.live, hooks)
                r.next_hot = self.clock() + HOT_CHECK_S
            pokes = [*self._take_urgent(), *news]
            if not r.live.issuperset(pokes) and self.clock() >= r.next_live:
                r.live.update(hooks.live_jobs())  # started during the round: swept in it
                r.next_live = self.clock() + HOT_CHECK_S
            for j in pokes:
                if j in r.live and j not in r.urgent:
                    r.urgent.append(j)
            job_id = self._take_first_urgent(r)  # again if taken already this round
            if job_id is None:
                if not r.due:
                    return None
                if r.due[0] in r.taken:
                    r.due.popleft()
                    continue
                if self.pace is not None and (wait := self.pace.wait_s()) > 0:
                    started = self.clock()
                    self._wait(min(wait, HOT_CHECK_S))  # a poke ends it: urgent work goes first
                    r.paced_s += self.clock() - started
                    continue
                job_id = r.due.popleft()
            r.taken.add(job_id)
            if self.backoff_s(job_id) > 0:
                continue
            self.processing.add(job_id)
            return job_id
        return None

    def done(self, job_id: int, *, ok: bool, cpu_s: float = 0.0) -> float:
        """A job's sweep is over, having taken ``cpu_s`` of CPU (paid back to the pace, urgent
        or not). A failure puts it in back-off (1 s, doubling, at most 30 s); a success ends its
        back-off. Returns its back-off in seconds (0 after a success)."""
        self.processing.discard(job_id)
        if self.pace is not None:
            self.pace.spend(cpu_s)
        if ok:
            self.forget(job_id)
            if self._round is not None:
                self._round.failed_in_a_row = 0
            return 0.0
        failures, _ = self._backoff.get(job_id, (0, 0.0))
        wait = min(SWEEP_RETRY_MAX_S, SWEEP_RETRY_FIRST_S * 2.0**failures)
        self._backoff[job_id] = (failures + 1, self.clock() + wait)
        if self._round is not None:
            self._round.failed_in_a_row += 1
        return wait

    def end_round(self) -> RoundTally:
        """End the round: the back-off of jobs no longer live is forgotten, and urgent jobs
        left (being processed when last looked at) wait for the next round."""
        r = self._round
        if r is None:
            raise RuntimeError("no round under way (start_round)")
        self._round = None
        self._backoff = {j: b for j, b in self._backoff.items() if j in r.live}
        with self._lock:
            self._urgent.update(r.urgent)
        waits, self._urgent_waits = self._urgent_waits, []
        return RoundTally(r.live, len(r.taken), r.paced_s, waits)

    def _take_urgent(self) -> list[int]:
        now = self.clock()
        with self._lock:
            ids, self._urgent = sorted(self._urgent), set()
            self._urgent_waits.extend(
                now - self._poked_at.pop(j) for j in ids if j in self._poked_at
            )
        return ids

    def _take_first_urgent(self, r: _Round) -> int | None:
        for job_id in r.urgent:
            if job_id not in self.processing:
                r.urgent.remove(job_id)
                return job_id
        return None

    def _hot_news(self, live: set[int], hooks: RoundHooks) -> list[int]:
        """Hot jobs with telemetry newer than when a round last looked."""
        hot = self.hot(hooks.open_events()) & live
        self._hot_seen = {j: seen for j, seen in self._hot_seen.items() if j in hot}
        if not hot:
            return []
        newest = hooks.newest_telemetry(sorted(hot))
        news = [j for j, top in newest.items() if top > self._hot_seen.get(j, 0)]
        self._hot_seen.update(newest)
        return sorted(news)
