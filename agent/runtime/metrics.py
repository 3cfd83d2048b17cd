"""Training metrics from inside the loop: the job's global loss and what user code logs.

The runtime reports the exact global mean loss of the global batch (the gradient all-reduce
computes it anyway) under the reserved name ``loss`` from the plan's leader rank, each time it
reads it (every ``loss_every`` iterations); user code reports its own values with
``ctx.log(name, value)`` (:meth:`~agent.runtime.context.EvenflowContext.log`), one point for the
calling rank at the current iteration. :class:`MetricSender` posts them in the background, with
the same best-effort queue as the timings (:class:`~agent.runtime.sender.BatchSender`):
never blocking, never raising into training but :class:`~agent.runtime.sender.TelemetryClosed`
once the job has ended. The server stores a point once per (job, name, rank, iteration).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import SupportsFloat

from agent.runtime.sender import BatchSender, TelemetryClosed
from contract.agent import MetricBatch, MetricPoint
from contract.base import (
    LOSS_METRIC,
    MAX_METRIC_NAMES,
    MAX_METRIC_VALUE,
    MAX_TELEMETRY_RECORDS,
    NAME_PATTERN,
)

log = logging.getLogger("evenflow.runtime.metrics")

PostMetrics = Callable[[MetricBatch], object]
"""Sends one batch; raises on any failure (its return value is ignored)."""

_NAME = re.compile(NAME_PATTERN)


class MetricSender(BatchSender[MetricPoint]):
    """Batches metric points and posts them as :class:`~contract.agent.MetricBatch`."""

    def __init__(
        self,
        post: PostMetrics,
        *,
        flush_records: int = 256,
        flush_interval_s: float = 2.0,
        max_buffer: int = 20_000,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        def send(points: list[MetricPoint], urgent: bool) -> object:
            return post(MetricBatch(points=points))

        super().__init__(
            send,
            what="metrics",
            max_batch=MAX_TELEMETRY_RECORDS,
            flush_records=flush_records,
            flush_interval_s=flush_interval_s,
            max_buffer=max_buffer,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
        )


class MetricReporter:
    """One rank's metric points on their way to the sender (``submit``; ``None``: checked, then
    dropped). What user code logs is checked at the call, so a mistake is a clear
    ``ValueError`` where it was made rather than a batch the server refuses later: a name of the
    contract's form (not the reserved ``loss``), at most ``MAX_METRIC_NAMES`` of them, a finite
    value within ``MAX_METRIC_VALUE``, one value per name per iteration. Delivery is best
    effort: a failing ``submit`` is logged, except :class:`TelemetryClosed` (the job ended),
    which stops training."""

    def __init__(self, rank: int, submit: Callable[[MetricPoint], None] | None) -> None:
        self.rank = rank
        self._submit = submit
        self._last: dict[str, int] = {}
        """Per name, the last iteration logged."""
        self._loss_warned = False

    def log(self, name: str, value: SupportsFloat, iteration: int) -> None:
        """A user metric of this rank at ``iteration``; ``ValueError`` saying what is wrong."""
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ValueError(f"metric {name!r}: iteration {iteration!r} must be an int")
        if not 0 <= iteration <= 10**12:
            raise ValueError(f"metric {name!r}: iteration {iteration} must be in [0, 10**12]")
        self._send(name, self._check(name, value, iteration), iteration)

    def loss(self, iteration: int, value: float) -> None:
        """The job's global loss (the leader's to report); a non-finite one is skipped, with
        one warning per run: the chart shows the gap."""
        if math.isfinite(value) and abs(value) <= MAX_METRIC_VALUE:
            self._send(LOSS_METRIC, value, iteration)
        elif not self._loss_warned:
            self._loss_warned = True
            log.warning("global loss %r at iteration %d is not reported", value, iteration)

    def _send(self, name: str, value: float, iteration: int) -> None:
        if self._submit is None:
            return
        try:
            self._submit(MetricPoint(rank=self.rank, iteration=iteration, name=name, value=value))
        except TelemetryClosed:  # the job has ended on the control plane: stop training
            raise
        except Exception as exc:  # best effort
            log.warning("metric %s at iteration %d dropped: %r", name, iteration, exc)

    def _check(self, name: str, value: SupportsFloat, iteration: int) -> float:
        """The value as a float; raises ``ValueError`` saying what is wrong."""
        if not isinstance(name, str) or not 1 <= len(name) <= 128 or not _NAME.match(name):
            raise ValueError(
                f"metric name {name!r} must be 1 to 128 letters, digits or . _ : - "
                "(starting with a letter or digit)"
            )
        if name == LOSS_METRIC:
            raise ValueError(
                f"the metric name {LOSS_METRIC!r} is reserved for the job's global loss, which "
                "Evenflow reports itself; log yours under another name (e.g. 'train_loss')"
            )
        try:
            item = getattr(value, "item", None)  # a one-element tensor (even one with a
            value = float(item() if callable(item) else value)  # gradient), a numpy scalar
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"metric {name!r}: value {value!r} is not a number") from None
        if not math.isfinite(value) or abs(value) > MAX_METRIC_VALUE:
            raise ValueError(
                f"metric {name!r}: value {value!r} must be finite and within ±{MAX_METRIC_VALUE:g}"
            )
        if name not in self._last and len(self._last) >= MAX_METRIC_NAMES:
            raise ValueError(
                f"metric {name!r} would be name number {MAX_METRIC_NAMES + 1}; a job reports at "
                f"most {MAX_METRIC_NAMES} (put what varies in the value, not in the name)"
            )
        if self._last.get(name) == iteration:
            raise ValueError(
                f"metric {name!r} was already logged at iteration {iteration}; log each metric "
                "at most once per iteration"
            )
        self._last[name] = iteration
        return value
