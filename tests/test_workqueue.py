"""The controller's work queue (``server.workqueue``) on a fake clock: urgent before hot before
due, each due job once per round, back-off after a failure, the pace of non-urgent work."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import workqueue
from server.workqueue import CpuPace, RoundHooks, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """A wait: as a real one, it takes a tick at least (a pace's last nanoseconds)."""
        self.now += max(seconds, 1e-6)


def _queue(clock: Clock, pace: CpuPace | None = None) -> WorkQueue:
    return WorkQueue(pace, clock=clock, wait=clock.sleep)


def _drain(queue: WorkQueue, hooks: RoundHooks | None = None) -> list[int]:
    """Every job the round hands out, each done (and swept) at once."""
    order = []
    while (job := queue.next(hooks)) is not None:
        order.append(job)
        queue.done(job, ok=True)
    return order


def test_urgent_jobs_go_before_due_ones() -> None:
    clock = Clock()
    queue = _queue(clock)
    queue.add_urgent([5])  # poked before the round began
    queue.start_round(due=[1, 2, 3], live=range(1, 6))
    queue.add_urgent([4])
    assert _drain(queue) == [4, 5, 1, 2, 3]


def test_a_job_poked_during_a_round_is_taken_next_even_if_swept_already() -> None:
    queue = _queue(Clock())
    queue.start_round(due=[1, 2, 3], live=[1, 2, 3])
    assert queue.next() == 1
    queue.done(1, ok=True)
    queue.add_urgent([1])  # its next rank's urgent batch
    assert queue.next() == 1
    queue.done(1, ok=True)
    assert _drain(queue) == [2, 3]


def test_due_jobs_are_handed_out_once_per_round() -> None:
    queue = _queue(Clock())
    queue.start_round(due=[1, 2, 3], live=[1, 2, 3])
    queue.add_urgent([2])
    assert _drain(queue) == [2, 1, 3]  # 2 not again when its turn among the due comes
    tally = queue.end_round()
    assert tally.taken == 3 and tally.live == {1, 2, 3}
    queue.start_round(due=[3, 1], live=[1, 2, 3])
    assert _drain(queue) == [3, 1]


def test_a_job_is_not_handed_out_again_while_it_is_processed() -> None:
    queue = _queue(Clock())
    queue.start_round(due=[1, 2], live=[1, 2])
    assert queue.next() == 1
    queue.add_urgent([1])
    assert queue.next() == 2  # 1 is still being swept: its poke waits for it
    assert queue.processing == {1, 2}
    assert queue.next() is None
    queue.done(1, ok=True)
    assert queue.next() == 1
    queue.done(1, ok=True)
    queue.done(2, ok=True)
    assert queue.next() is None and not queue.processing


def test_an_urgent_job_not_live_is_looked_up_and_dropped_if_it_is_not() -> None:
    clock = Clock()
    queue = _queue(clock)
    asked: list[int] = []

    def live_jobs() -> list[int]:
        asked.append(1)
        return [1, 2, 7]

    hooks = RoundHooks(live_jobs=live_jobs)
    queue.start_round(due=[1, 2], live=[1, 2])
    clock.advance(workqueue.HOT_CHECK_S)  # the live jobs are asked for at most this often
    queue.add_urgent([7, 99])  # 7 started during the round; 99 is no job
    assert _drain(queue, hooks) == [7, 1, 2]
    assert asked == [1]
    assert queue.end_round().live == {1, 2, 7}
    assert not queue.has_urgent()


def test_the_back_off_doubles_is_capped_and_is_forgotten_after_a_success() -> None:
    clock = Clock()
    queue = _queue(clock)
    waits = []
    for _ in range(7):
        queue.start_round(due=[1], live=[1])
        assert queue.next() == 1
        waits.append(queue.done(1, ok=False))
        queue.end_round()
        queue.start_round(due=[1, 2], live=[1, 2])
        assert _drain(queue) == [2], "in back-off: passed over within a round"
        assert queue.end_round().taken == 2
        clock.advance(waits[-1])
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    queue.start_round(due=[1], live=[1])
    assert queue.next() == 1
    assert queue.done(1, ok=True) == 0.0
    assert queue.next() is None
    queue.start_round(due=[1], live=[1])
    assert queue.next() == 1
    assert queue.done(1, ok=False) == workqueue.SWEEP_RETRY_FIRST_S


def test_the_back_off_of_a_job_gone_or_of_an_earlier_turn_is_forgotten() -> None:
    queue = _queue(Clock())
    queue.start_round(due=[1, 2], live=[1, 2])
    for job in (1, 2):
        assert queue.next() == job
        queue.done(job, ok=False)
    queue.end_round()
    assert queue.backoff_s(1) > 0 and queue.backoff_s(2) > 0
    queue.start_round(due=[], live=[2])  # 1 ended
    queue.end_round()
    assert queue.backoff_s(1) == 0 and queue.backoff_s(2) > 0
    queue.new_turn()
    assert queue.backoff_s(2) == 0


def test_a_round_ends_once_enough_sweeps_in_a_row_failed() -> None:
    queue = _queue(Clock())
    jobs = list(range(1, 10))
    queue.start_round(due=jobs, live=jobs)
    outcomes = [False, False, True, *[False] * workqueue.ROUND_GIVES_UP_AFTER]
    for ok in outcomes:
        job = queue.next()
        assert job is not None and not queue.gave_up
        queue.done(job, ok=ok)
    assert queue.gave_up
    assert queue.next() is None  # the jobs left would fail the same way
    assert queue.end_round().taken == len(outcomes)


def test_the_pace_holds_due_work_but_not_urgent_work() -> None:
    clock = Clock()
    queue = _queue(clock, CpuPace(0.5, burst_s=0.0, clock=clock))
    queue.start_round(due=[1, 2], live=[1, 2, 3])
    assert queue.next() == 1
    queue.done(1, ok=True, cpu_s=1.0)  # 2 s to pay back at half a core
    queue.add_urgent([3])
    assert queue.next() == 3 and clock.now == 0.0, "an urgent job waits for no pace"
    queue.done(3, ok=True, cpu_s=0.5)  # its CPU counts all the same
    assert queue.next() == 2
    assert clock.now == pytest.approx(3.0)
    assert queue.end_round().paced_s == pytest.approx(3.0)


def test_a_poke_during_a_wait_for_the_pace_is_taken_at_once() -> None:
    clock = Clock()
    waits: list[float] = []
    queue: WorkQueue

    def wait(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(0.1)  # a poke ends the wait
        queue.add_urgent([3])

    queue = WorkQueue(CpuPace(0.1, burst_s=0.0, clock=clock), clock=clock, wait=wait)
    queue.start_round(due=[1, 2], live=[1, 2, 3])
    assert queue.next() == 1
    queue.done(1, ok=True, cpu_s=1.0)  # 10 s to pay back
    assert queue.next() == 3
    assert waits == [workqueue.HOT_CHECK_S], "each wait at most until the next look"


def test_hot_jobs_expire_after_hot_s() -> None:
    clock = Clock()
    queue = _queue(clock)
    queue.add_urgent([1])
    clock.advance(workqueue.HOT_S - 0.1)
    assert queue.hot() == {1}
    assert queue.hot(open_events=[2]) == {1, 2}, "an open straggler event keeps a job hot"
    clock.advance(0.2)
    assert queue.hot() == set()


def test_a_hot_job_with_new_telemetry_is_taken_again_in_the_round() -> None:
    clock = Clock()
    queue = _queue(clock)
    newest = {1: 10, 2: 10}
    asked: list[list[int]] = []

    def newest_telemetry(jobs: list[int]) -> dict[int, int]:
        """Of the rows added since the round began (past id 10), as the database's."""
        asked.append(jobs)
        return {j: newest[j] for j in jobs if newest[j] > 10}

    hooks = RoundHooks(newest_telemetry=newest_telemetry)
    queue.add_urgent([1])
    queue.start_round(due=[2, 3, 4, 5], live=[1, 2, 3, 4, 5])
    order = []
    while (job := queue.next(hooks)) is not None:
        order.append(job)
        queue.done(job, ok=True)
        clock.advance(workqueue.HOT_CHECK_S)
        newest[1] += 1 if job in (2, 4) else 0  # new rows of 1 while 2 and 4 are swept
        newest[2] += 1  # 2 is not hot: its rows wait for the next round
    assert order == [1, 2, 1, 3, 4, 1, 5]
    assert all(jobs == [1] for jobs in asked)
    clock.advance(workqueue.HOT_S)
    queue.start_round(due=[2], live=[1, 2])
    newest[1] += 1
    assert _drain(queue, hooks) == [2], "hot no more"


def test_the_urgent_waits_are_tallied_for_the_round_stats() -> None:
    clock = Clock()
    queue = _queue(clock)
    queue.add_urgent([1])
    clock.advance(0.25)
    queue.add_urgent([1, 2])  # 1 waits since it was first poked
    assert queue.has_urgent()
    clock.advance(0.25)
    queue.start_round(due=[], live=[1, 2])
    assert _drain(queue) == [1, 2]
    assert not queue.has_urgent()
    assert queue.end_round().urgent_waits_s == [0.5, 0.25]
    queue.start_round(due=[], live=[1, 2])
    assert queue.end_round().urgent_waits_s == []


LIVE = range(6)
NOT_LIVE = 9

_next = st.tuples(st.just("next"))
_done = st.tuples(st.just("done"), st.integers(0, 5), st.booleans(), st.floats(0.0, 0.5))
_ops = st.one_of(  # hand-outs and outcomes twice as often as pokes and time
    st.tuples(st.just("urgent"), st.sets(st.sampled_from([*LIVE, NOT_LIVE]), max_size=3)),
    _next,
    _done,
    _next,
    _done,
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
)


class _Model:
    """What the queue must do, told by what it was asked and what it handed out."""

    def __init__(self, queue: WorkQueue, clock: Clock) -> None:
        self.queue, self.clock = queue, clock
        self.backoff: dict[int, tuple[int, float]] = {}  # job -> (failures, until)
        self.urgent: set[int] = set()  # poked, live, not handed out since
        self.processing: list[int] = []
        self.in_a_row = 0
        self.hooks = RoundHooks(live_jobs=lambda: LIVE)

    def until(self, job: int) -> float:
        return self.backoff.get(job, (0, 0.0))[1]

    def start(self, due: list[int]) -> None:
        self.queue.start_round(due, LIVE)
        self.due, self.began, self.in_a_row = due, self.clock.now, 0
        self.poked = set(self.urgent)  # urgent in this round: may be handed out more than once
        self.until_at_start = {j: self.until(j) for j in due}
        self.handed: Counter[int] = Counter()

    def add_urgent(self, ids: set[int]) -> None:
        self.queue.add_urgent(ids)
        self.urgent |= ids - {NOT_LIVE}
        self.poked |= ids

    def next(self) -> int | None:
        eligible = {j for j in self.urgent if j not in self.processing and j not in self.backoff}
        job = self.queue.next(self.hooks)
        if job is None:  # the round is over: it gave up, or no urgent job waits
            assert self.queue.gave_up == (self.in_a_row >= workqueue.ROUND_GIVES_UP_AFTER)
            assert self.queue.gave_up or not eligible
            return None
        assert self.in_a_row < workqueue.ROUND_GIVES_UP_AFTER
        assert job in LIVE and job not in self.processing, job
        assert self.until(job) <= self.clock.now, "handed out in back-off"
        if eligible:
            assert job in self.urgent, "a due job went before an urgent one"
        self.urgent.discard(job)
        self.handed[job] += 1
        self.processing.append(job)
        return job

    def done(self, job: int, ok: bool, cpu_s: float = 0.0) -> None:
        self.processing.remove(job)
        wait = self.queue.done(job, ok=ok, cpu_s=cpu_s)
        if ok:
            assert wait == 0.0
            self.backoff.pop(job, None)
            self.in_a_row = 0
        else:
            failures = self.backoff.get(job, (0, 0.0))[0]
            assert wait == min(30.0, 2.0**failures)
            self.backoff[job] = (failures + 1, self.clock.now + wait)
            self.in_a_row += 1

    def end(self) -> None:
        """The round's last jobs are done; each due job not poked was handed out once unless
        in back-off all along."""
        gave_up = self.queue.gave_up
        for job in list(self.processing):
            self.done(job, True)
        self.queue.end_round()
        if gave_up:
            return
        for job in set(self.due) - self.poked:
            until = self.until_at_start[job]
            if until <= self.began:
                assert self.handed[job] == 1, (job, self.handed)
            elif until > self.clock.now:
                assert self.handed[job] == 0, (job, self.handed)
            else:
                assert self.handed[job] <= 1, (job, self.handed)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), cores=st.none() | st.floats(0.2, 2.0), ops=st.lists(_ops, max_size=60))
def test_the_queue_never_doubles_up_and_keeps_its_order(
    data: st.DataObject, cores: float | None, ops: list[tuple[Any, ...]]
) -> None:
    """Over any sequence of pokes, hand-outs, outcomes and time: no job is handed out while it
    is processed, nor in back-off (1 s doubling to 30 s), nor when not live; a job poked as
    urgent goes before any due one; a due job not poked in the round is handed out exactly
    once in it unless in back-off."""
    clock = Clock()
    pace = CpuPace(cores, burst_s=0.05, clock=clock) if cores else None
    model = _Model(_queue(clock, pace), clock)

    def due() -> list[int]:
        return data.draw(st.lists(st.sampled_from(LIVE), unique=True), label="due")

    model.start(due())
    for op in ops:
        if op[0] == "urgent":
            model.add_urgent(op[1])
        elif op[0] == "advance":
            clock.advance(op[1])
        elif op[0] == "done":
            if model.processing:
                model.done(model.processing[op[1] % len(model.processing)], op[2], op[3])
        elif model.next() is None:
            model.end()
            model.start(due())
    while (job := model.next()) is not None:  # the last round runs its course
        model.done(job, True)
    model.end()
