"""Small in-process caches for the two hot read paths (token lookup, current-plan polling).

Entries live for a short TTL, and writes that change them invalidate them as their
transaction commits: a service marks what it changed in ``session.info`` and an
``after_commit`` hook clears it, so this process never serves a stale entry after its own
commit. Other server processes (several uvicorn workers on PostgreSQL) see a change within the TTL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_PLANS = "evenflow.changed_plans"
_TOKENS = "evenflow.changed_tokens"


class TTLCache(Generic[K, V]):
    def __init__(
        self, ttl_s: float, maxsize: int = 65_536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.maxsize, self.clock = ttl_s, maxsize, clock
        self._data: dict[K, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        hit = self._data.get(key)
        if hit is None or hit[0] < self.clock():
            return None
        return hit[1]

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if len(self._data) >= self.maxsize:
                self._data.clear()
            self._data[key] = (self.clock() + self.ttl_s, value)

    def invalidate(self, key: K) -> None:
        with self._lock:
            self._data.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


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
        event.listen(sessions, "after_commit", self._after_commit)
        event.listen(sessions, "after_rollback", self._after_rollback)

    def _after_commit(self, session: Session) -> None:
        for job_id in session.info.pop(_PLANS, ()):
            self.plans.invalidate(job_id)
        if session.info.pop(_TOKENS, False):
            self.tokens.clear()

    @staticmethod
    def _after_rollback(session: Session) -> None:
        session.info.pop(_PLANS, None)
        session.info.pop(_TOKENS, None)
