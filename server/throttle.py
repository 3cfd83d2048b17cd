"""Throttling of bad credentials per client address (``Settings.auth_failures_max`` in any
``auth_failures_window_s``), shared by the API's gate (``server.api.gate``) and the dashboard's
``/login``: past the limit, bad credentials get 429 with ``Retry-After``; good ones still pass."""

from __future__ import annotations

import time

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter


class FailureLimit:
    """At most ``max`` failures per client address in any ``window_s`` seconds (a moving
    window, in memory: per server process)."""

    def __init__(self, max_failures: int, window_s: float) -> None:
        self.max, self.window_s = max_failures, window_s
        self._item = RateLimitItemPerSecond(max_failures, max(1, round(window_s)))
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def fail(self, address: str) -> int | None:
        """Count one failure; None while within the limit, else seconds until the oldest
        failure leaves the window."""
        if self._limiter.hit(self._item, address):
            return None
        reset = self._limiter.get_window_stats(self._item, address).reset_time
        return max(1, round(reset - time.time()))

    def message(self, address: str, retry_after: int) -> str:
        return (
            f"too many bad credentials from {address}: at most {self.max} in "
            f"{self.window_s:g} s; retry in {retry_after} s"
        )
