"""Training metrics from inside the loop: the leader reports the exact global mean loss of the
global batch, ``ctx.log`` reports user values at the right iteration, bad values are refused at
the call, and the metric sender shares the telemetry sender's queue discipline."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
import torch
from torch import nn

from agent.runtime.context import EvenflowContext
from agent.runtime.metrics import MetricReporter, MetricSender
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from agent.runtime.telemetry import TelemetryClosed
from agent.runtime.trainer import RunResult, RuntimeOptions, run_training
from contract.agent import MetricBatch, MetricPoint, PlanOut
from contract.base import MAX_METRIC_NAMES
from contract.enums import PlanSource
from contract.spec import JobSpec

from .spawn import run_ranks
from .user_workload import _data

B, SAMPLES, ITERATIONS, SEED, LOSS_EVERY = 24, 100, 12, 7, 3  # 100 % 24 = 4: a partial batch
SIZES = [7, 17]  # unequal local batches


def spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "metrics",
            "workload": {
                "entrypoint": "tests.runtime.user_workload:train_logged",
                "seed": SEED,
                "args": {"samples": SAMPLES},
            },
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": 2,
        }
    )


def _rank(rank: int, world: int) -> tuple[RunResult, list[MetricPoint]]:
    points: list[MetricPoint] = []
    lock = threading.Lock()

    def post(batch: MetricBatch) -> None:
        with lock:
            points.extend(batch.points)

    initial = PlanOut(
        job_id=1,
        version=1,
        batch_sizes=SIZES,
        global_batch=B,
        source=PlanSource.INITIAL,
        reason="test",
        created_at=datetime.now(UTC),
    )
    options = RuntimeOptions(loss_every=LOSS_EVERY, telemetry_flush_s=0.05, close_deadline_s=5)
    result = run_training(spec(), post_metrics=post, initial_plan=initial, options=options)
    with lock:
        return result, list(points)


def _single_process_losses() -> dict[int, float]:
    """The mean loss over each iteration's whole global batch, training on one process."""
    torch.manual_seed(SEED)
    model = nn.Linear(4, 1).double()
    x_all, y_all = (t.double() for t in _data(SEED, n=SAMPLES))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = GlobalBatchSampler(SAMPLES, B, seed=SEED)
    losses = {}
    for it in range(ITERATIONS):
        idx = torch.cat([sampler.local_indices(it, SIZES, r) for r in range(2)])
        loss = nn.functional.mse_loss(model(x_all[idx]), y_all[idx], reduction="sum") / len(idx)
        losses[it] = loss.item()
        sgd.zero_grad()
        loss.backward()
        sgd.step()
    return losses


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_leader_reports_the_exact_global_loss_and_each_rank_its_own_logs() -> None:
    results = run_ranks(_rank, 2, timeout=90)
    reference = _single_process_losses()
    (r0, points0), (r1, points1) = results
    for r in (r0, r1):
        assert r.metrics is not None and r.metrics.pending == 0 and r.metrics.dropped == 0
    loss = {p.iteration: p.value for p in points0 if p.name == "loss"}
    # every LOSS_EVERY-th iteration and the last; only the leader (rank 0) reports it
    assert sorted(loss) == [0, 3, 6, 9, 11]
    assert all(p.rank == 0 for p in points0) and all(p.rank == 1 for p in points1)
    assert not any(p.name == "loss" for p in points1)
    for it, value in loss.items():
        assert abs(value - reference[it]) <= 1e-6 * max(1.0, abs(reference[it])), it
    assert dict(r0.losses) == loss  # what the run result holds, too
    # ctx.log: at the iteration of the batch just trained, the lr once at iteration 0
    counts = [GlobalBatchSampler(SAMPLES, B).local_sizes(i, SIZES) for i in range(ITERATIONS)]
    for rank, points in ((0, points0), (1, points1)):
        seen = sorted((p.iteration, p.value) for p in points if p.name == "local_batch")
        assert seen == [(i, float(counts[i][rank])) for i in range(ITERATIONS)]
        assert [(p.iteration, p.value) for p in points if p.name == "lr"] == [(0, 0.05)]
    assert counts[4] != SIZES  # the partial batch of the epoch's end was among them


def _context(submit: Callable[[MetricPoint], None] | None = None, rank: int = 0) -> EvenflowContext:
    job = JobSpec.model_validate(
        {
            "name": "t",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "workers": 1,
            "iterations": 1,
        }
    )
    agreement = PlanAgreement(RuntimePlan(1, (8,)), rank=0, world_size=1, global_batch=8)
    return EvenflowContext(job, agreement, rank=rank, world_size=1, submit_metric=submit)


def test_log_refuses_bad_input_at_the_call() -> None:
    points: list[MetricPoint] = []
    ctx = _context(points.append)
    ctx.log("acc", 0.5)
    ctx.log("acc", torch.tensor(0.75, requires_grad=True), iteration=3)
    assert [(p.name, p.iteration, p.value, p.rank) for p in points] == [
        ("acc", 0, 0.5, 0),
        ("acc", 3, 0.75, 0),
    ]
    bad = [
        (("loss", 1.0), "reserved"),
        (("bad name", 1.0), "letters, digits"),
        (("", 1.0), "letters, digits"),
        (("x" * 129, 1.0), "letters, digits"),
        (("acc2", float("nan")), "finite"),
        (("acc2", float("inf")), "finite"),
        (("acc2", 1e31), "finite"),
        (("acc2", "high"), "not a number"),
        (("acc2", torch.ones(2)), "not a number"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            ctx.log(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already logged at iteration 3"):
        ctx.log("acc", 0.1, iteration=3)
    with pytest.raises(ValueError, match="iteration"):
        ctx.log("acc3", 1.0, iteration=-1)
    for i in range(MAX_METRIC_NAMES - 1):  # "acc" is one
        ctx.log(f"m{i}", 1.0)
    with pytest.raises(ValueError, match=f"at most {MAX_METRIC_NAMES}"):
        ctx.log("one-too-many", 1.0)
    assert len(points) == 2 + MAX_METRIC_NAMES - 1  # nothing refused was queued


def test_log_never_raises_a_delivery_error_but_stops_when_the_job_ended() -> None:
    def broken(_: MetricPoint) -> None:
        raise RuntimeError("queue broke")

    _context(broken).log("acc", 1.0)  # logged and dropped, training goes on
    _context(None).log("acc", 1.0)  # no control plane: checked, then nowhere to go

    def closed(_: MetricPoint) -> None:
        raise TelemetryClosed("job 1 has ended")

    with pytest.raises(TelemetryClosed):
        _context(closed).log("acc", 1.0)


def test_a_non_finite_global_loss_is_skipped_not_sent(caplog: pytest.LogCaptureFixture) -> None:
    points: list[MetricPoint] = []
    reporter = MetricReporter(2, points.append)
    for it, value in enumerate([0.5, float("nan"), float("inf"), 2e30, 0.25]):
        reporter.loss(it, value)
    assert [(p.name, p.rank, p.iteration, p.value) for p in points] == [
        ("loss", 2, 0, 0.5),
        ("loss", 2, 4, 0.25),
    ]
    assert caplog.text.count("is not reported") == 1  # once per run, not per iteration


def test_metric_sender_batches_retries_and_closes_on_409() -> None:
    batches: list[list[tuple[str, int]]] = []
    fail = {"n": 2}

    def post(batch: MetricBatch) -> None:
        if fail["n"]:
            fail["n"] -= 1
            raise ConnectionError("down")
        batches.append([(p.name, p.iteration) for p in batch.points])

    s = MetricSender(post, flush_records=3, flush_interval_s=0.02, backoff_initial_s=0.01)
    for i in range(7):
        s.submit(MetricPoint(rank=0, iteration=i, name="acc", value=1.0))
    stats = s.close(deadline_s=5)
    assert [p for b in batches for p in b] == [("acc", i) for i in range(7)]
    assert (stats.submitted, stats.delivered, stats.dropped, stats.pending) == (7, 7, 0, 0)
    assert stats.failures == 2

    def ended(batch: MetricBatch) -> None:
        raise TelemetryClosed("job ended")

    s = MetricSender(ended, flush_records=1)
    s.submit(MetricPoint(rank=0, iteration=0, name="acc", value=1.0))
    deadline = threading.Event()
    for _ in range(200):
        try:
            s.submit(MetricPoint(rank=0, iteration=1, name="acc", value=1.0))
        except TelemetryClosed:
            break
        deadline.wait(0.01)
    else:
        pytest.fail("the sender never reported the job's end")
    s.close(deadline_s=1)
