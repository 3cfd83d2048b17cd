"""What one rank did, kept while it trains: the raw material of its run result."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOSSES = 4096


@dataclass
class ContextStats:
    """What one rank did; the raw material of :class:`~agent.runtime.trainer.RunResult`."""

    iterations: int = 0
    samples_seen: int = 0
    """Samples this rank trained on."""
    global_samples: int = 0
    """Samples in all global batches so far (sum of global counts)."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(iteration, global mean loss), thinned to at most ``MAX_LOSSES`` entries spread over the
    run; always holds the last iteration's."""
    agreement_ms: float = 0.0
    """Total host time spent at boundaries (agreement, and any regroup and re-synchronisation)."""
    exclusions: list[tuple[int, int]] = field(default_factory=list)
    """(first iteration sat out, iteration rejoined at) for each time this rank was excluded."""
    probes: int = 0
    """Speed probes this rank ran while excluded."""
    resync_ms: list[float] = field(default_factory=list)
    """Host time of each re-synchronisation this rank took part in."""
    ooms: list[tuple[int, int]] = field(default_factory=list)
    """(iteration, pass size) of each pass that ran out of memory and was redone smaller."""
    resumed_from: int | None = None
    """The iteration this run resumed at from a checkpoint (None: it started from 0)."""
    checkpoints: list[tuple[int, int, float]] = field(default_factory=list)
    """(iteration, bytes, write ms) of each checkpoint this rank wrote."""
    stopped_at: int | None = None
    """The iteration the job ended at when a rank stopped it early (``ctx.stop()``, or a rank
    that left its loop), else None."""
    replica_checks: int = 0
    """Checks that every rank's parameters were the same (each passed, or the job failed)."""
    _loss_stride: int = field(default=1, repr=False)
    _loss_calls: int = field(default=0, repr=False)

    def record_loss(self, iteration: int, value: float, *, last: bool) -> None:
        """Keep every stride-th loss; when the list is full, keep every other and double the
        stride, so memory stays bounded however long the run."""
        keep = self._loss_calls % self._loss_stride == 0
        self._loss_calls += 1
        if keep or last:
            self.losses.append((iteration, value))
        if len(self.losses) > MAX_LOSSES:
            self.losses = self.losses[::2]
            self._loss_stride *= 2
            if last and self.losses[-1][0] != iteration:
                self.losses.append((iteration, value))
