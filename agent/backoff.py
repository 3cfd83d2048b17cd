"""One retry policy for everything the agent and the runtime send: exponential backoff.

The telemetry sender, the plan fetcher and the agent's registration each retry a failed call
after ``Backoff.failed()`` seconds and call ``succeeded()`` once one goes through."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Backoff:
    """``initial_s`` after the first failure, ``factor`` times longer after each further one,
    never more than ``max_s``; back to no delay after a success."""

    initial_s: float
    max_s: float
    factor: float = 2.0
    current_s: float = 0.0
    """The delay before the next try; 0 while the last call succeeded."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.factor < 1:
            raise ValueError(f"invalid backoff {self.initial_s}..{self.max_s} x{self.factor}")

    @property
    def failing(self) -> bool:
        return self.current_s > 0

    def failed(self) -> float:
        """Record a failure; the delay before the next try."""
        self.current_s = min(self.max_s, max(self.initial_s, self.current_s * self.factor))
        return self.current_s

    def succeeded(self) -> None:
        self.current_s = 0.0
