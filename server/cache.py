"""Small in-process caches for the two hot read paths (token lookup, current-plan polling).

Entries live for a short TTL, and writes that change them invalidate them as their
transaction commits: a service marks what it changed in ``session.info`` and an
``after_commit`` hook clears it, so this process never serves a stale entry after its own
commit. The same hook tells the plan listeners (``Caches.plan_listeners``: this process's
long-polls and the plan bus, ``server.notify``), so other server processes (the controller, more
API workers) clear their entries within milliseconds too; tokens change rarely and other
processes see a revocation within the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

log = logging.getLogger("evenflow.cache")

_PLANS = "evenflow.changed_plans"
_TOKENS = "evenflow.changed_tokens"


class TTLCache(Generic[K, V]):
    def __init__(
        self, ttl_s: float, maxsize: int = 65_536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.maxsize, self.clock = ttl_s, maxsize, clock
        self._data: dict[K, tuple[float, V]] = {}
        self._generations: dict[K, int] = {}
        self._lock = threading.Lock()
        self._loads: dict[K, tuple[int, asyncio.Future[V]]] = {}
        """Loads in flight (``get_or_load``; touched only from the event loop)."""
        self._queued: dict[K, tuple[int, asyncio.Future[V]]] = {}
        """Misses waiting for the next batch load (``get_or_load_batched``)."""
        self._batch_running = False
        self._batch_task: asyncio.Future[None] | None = None

    def get(self, key: K) -> V | None:
        hit = self._data.get(key)
        if hit is None or hit[0] < self.clock():
            return None
        return hit[1]

    async def get_or_load(self, key: K, load: Callable[[], V]) -> V:
        """The cached value, or else ``load()`` run in a worker thread and cached; every miss
        that arrives while a load is in flight awaits that one load instead of starting its own
        (at hundreds of requests a second, an entry expiring would otherwise send a burst of
        identical database reads through the thread pool at once). A load joins only if it
        started after the key's last invalidation: an older one may return what the
        invalidating commit replaced. A failed load is not cached; its waiters get the error."""
        hit = self.get(key)
        if hit is not None:
            return hit
        generation = self.generation(key)
        pending = self._loads.get(key)
        task: asyncio.Future[V]
        if pending is None or pending[0] != generation:
            task = asyncio.ensure_future(self._load(key, generation, load))
            self._loads[key] = (generation, task)
            task.add_done_callback(lambda done: self._loaded(key, done))
        else:
            task = pending[1]
        return await asyncio.shield(task)  # one waiter giving up does not cancel the others'

    async def get_or_load_batched(
        self, key: K, load_many: Callable[[list[K]], Mapping[K, V | Exception]]
    ) -> V:
        """Like :meth:`get_or_load`, but misses of different keys share one load: at most one
        ``load_many(keys)`` runs at a time, and the keys that miss meanwhile go together in
        the next. A fleet whose hosts each hold their own token would otherwise send one
        database read per host through the thread pool every TTL (1,250 hosts heartbeating
        every 2 s exhausted the connection pool). ``load_many`` answers each key with its
        value or the exception its waiters get."""
        hit = self.get(key)
        if hit is not None:
            return hit
        generation = self.generation(key)
        pending = self._loads.get(key)
        if pending is not None and pending[0] == generation:
            return await asyncio.shield(pending[1])
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self._loads[key] = self._queued[key] = (generation, future)
        if not self._batch_running:  # start on the next turn: misses of this turn join it
            self._batch_running = True
            asyncio.get_running_loop().call_soon(self._start_batch, load_many)
        return await asyncio.shield(future)

    def _start_batch(self, load_many: Callable[[list[K]], Mapping[K, V | Exception]]) -> None:
        batch, self._queued = self._queued, {}
        self._batch_running = True
        self._batch_task = asyncio.ensure_future(self._run_batch(batch, load_many))

    async def _run_batch(
        self,
        batch: dict[K, tuple[int, asyncio.Future[V]]],
        load_many: Callable[[list[K]], Mapping[K, V | Exception]],
    ) -> None:
        try:
            results = await run_in_threadpool(load_many, list(batch))
            for key, (generation, future) in batch.items():
                value = results.get(key, KeyError(key))
                if isinstance(value, Exception):
                    future.set_exception(value)
                else:
                    self.put(key, value, generation)
                    future.set_result(value)
        except Exception as exc:  # the load itself failed: every waiter gets its error
            for _, future in batch.values():
                if not future.done():
                    future.set_exception(exc)
        finally:
            for key, (_, future) in batch.items():
                if self._loads.get(key, (0, None))[1] is future:
                    del self._loads[key]
            self._batch_running = False
            if self._queued:
                self._start_batch(load_many)

    async def _load(self, key: K, generation: int, load: Callable[[], V]) -> V:
        value = await run_in_threadpool(load)
        self.put(key, value, generation)
        return value

    def _loaded(self, key: K, done: asyncio.Future[V]) -> None:
        pending = self._loads.get(key)
        if pending is not None and pending[1] is done:
            del self._loads[key]
        if not done.cancelled():
            done.exception()  # retrieved, so a load nobody waits for any more is not logged

    def generation(self, key: K) -> int:
        """Take it before loading a value: :meth:`put` with it drops the value if the key was
        invalidated meanwhile (the load may have read what the invalidating commit replaced)."""
        return self._generations.get(key, 0)

    def put(self, key: K, value: V, generation: int | None = None) -> None:
        with self._lock:
            if generation is not None and self._generations.get(key, 0) != generation:
                return
            if len(self._data) >= self.maxsize:
                self._data.clear()
            self._data[key] = (self.clock() + self.ttl_s, value)

    def invalidate(self, key: K) -> None:
        with self._lock:
            self._data.pop(key, None)
            if len(self._generations) >= self.maxsize:
                self._generations.clear()
            self._generations[key] = self._generations.get(key, 0) + 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            for key in list(self._generations):
                self._generations[key] += 1


def _retrieve(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # retrieved, so an error nobody waits for any more is not logged


def mark_plan_changed(session: Session, job_id: int) -> None:
    session.info.setdefault(_PLANS, set()).add(job_id)


def mark_tokens_changed(session: Session) -> None:
    session.info[_TOKENS] = True


class Caches:
    """The app's caches, wired to invalidate on commit of the sessions that change them."""

    def __init__(
        self, sessions: sessionmaker[Session], *, token_ttl_s: float = 2.0, plan_ttl_s: float = 1.0
    ) -> None:
        self.tokens: TTLCache[str, Any] = TTLCache(token_ttl_s)
        self.plans: TTLCache[int, tuple[int, bytes]] = TTLCache(plan_ttl_s)
        self.plan_listeners: list[Callable[[set[int]], None]] = []
        """Called with the job ids of every commit that made plans, after the cache is cleared."""
        event.listen(sessions, "after_commit", self._after_commit)
        event.listen(sessions, "after_rollback", self._after_rollback)

    def _after_commit(self, session: Session) -> None:
        changed: set[int] = session.info.pop(_PLANS, set())
        for job_id in changed:
            self.plans.invalidate(job_id)
        if changed:
            self.plans_changed(changed)
        if session.info.pop(_TOKENS, False):
            self.tokens.clear()

    def plans_changed(self, job_ids: set[int]) -> None:
        """New plans were committed (here or, via the bus, in another process)."""
        for listener in self.plan_listeners:
            try:
                listener(job_ids)
            except Exception:  # a listener must never fail the commit that called it
                log.exception("plan listener failed")

    @staticmethod
    def _after_rollback(session: Session) -> None:
        session.info.pop(_PLANS, None)
        session.info.pop(_TOKENS, None)
