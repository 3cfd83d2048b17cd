"""What the CLI shows of a job beyond its row: the plan in force with each worker's model, its
straggler events, and the one-line live view of ``evenflow jobs watch``.

Each function turns API bodies into rows or a line, so it is tested without a server.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract.agent import PlanOut
from contract.api import EventOut, HostOut, JobOut, ModelOut
from contract.base import LOSS_METRIC
from contract.dashboard import MetricsOut, SeriesOut, ThroughputOut

PLAN_COLUMNS = ["rank", "batch", "model t(b)", "fit"]
EVENT_COLUMNS = ["id", "rank", "kind", "severity", "iterations", "action"]
DEVICE_COLUMNS = ["host", "status", "device id", "device", "model", "use"]
METRIC_COLUMNS = ["metric", "rank", "iteration", "latest", "min", "max"]


def plan_title(plan: PlanOut) -> str:
    predicted = f"; predicted {plan.predicted_ms:.1f} ms" if plan.predicted_ms is not None else ""
    return f"plan v{plan.version} ({plan.source.value}{predicted}): {plan.reason}"


def plan_rows(plan: PlanOut, models: Sequence[ModelOut]) -> list[list[object]]:
    """One row per rank: its batch under the plan (or 'excluded') and its fitted model."""
    by_rank = {m.rank: m for m in models}
    rows: list[list[object]] = []
    for rank, batch in enumerate(plan.batch_sizes):
        model = by_rank.get(rank)
        rows.append(
            [
                rank,
                "excluded" if rank in plan.excluded else batch,
                _model_text(model),
                _fit_text(model),
            ]
        )
    return rows


def _model_text(m: ModelOut | None) -> str:
    if m is None or m.per_sample_ms is None:
        return "not fitted yet"
    text = f"{m.intercept_ms or 0:.1f} + {m.per_sample_ms:.2f}/sample ms"
    if m.floor_ms:
        text += f", at least {m.floor_ms:.1f}"
    return text


def _fit_text(m: ModelOut | None) -> str:
    if m is None:
        return ""
    if not m.identifiable:
        return m.reason or "one batch size seen"
    r2 = f"r² {m.r2:.2f}, " if m.r2 is not None else ""
    return f"{r2}{m.observations} obs at {m.distinct_batch_sizes} sizes"


def event_rows(events: Sequence[EventOut]) -> list[list[object]]:
    return [
        [
            e.id,
            "" if e.rank is None else e.rank,
            e.kind,
            f"{e.severity:.2f}x",
            f"{e.start_iteration}-{e.end_iteration}"
            if e.end_iteration is not None
            else f"{e.start_iteration}- (open)",
            e.action,
        ]
        for e in events
    ]


def device_rows(hosts: Sequence[HostOut]) -> list[list[object]]:
    """A row per device, hosts by name: the device id is what a spec's ``devices:`` lists."""
    rows: list[list[object]] = []
    for h in sorted(hosts, key=lambda h: h.name):
        head: list[object] = [h.name, h.status.value]
        if not h.devices:
            rows.append([*head, "", "no devices", "", ""])
        for d in sorted(h.devices, key=lambda d: (d.kind.value, d.index)):
            use = d.status.value + (f" (job {d.job_id})" if d.job_id is not None else "")
            model = f"{d.model}, {d.memory_mb:,} MB"
            rows.append([*head, d.id, f"{d.kind.value}:{d.index}", model, use])
            head = ["", ""]
    return rows


def idle_fraction(series: SeriesOut) -> float | None:
    """Share of the recent window's worker time spent waiting in the all-reduce."""
    busy = sum(w.data_ms + w.compute_ms + w.sync_ms for w in series.window)
    return sum(w.sync_ms for w in series.window) / busy if busy else None


def watch_line(
    job: JobOut,
    speed: ThroughputOut | None,
    series: SeriesOut | None,
    plan: PlanOut | None,
    metrics: MetricsOut | None = None,
) -> str:
    """``job 3 running  iteration 1234  2,507 samples/s  loss 0.4312  idle 6%  plan v4 [90, 90,
    48, 28]``."""
    parts = [f"job {job.id} {job.status.value}"]
    if speed is not None and speed.iteration is not None:
        parts.append(f"iteration {speed.iteration}")
    if speed is not None and speed.samples_per_s is not None:
        parts.append(f"{speed.samples_per_s:,.0f} samples/s")
    loss = latest_loss(metrics) if metrics is not None else None
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    idle = idle_fraction(series) if series is not None else None
    if idle is not None:
        parts.append(f"idle {100 * idle:.0f}%")
    if plan is not None:
        excluded = f" excluded {plan.excluded}" if plan.excluded else ""
        parts.append(f"plan v{plan.version} {plan.batch_sizes}{excluded}")
    if job.error:
        parts.append(f"error: {job.error.splitlines()[0]}")
    return "  ".join(parts)


def latest_loss(metrics: MetricsOut) -> float | None:
    """The newest global loss, whichever rank reported it."""
    newest = max(
        (s for s in metrics.series if s.name == LOSS_METRIC),
        key=lambda s: s.last_iteration,
        default=None,
    )
    return newest.last_value if newest is not None else None


def metric_rows(metrics: MetricsOut) -> list[list[object]]:
    """One row per (metric, rank): its newest value exactly, and the range of its bucket means
    (the global ``loss`` is reported by the plan's leader rank)."""
    return [
        [
            m.name,
            m.rank,
            m.last_iteration,
            f"{m.last_value:.6g}",
            f"{min(m.value):.6g}" if m.value else "",
            f"{max(m.value):.6g}" if m.value else "",
        ]
        for m in metrics.series
    ]
