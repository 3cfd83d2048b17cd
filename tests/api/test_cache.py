"""The read caches' shared loads: one database read for every request that misses together."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.cache import TTLCache


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
