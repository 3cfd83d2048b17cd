"""The read caches' shared loads: one database read for every request that misses together."""

from __future__ import annotations

import asyncio
import threading

import anyio
import anyio.to_thread
import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.enums import Role
from server.scale.cache import DROPS_KEPT, CredentialChange, TTLCache
from server.services.tokens import Principal


class Loader:
    """A load that blocks until released and counts its calls."""

    def __init__(self, value: str = "v") -> None:
        self.calls = 0
        self.value = value
        self.release = threading.Event()
        self.fail: Exception | None = None

    def __call__(self) -> str:
        self.calls += 1
        n = self.calls
        assert self.release.wait(5), "never released"
        if self.fail is not None:
            raise self.fail
        return f"{self.value}{n}"


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_concurrent_misses_share_one_load_and_then_hit_the_cache() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        load = Loader()
        waiters = [asyncio.ensure_future(cache.get_or_load("k", load)) for _ in range(50)]
        await _settle()
        load.release.set()
        assert await asyncio.gather(*waiters) == ["v1"] * 50
        assert load.calls == 1
        assert await cache.get_or_load("k", load) == "v1" and load.calls == 1  # cached

    asyncio.run(main())


def test_loads_of_different_keys_run_at_most_max_loads_at_once() -> None:
    """Misses of ten keys: every one is loaded and cached, never more than ``max_loads`` loads
    (database connections) at once."""

    async def main() -> None:
        cache: TTLCache[int, int] = TTLCache(60.0, max_loads=3)
        running, most, lock = 0, 0, threading.Lock()
        release = threading.Event()

        def load(key: int) -> int:
            nonlocal running, most
            with lock:
                running += 1
                most = max(most, running)
            release.wait(10)
            with lock:
                running -= 1
            return key * key

        waiters = [
            asyncio.ensure_future(cache.get_or_load(k, lambda k=k: load(k))) for k in range(10)
        ]
        await _settle()
        assert running == 3  # three hold their slots; seven wait without a thread
        release.set()
        assert await asyncio.gather(*waiters) == [k * k for k in range(10)]
        assert most == 3
        assert [cache.get(k) for k in range(10)] == [k * k for k in range(10)]

    asyncio.run(main())


def test_a_load_older_than_an_invalidation_is_not_joined_nor_cached() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        load = Loader()
        early = asyncio.ensure_future(cache.get_or_load("k", load))
        await _settle()
        cache.invalidate("k")  # a commit changed the value while the first load ran
        late = asyncio.ensure_future(cache.get_or_load("k", load))
        await _settle()
        load.release.set()
        assert {await early, await late} == {"v1", "v2"}
        assert load.calls == 2
        assert cache.get("k") is not None and await cache.get_or_load("k", load) == await late

    asyncio.run(main())


def test_a_failed_load_reaches_every_waiter_and_is_not_cached() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        load = Loader()
        load.fail = PermissionError("unknown token")
        waiters = [asyncio.ensure_future(cache.get_or_load("k", load)) for _ in range(5)]
        await _settle()
        load.release.set()
        for outcome in await asyncio.gather(*waiters, return_exceptions=True):
            assert isinstance(outcome, PermissionError)
        assert load.calls == 1 and cache.get("k") is None
        load.fail = None
        assert await cache.get_or_load("k", load) == "v2"

    asyncio.run(main())


def test_a_waiter_giving_up_does_not_cancel_the_others() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        load = Loader()
        impatient = asyncio.ensure_future(cache.get_or_load("k", load))
        patient = asyncio.ensure_future(cache.get_or_load("k", load))
        await _settle()
        impatient.cancel()
        load.release.set()
        assert await patient == "v1"
        with pytest.raises(asyncio.CancelledError):
            await impatient
        assert load.calls == 1

    asyncio.run(main())


class ManyLoader:
    """A batch load that blocks until released and records the keys of each call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()

    def __call__(self, keys: list[str]) -> dict[str, str | Exception]:
        self.calls.append(sorted(keys))
        assert self.release.wait(5), "never released"
        return {k: PermissionError(k) if k.startswith("bad") else f"v-{k}" for k in keys}


def test_misses_of_different_keys_share_one_batch_load_at_a_time() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        load = ManyLoader()
        first = [asyncio.ensure_future(cache.get_or_load_batched(f"k{i}", load)) for i in range(3)]
        await _settle()
        # While the first batch runs, more misses queue for one next batch (k0 joins its load).
        later = [
            asyncio.ensure_future(cache.get_or_load_batched(k, load))
            for k in ("k0", "k7", "k8", "bad1", "k7")
        ]
        await _settle()
        assert load.calls == [["k0", "k1", "k2"]]
        load.release.set()
        assert await asyncio.gather(*first) == ["v-k0", "v-k1", "v-k2"]
        outcomes = await asyncio.gather(*later, return_exceptions=True)
        assert outcomes[:3] == ["v-k0", "v-k7", "v-k8"] and outcomes[4] == "v-k7"
        assert isinstance(outcomes[3], PermissionError)
        assert load.calls == [["k0", "k1", "k2"], ["bad1", "k7", "k8"]]
        assert await cache.get_or_load_batched("k8", load) == "v-k8"  # cached
        assert cache.get("bad1") is None and len(load.calls) == 2  # errors are not

    asyncio.run(main())


def test_a_failed_batch_load_reaches_every_waiter() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)

        def broken(keys: list[str]) -> dict[str, str | Exception]:
            raise ConnectionError("database gone")

        waiters = [cache.get_or_load_batched(k, broken) for k in ("a", "b")]
        for outcome in await asyncio.gather(*waiters, return_exceptions=True):
            assert isinstance(outcome, ConnectionError)
        assert cache.get("a") is None

    asyncio.run(main())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_past_its_refresh_age_is_answered_at_once_and_read_again_behind() -> None:
    async def main() -> None:
        clock = Clock()
        cache: TTLCache[str, str] = TTLCache(10.0, clock=clock, refresh_after_s=4.0)
        load = ManyLoader()
        load.release.set()
        assert await cache.get_or_load_batched("k", load) == "v-k"
        clock.now += 3.9  # young: answered, not read again
        assert await cache.get_or_load_batched("k", load) == "v-k"
        await _settle()
        assert load.calls == [["k"]]
        load.release.clear()  # the refresh will hang: the caller must not wait for it
        clock.now += 0.2
        answer = await asyncio.wait_for(cache.get_or_load_batched("k", load), 1.0)
        assert answer == "v-k"
        await _settle()
        assert load.calls == [["k"], ["k"]]  # one refresh, however often it is asked for
        assert await cache.get_or_load_batched("k", load) == "v-k"
        await _settle()
        assert load.calls == [["k"], ["k"]]
        load.release.set()
        await _settle()
        clock.now += 9.0  # 9.1 s after the first read: alive only because it was read again
        assert cache.get("k") == "v-k"
        clock.now += 1.1  # 10 s after the refresh
        assert cache.get("k") is None

    asyncio.run(main())


def test_a_refresh_that_finds_the_key_refused_drops_it() -> None:
    async def main() -> None:
        clock = Clock()
        cache: TTLCache[str, str] = TTLCache(10.0, clock=clock, refresh_after_s=4.0)
        refused: set[str] = set()

        def load(keys: list[str]) -> dict[str, str | Exception]:
            return {k: PermissionError("revoked") if k in refused else f"v-{k}" for k in keys}

        assert await cache.get_or_load_batched("k", load) == "v-k"
        refused.add("k")  # revoked where no notification reached this process
        clock.now += 5.0
        assert await cache.get_or_load_batched("k", load) == "v-k"  # still within its TTL
        await _settle()
        assert cache.get("k") is None
        with pytest.raises(PermissionError):
            await cache.get_or_load_batched("k", load)

    asyncio.run(main())


def test_drop_takes_only_matching_entries_and_loads_in_flight_do_not_store() -> None:
    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        for k in ("a1", "a2", "b1"):
            cache.put(k, f"v-{k}")
        load = ManyLoader()
        flight = asyncio.ensure_future(cache.get_or_load_batched("a3", load))
        await _settle()
        assert cache.drop(lambda v: v.startswith("v-a")) == 2
        assert cache.get("a1") is None and cache.get("a2") is None and cache.get("b1") == "v-b1"
        load.release.set()
        assert await flight == "v-a3"  # its caller gets what was read ...
        assert cache.get("a3") is None  # ... but it may predate the change: not kept

    asyncio.run(main())


def test_a_load_in_flight_is_kept_through_drops_of_other_values() -> None:
    """On a busy cluster credentials change every few seconds; a load that any change voided
    was never kept, and every caller of an expired entry waited for loads again and again."""

    async def main() -> None:
        cache: TTLCache[str, str] = TTLCache(60.0)
        load = ManyLoader()
        flight = asyncio.ensure_future(cache.get_or_load_batched("b1", load))
        await _settle()
        for _ in range(5):
            cache.drop(lambda v: v.startswith("v-a"))
        load.release.set()
        assert await flight == "v-b1"
        assert cache.get("b1") == "v-b1"

    asyncio.run(main())


def test_a_load_in_flight_through_a_clear_or_more_drops_than_kept_is_not_kept() -> None:
    cache: TTLCache[str, str] = TTLCache(60.0)
    before = cache.generation("k")
    cache.clear()
    cache.put("k", "v", before)
    assert cache.get("k") is None
    before = cache.generation("k")
    for _ in range(DROPS_KEPT + 1):  # the first of them is forgotten: it may have taken "v"
        cache.drop(lambda v: False)
    cache.put("k", "v", before)
    assert cache.get("k") is None
    before = cache.generation("k")
    for _ in range(DROPS_KEPT):
        cache.drop(lambda v: False)
    cache.put("k", "v", before)
    assert cache.get("k") == "v"


@given(
    drops=st.lists(st.sets(st.sampled_from("abcd")), max_size=8),
    value=st.sampled_from("abcd"),
    invalidated=st.booleans(),
)
def test_a_load_is_kept_unless_the_key_was_invalidated_or_a_drop_took_its_value(
    drops: list[set[str]], value: str, invalidated: bool
) -> None:
    cache: TTLCache[str, str] = TTLCache(60.0)
    cache.put("other", "x")
    before = cache.generation("k")
    for taken in drops:
        cache.drop(taken.__contains__)
    if invalidated:
        cache.invalidate("k")
    cache.put("k", value, before)
    kept = not invalidated and not any(value in taken for taken in drops)
    assert (cache.get("k") == value) is kept
    assert cache.get("other") == "x"


def test_batched_loads_do_not_wait_for_the_shared_worker_threads() -> None:
    """A busy server's routes may hold every worker thread while they wait for database slots;
    a credential's read must not queue behind them."""

    async def main() -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = 1
        held = threading.Event()
        try:
            busy = asyncio.ensure_future(anyio.to_thread.run_sync(held.wait, 5))
            await _settle()
            cache: TTLCache[str, str] = TTLCache(60.0)
            load = ManyLoader()
            load.release.set()
            assert await asyncio.wait_for(cache.get_or_load_batched("k", load), 2.0) == "v-k"
            cache.close()
        finally:
            held.set()
            await busy
            limiter.total_tokens = 40

    asyncio.run(main())


@given(
    tokens=st.sets(st.integers(1, 2**40)),
    jobs=st.sets(st.integers(1, 2**40)),
)
def test_a_credential_change_travels_the_bus_unchanged(tokens: set[int], jobs: set[int]) -> None:
    change = CredentialChange(set(tokens), set(jobs))
    ids = change.encode()
    assert all(i >= 0 for i in ids)
    assert CredentialChange.decode(set(ids)) == change


def test_a_credential_change_matches_its_tokens_and_its_jobs_worker_credentials_only() -> None:
    change = CredentialChange(token_ids={7}, job_ids={3})
    assert change.matches(Principal(token_id=7, name="t", role=Role.VIEWER))
    assert not change.matches(Principal(token_id=3, name="t", role=Role.AGENT, host="h"))
    worker = Principal(token_id=-12, name="job-3-rank-0", role=Role.WORKER, job_id=3, rank=0)
    other = Principal(token_id=-13, name="job-4-rank-0", role=Role.WORKER, job_id=4, rank=0)
    assert change.matches(worker) and not change.matches(other)
