"""Small in-process caches for the two hot read paths (token lookup, current-plan polling).

Entries live for a short TTL, and writes that change them invalidate them as their
transaction commits: a service marks what it changed in ``session.info`` and an
``after_commit`` hook clears it, so this process never serves a stale entry after its own
commit. The same hook tells the listeners (``Caches.plan_listeners``: this process's long-polls
and the plan bus; ``Caches.credential_listeners``: the tokens bus, ``server.notify``), so other
server processes (the controller, more API workers, other servers on the same PostgreSQL) drop
their entries within milliseconds too; the TTL bounds how long a lost notification can leave
one standing.

Credentials are refreshed ahead (``TTLCache.get_or_load_batched``): a host heartbeating every
2 s finds its principal cached every time, and its requests never wait for a database read that
waits, in turn, for a worker thread or a connection the busy server is short of.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

log = logging.getLogger("evenflow.cache")

_PLANS = "evenflow.changed_plans"
_TOKENS = "evenflow.changed_tokens"


Generation = tuple[int, int]
"""The cache's epoch (bumped by :meth:`TTLCache.clear` and :meth:`TTLCache.drop`) and the key's
own count of invalidations, taken before a load: a load that started before the key was
invalidated, or before a drop that takes what it read, does not store it."""

DROPS_KEPT = 1024
"""Drops remembered (``TTLCache.drop``), to tell whether one made while a load was in flight
takes what the load read. A load older than all of them stores nothing."""


class TTLCache(Generic[K, V]):
    """Entries for ``ttl_s``. ``refresh_after_s``: a batched entry (``get_or_load_batched``)
    older than that is still answered, and read again in the background, so keys asked for more
    often than the TTL never miss."""

    def __init__(
        self,
        ttl_s: float,
        maxsize: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
        *,
        refresh_after_s: float | None = None,
        max_loads: int | None = None,
    ) -> None:
        self.ttl_s, self.maxsize, self.clock = ttl_s, maxsize, clock
        self._load_slots = anyio.Semaphore(max_loads) if max_loads is not None else None
        """Bounds the ``get_or_load`` loads running at once (of different keys; one key loads
        once however many miss it), so they hold no more database connections than that."""
        self.refresh_after_s = ttl_s if refresh_after_s is None else refresh_after_s
        self._data: dict[K, tuple[float, V]] = {}
        """key -> (when it expires, value)."""
        self._generations: dict[K, int] = {}
        self._epoch = 0
        self._drops: deque[Callable[[V], bool]] = deque(maxlen=DROPS_KEPT)
        """What the last drops and clears took, oldest first: the last one began ``_epoch``,
        the one before ``_epoch - 1`` (every drop and clear moves the epoch by one)."""
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        """The batched loads' own thread: not the shared worker threads, which a busy server's
        routes may all hold while they wait for database slots."""
        self._loads: dict[K, tuple[Generation, asyncio.Future[V]]] = {}
        """Loads in flight (``get_or_load``; touched only from the event loop)."""
        self._queued: dict[K, tuple[Generation, asyncio.Future[V]]] = {}
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
        database read per host through the thread pool every TTL, enough to exhaust the
        connection pool. ``load_many`` answers each key with its
        value or the exception its waiters get."""
        hit = self._data.get(key)
        now = self.clock()
        if hit is not None and hit[0] >= now:
            if hit[0] - now < self.ttl_s - self.refresh_after_s:
                self._enqueue(key, load_many)  # read it again; this caller need not wait
            return hit[1]
        return await asyncio.shield(self._enqueue(key, load_many))

    def _enqueue(
        self, key: K, load_many: Callable[[list[K]], Mapping[K, V | Exception]]
    ) -> asyncio.Future[V]:
        """The future of ``key``'s load: the one in flight or queued, if it started after the
        key's last invalidation, else a new one in the next batch."""
        generation = self.generation(key)
        pending = self._loads.get(key)
        if pending is not None and pending[0] == generation:
            return pending[1]
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)
        self._loads[key] = self._queued[key] = (generation, future)
        if not self._batch_running:  # start on the next turn: misses of this turn join it
            self._batch_running = True
            asyncio.get_running_loop().call_soon(self._start_batch, load_many)
        return future

    def _start_batch(self, load_many: Callable[[list[K]], Mapping[K, V | Exception]]) -> None:
        batch, self._queued = self._queued, {}
        self._batch_running = True
        self._batch_task = asyncio.ensure_future(self._run_batch(batch, load_many))

    async def _run_batch(
        self,
        batch: dict[K, tuple[Generation, asyncio.Future[V]]],
        load_many: Callable[[list[K]], Mapping[K, V | Exception]],
    ) -> None:
        try:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, "cache-load")
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._executor, load_many, list(batch))
            for key, (generation, future) in batch.items():
                value = results.get(key, KeyError(key))
                if isinstance(value, Exception):
                    self._discard(key, generation)  # refused now (a refresh found it revoked)
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

    async def _load(self, key: K, generation: Generation, load: Callable[[], V]) -> V:
        if self._load_slots is None:
            value = await run_in_threadpool(load)
        else:
            async with self._load_slots:
                value = await run_in_threadpool(load)
        self.put(key, value, generation)
        return value

    def _loaded(self, key: K, done: asyncio.Future[V]) -> None:
        pending = self._loads.get(key)
        if pending is not None and pending[1] is done:
            del self._loads[key]
        if not done.cancelled():
            done.exception()  # retrieved, so a load nobody waits for any more is not logged

    def generation(self, key: K) -> Generation:
        """Take it before loading a value: :meth:`put` with it drops the value if the key was
        invalidated meanwhile (the load may have read what the invalidating commit replaced)."""
        return self._epoch, self._generations.get(key, 0)

    def put(self, key: K, value: V, generation: Generation | None = None) -> None:
        """Store ``value``; with the ``generation`` taken before it was loaded, only if neither
        an invalidation of ``key`` nor a drop that takes ``value`` came since. Drops of other
        values do not count: credentials change every few seconds on a busy cluster (jobs end,
        ranks get new ones), and a load that any of them voided stored nothing, so every
        heartbeat of a fleet whose entries expired would wait for a load never kept."""
        with self._lock:
            if generation is not None and not self._current(key, value, generation):
                return
            if len(self._data) >= self.maxsize:
                self._data.clear()
            self._data[key] = (self.clock() + self.ttl_s, value)

    def _current(self, key: K, value: V, generation: Generation) -> bool:
        """Whether ``value``, loaded from ``generation`` on, is still current (under the lock)."""
        epoch, count = generation
        if self._generations.get(key, 0) != count:
            return False
        since = self._epoch - epoch  # the drops made since the load began: the last ones
        if since > len(self._drops):
            return False  # one of them is forgotten: it may have taken this value
        newest = reversed(self._drops)
        return not any(next(newest)(value) for _ in range(since))

    def invalidate(self, key: K) -> None:
        with self._lock:
            self._data.pop(key, None)
            if len(self._generations) >= self.maxsize:
                self._generations.clear()
            self._generations[key] = self._generations.get(key, 0) + 1

    def _discard(self, key: K, generation: Generation) -> None:
        """Drop ``key``'s value if nothing invalidated it since ``generation`` (a newer value
        may be on its way)."""
        with self._lock:
            if self._generations.get(key, 0) == generation[1]:
                self._data.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._epoch += 1
            self._drops.append(_everything)

    def drop(self, matches: Callable[[V], bool]) -> int:
        """Drop the entries whose value ``matches``; loads in flight do not store what they
        read if it matches too (it may be what the change replaced). Returns the entries
        dropped."""
        with self._lock:
            self._epoch += 1
            self._drops.append(matches)
            gone = [k for k, (_, v) in self._data.items() if matches(v)]
            for key in gone:
                del self._data[key]
        return len(gone)

    def close(self) -> None:
        """Stop the batched loads' thread (once what it runs is done)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _everything(_: object) -> bool:
    return True


def _retrieve(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # retrieved, so an error nobody waits for any more is not logged


def mark_plan_changed(session: Session, job_id: int) -> None:
    session.info.setdefault(_PLANS, set()).add(job_id)


@dataclass
class CredentialChange:
    """Credentials a commit changed: API tokens by id (revoked), and every worker credential of
    these jobs (ended, restarted, a rank's credential minted anew)."""

    token_ids: set[int] = field(default_factory=set)
    job_ids: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.token_ids or self.job_ids)

    def matches(self, principal: Any) -> bool:
        """Whether a cached principal (``server.services.tokens.Principal``) is one of them."""
        job_id = principal.job_id
        return principal.token_id in self.token_ids or (
            principal.token_id < 0 and job_id is not None and job_id in self.job_ids
        )

    def encode(self) -> list[int]:
        """As the ids a bus carries (non-negative integers): token ``t`` as ``2t``, the
        credentials of job ``j`` as ``2j + 1``."""
        return [2 * t for t in self.token_ids] + [2 * j + 1 for j in self.job_ids]

    @classmethod
    def decode(cls, ids: Iterable[int]) -> CredentialChange:
        change = cls()
        for i in ids:
            (change.job_ids if i % 2 else change.token_ids).add(i // 2)
        return change


def mark_tokens_changed(
    session: Session, *, token_ids: Iterable[int] = (), job_ids: Iterable[int] = ()
) -> None:
    """The API tokens ``token_ids`` and the worker credentials of ``job_ids`` change when the
    session commits: every process drops their cached principals."""
    change = session.info.setdefault(_TOKENS, CredentialChange())
    change.token_ids.update(token_ids)
    change.job_ids.update(job_ids)


TOKEN_TTL_S = 10.0
"""How long a principal is cached. Changes reach every process over the tokens bus at once; this
bounds how long a lost notification leaves a revoked credential working elsewhere."""
TOKEN_REFRESH_AFTER_S = 4.0
"""A cached principal older than this is read again in the background while it is used: a host
heartbeating every 2 s never waits for its token's read."""


PLAN_TTL_S = 5.0
"""How long a job's current plan is cached. Every commit of a plan drops it here and, over the
plan bus, everywhere else; this bounds how late a lost notification is noticed. Waiting
long-polls re-check the plan every second (``notify.RECHECK_S``); a TTL as short would read
each job's plan from the database every second."""


PLAN_REFRESH_AFTER_S = 4.0
"""A cached plan older than this is read again in the background while it is polled, with the
other plans due (``TTLCache.get_or_load_batched``: one read for all of them, on the cache's own
thread). Read one job at a time, four at once, in the shared worker threads, each plan as it
expired, 200 jobs' long-polls needed 40 reads a second; the fleet bench's API managed about 10,
so its plan polls, asking for 10 s, were held 30 to 60 s waiting for the reads, and some ran past
the client's 60 s."""


class Caches:
    """The app's caches, wired to invalidate on commit of the sessions that change them."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        token_ttl_s: float = TOKEN_TTL_S,
        plan_ttl_s: float = PLAN_TTL_S,
    ) -> None:
        self.tokens: TTLCache[str, Any] = TTLCache(
            token_ttl_s, refresh_after_s=min(TOKEN_REFRESH_AFTER_S, token_ttl_s)
        )
        self.plans: TTLCache[int, tuple[int, bytes]] = TTLCache(
            plan_ttl_s, refresh_after_s=min(PLAN_REFRESH_AFTER_S, plan_ttl_s)
        )
        self.plan_listeners: list[Callable[[set[int]], None]] = []
        """Called with the job ids of every commit that made plans, after the cache is cleared."""
        self.credential_listeners: list[Callable[[list[int]], None]] = []
        """Called with ``CredentialChange.encode()`` of every commit that changed credentials,
        after this process's entries are dropped (the tokens bus tells the others)."""
        event.listen(sessions, "after_commit", self._after_commit)
        event.listen(sessions, "after_rollback", self._after_rollback)

    def _after_commit(self, session: Session) -> None:
        changed: set[int] = session.info.pop(_PLANS, set())
        for job_id in changed:
            self.plans.invalidate(job_id)
        if changed:
            self.plans_changed(changed)
        credentials: CredentialChange | None = session.info.pop(_TOKENS, None)
        if credentials:
            self.credentials_changed(credentials)
            encoded = credentials.encode()
            for listener in self.credential_listeners:
                try:
                    listener(encoded)
                except Exception:  # a listener must never fail the commit that called it
                    log.exception("credential listener failed")

    def credentials_changed(self, change: CredentialChange) -> None:
        """Credentials changed (here or, via the tokens bus, in another process)."""
        self.tokens.drop(change.matches)

    def on_credential_ids(self, ids: set[int]) -> None:
        """The tokens bus's ids (``CredentialChange.encode``) from another process."""
        self.credentials_changed(CredentialChange.decode(ids))

    def plans_changed(self, job_ids: set[int]) -> None:
        """New plans were committed (here or, via the bus, in another process)."""
        for listener in self.plan_listeners:
            try:
                listener(job_ids)
            except Exception:  # a listener must never fail the commit that called it
                log.exception("plan listener failed")

    def close(self) -> None:
        self.tokens.close()
        self.plans.close()

    @staticmethod
    def _after_rollback(session: Session) -> None:
        session.info.pop(_PLANS, None)
        session.info.pop(_TOKENS, None)
