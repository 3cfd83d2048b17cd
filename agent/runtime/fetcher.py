"""Polling the control plane for plans, off the critical path, on whichever rank leads.

The leader (the lowest rank in the all-reduce group) proposes plans, and the leader changes when a
plan excludes it, so every rank holds a :class:`PlanFetcher` but only a leader's one polls: the
thread starts at the first :meth:`~PlanFetcher.latest` call (or :meth:`~PlanFetcher.start`), and
goes quiet when nobody has asked for ``idle_after_s`` (its rank stopped leading), waking at the
next ask. Errors are counted and logged, with exponential back-off, and never leave the thread.

The fetch may be a long-poll (``RemoteControlPlane`` with ``plan_wait_s``: the server holds the
request until a newer plan exists). The fetcher keeps at least ``interval_s`` between the starts
of two fetches, so a fetch that answers at once still polls every ``interval_s`` and one that
waited at the server asks again straight away; after a newer plan it asks again at once, so a
plan committed right after another one is not held back either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent.backoff import Backoff
from contract.agent import PlanOut

log = logging.getLogger("evenflow.runtime.fetcher")

FetchPlan = Callable[[], PlanOut | None]


class PlanFetcher:
    """Polls ``fetch_plan`` in a daemon thread; :meth:`latest` never blocks, nothing raises."""

    def __init__(
        self,
        fetch_plan: FetchPlan,
        *,
        interval_s: float = 1.0,
        max_backoff_s: float = 30.0,
        known_version: int = 0,
        idle_after_s: float | None = None,
    ) -> None:
        self._fetch = fetch_plan
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.idle_after_s = max(10 * interval_s, 5.0) if idle_after_s is None else idle_after_s
        """Stop polling when :meth:`latest` has not been called for this long."""
        self._known = known_version
        self._latest: PlanOut | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._asked = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="evenflow-plan-fetcher", daemon=True)
        self.fetches = 0
        self.errors = 0

    def start(self) -> PlanFetcher:
        if not self.started and not self._stop.is_set():
            self._asked = time.monotonic()
            self._thread.start()
        return self

    def latest(self) -> PlanOut | None:
        """The newest plan fetched with a version above the initial known one, if any.

        Calling it is also the demand signal: it starts or wakes the polling thread.
        """
        with self._lock:
            self._asked = time.monotonic()
            latest = self._latest
        if not self.started:
            self.start()
        self._wake.set()
        return latest

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = Backoff(2 * self.interval_s, max(2 * self.interval_s, self.max_backoff_s))
        while not self._stop.is_set():
            with self._lock:
                idle = time.monotonic() - self._asked > self.idle_after_s
            if idle:  # this rank no longer leads: sleep until asked again
                self._wake.clear()
                with self._lock:
                    idle = time.monotonic() - self._asked > self.idle_after_s
                if idle:
                    self._wake.wait()
                continue
            started = time.monotonic()
            try:
                plan = self._fetch()
                self.fetches += 1
                backoff.succeeded()
                newer = plan is not None and plan.version > self._known
                if newer:
                    assert plan is not None
                    with self._lock:
                        self._known = plan.version
                        self._latest = plan
                delay = 0.0 if newer else self.interval_s - (time.monotonic() - started)
            except Exception as exc:  # never into the loop; a dead fetcher only means old plans
                if self._stop.is_set():  # closing: the client may be gone under the request
                    break
                self.errors += 1
                delay = backoff.failed()
                if self.errors == 1 or self.errors % 20 == 0:
                    log.warning("plan fetch failed (%d so far): %r", self.errors, exc)
            if delay > 0:
                self._stop.wait(delay)
