"""A worker thread's outcome handed to the request that awaits it on its event loop (the
telemetry writer's groups, the heartbeat groups)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TypeVar

T = TypeVar("T")


def answer(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], outcome: T | BaseException
) -> None:
    """Settle ``future`` with ``outcome`` (an exception is raised to its awaiter) on ``loop``,
    from any thread; nothing if the loop has closed or the request was cancelled meanwhile."""
    with contextlib.suppress(RuntimeError):  # its event loop has closed
        loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[T], outcome: T | BaseException) -> None:
    if future.done():  # the request was cancelled (its client went away)
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
