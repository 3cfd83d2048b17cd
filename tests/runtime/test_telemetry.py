"""Telemetry never blocks or breaks training; it is bounded, retried, and delivered on recovery."""

from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from agent.runtime.telemetry import JumpWatch, TelemetrySender, clamp_ms
from contract.agent import TelemetryBatch, TelemetryRecord
from contract.base import MAX_MS


def record(i: int, rank: int = 0) -> TelemetryRecord:
    return TelemetryRecord(
        rank=rank,
        iteration=i,
        plan_version=1,
        batch_size=8,
        data_ms=0.1,
        compute_ms=1.0,
        sync_ms=0.2,
        ts=time.time(),
    )


class Poster:
    """A fake server endpoint that can be down, or store a batch and then fail the reply."""

    def __init__(self) -> None:
        self.down = False
        self.fail_after_store = 0
        self.batches: list[list[int]] = []
        self.urgent: list[bool] = []
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, batch: TelemetryBatch) -> None:
        with self.lock:
            self.calls += 1
            if self.down:
                raise ConnectionError("server unreachable")
            self.batches.append([r.iteration for r in batch.all_records()])
            self.urgent.append(batch.urgent)
            if self.fail_after_store:
                self.fail_after_store -= 1
                raise TimeoutError("stored, but the reply was lost")

    @property
    def received(self) -> list[int]:
        with self.lock:
            return [i for b in self.batches for i in b]


def wait_for(cond: object, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def test_flushes_by_count_then_on_close() -> None:
    poster = Poster()
    s = TelemetrySender(poster, flush_records=4, flush_interval_s=60)
    for i in range(10):
        s.submit(record(i))
    wait_for(lambda: len(poster.received) >= 8)
    assert all(len(b) >= 4 for b in poster.batches)
    stats = s.close(deadline_s=2)
    assert poster.received == list(range(10))
    assert (stats.submitted, stats.delivered, stats.dropped, stats.pending) == (10, 10, 0, 0)


def test_flushes_by_interval() -> None:
    poster = Poster()
    s = TelemetrySender(poster, flush_records=1000, flush_interval_s=0.05)
    for i in range(3):
        s.submit(record(i))
    wait_for(lambda: poster.received == [0, 1, 2], timeout=2)
    s.close()


def test_unreachable_server_bounded_buffer_then_delivery_after_recovery() -> None:
    poster = Poster()
    poster.down = True
    s = TelemetrySender(
        poster,
        flush_records=10,
        flush_interval_s=0.01,
        max_buffer=100,
        max_batch=50,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
    )
    worst = 0.0
    for i in range(1000):  # the "training loop"
        t0 = time.perf_counter()
        s.submit(record(i))
        worst = max(worst, time.perf_counter() - t0)
        if i % 100 == 0:
            time.sleep(0.01)
    assert worst < 0.05  # never waits on the network
    st = s.stats
    assert st.failures >= 2 and st.delivered == 0
    assert st.pending <= 100 + 50  # the queue bound plus one batch in flight
    assert st.dropped == st.submitted - st.pending
    poster.down = False
    wait_for(lambda: s.stats.pending == 0)
    stats = s.close()
    got = poster.received
    # drop-oldest: what arrives is exactly the newest records that were not dropped, each once
    assert sorted(got) == list(range(1000 - len(got), 1000))
    assert len(got) == stats.submitted - stats.dropped == stats.delivered
    assert stats.pending == 0


def test_a_failed_post_is_retried_and_may_reach_the_server_twice() -> None:
    poster = Poster()
    poster.fail_after_store = 1
    s = TelemetrySender(poster, flush_records=5, flush_interval_s=60, backoff_initial_s=0.01)
    for i in range(5):
        s.submit(record(i))
    wait_for(lambda: s.stats.delivered == 5)
    stats = s.close()
    assert poster.batches == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]  # re-sent; server dedups
    assert stats.failures == 1 and stats.posts == 1


def test_close_respects_its_deadline_when_down_or_hung() -> None:
    poster = Poster()
    poster.down = True
    s = TelemetrySender(poster, flush_records=1000, flush_interval_s=60, backoff_initial_s=5)
    for i in range(7):
        s.submit(record(i))
    t0 = time.monotonic()
    stats = s.close(deadline_s=0.3)
    assert time.monotonic() - t0 < 1.5
    assert stats.pending == 7 and stats.failures >= 2  # it kept retrying within the deadline

    hang = threading.Event()
    s = TelemetrySender(lambda b: hang.wait(), flush_records=1, flush_interval_s=60)
    s.submit(record(0))
    time.sleep(0.05)
    t0 = time.monotonic()
    s.submit(record(1))  # post in flight and hung: submit still returns at once
    assert time.monotonic() - t0 < 0.05
    stats = s.close(deadline_s=0.2)
    assert time.monotonic() - t0 < 1.5
    assert stats.delivered == 0 and stats.pending == 2
    hang.set()


def test_clamp_ms() -> None:
    assert clamp_ms(-1.0) == 0.0
    assert clamp_ms(float("nan")) == 0.0
    assert clamp_ms(float("inf")) == MAX_MS
    assert clamp_ms(3.5) == 3.5


def test_flush_soon_posts_without_waiting_for_the_cadence() -> None:
    poster = Poster()
    s = TelemetrySender(poster, flush_records=1000, flush_interval_s=3600)
    for i in range(3):
        s.submit(record(i))
    s.flush_soon()  # an hour-long cadence and a count never reached: only this can post
    wait_for(lambda: poster.received == [0, 1, 2])
    s.submit(record(3))  # back to the cadence afterwards
    time.sleep(0.1)
    assert poster.received == [0, 1, 2]
    assert s.close(1.0).delivered == 4
    assert poster.urgent == [True, False]  # the server is told which batch came early


@given(
    level=st.floats(1.0, 1e4),
    noise=st.lists(st.floats(-0.1, 0.1), min_size=5, max_size=60),
)
def test_jump_watch_ignores_noise_of_ten_percent(level: float, noise: list[float]) -> None:
    w = JumpWatch()
    assert not any(w.observe(16, level * (1 + e)) for e in noise)


@given(
    level=st.floats(1.0, 1e4),
    factor=st.one_of(st.floats(1.5, 20.0), st.floats(0.05, 0.6)),
    before=st.integers(5, 20),
    after=st.integers(3, 30),
)
def test_jump_watch_flags_the_first_iterations_of_a_sustained_change(
    level: float, factor: float, before: int, after: int
) -> None:
    """A slowdown (or recovery) is flagged from its first iteration until the window's median
    has moved: the 3 records the detector needs, then quiet."""
    w = JumpWatch(window=5)
    flags = [w.observe(16, level) for _ in range(before)]
    flags += [w.observe(16, level * factor) for _ in range(after)]
    assert flags == [False] * before + [True] * min(3, after) + [False] * (after - 3)


def test_jump_watch_resets_when_the_batch_size_changes() -> None:
    w = JumpWatch(window=5)
    for _ in range(5):
        w.observe(16, 10.0)
    assert w.observe(16, 20.0)
    assert not w.observe(32, 20.0)  # another plan: another level, nothing to compare with yet
    assert not w.observe(0, 0.0)  # no samples, no compute


def test_settle_waits_for_what_was_submitted_and_never_for_a_server_that_is_down() -> None:
    """Before a checkpoint the loop settles its reports: everything submitted so far is
    delivered when it returns True; a failing post makes it give up at once, not block."""
    poster = Poster()
    sender = TelemetrySender(poster, flush_records=10_000, flush_interval_s=3600.0)
    for i in range(5):
        sender.submit(record(i))
    assert sender.settle(timeout_s=30.0)
    assert [i for b in poster.batches for i in b] == [0, 1, 2, 3, 4]
    assert sender.settle(timeout_s=30.0)  # nothing left: at once
    poster.down = True
    sender.submit(record(5))
    assert not sender.settle(timeout_s=30.0)  # the post failed: training goes on
    assert not sender.settle(timeout_s=30.0)  # backing off: not even a wait
    poster.down = False
    sender.close(deadline_s=5.0)
    assert [i for b in poster.batches for i in b][-1] == 5
