"""The API process's event-loop lag in /metrics: how long a request arriving now would wait
before the server could read it."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import CollectorRegistry, Histogram

from server.metrics import measure_loop_lag
from tests.harness import Api

NAME = "evenflow_event_loop_lag_seconds"


def test_a_loop_held_up_shows_as_lag() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("lag_seconds", "lag", registry=registry, buckets=(0.05, 0.25, 1.0))

    async def scenario() -> None:
        meter = asyncio.ensure_future(measure_loop_lag(histogram, every_s=0.02))
        await asyncio.sleep(0.1)
        time.sleep(0.4)  # the loop runs nothing else meanwhile, as under a CPU-bound request
        await asyncio.sleep(0.1)
        meter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await meter

    asyncio.run(scenario())
    count = registry.get_sample_value("lag_seconds_count")
    within = registry.get_sample_value("lag_seconds_bucket", {"le": "0.25"})
    assert count is not None and within is not None
    assert count >= 5  # one every 0.02 s around the stall
    assert count - within >= 1  # the stall, 0.4 s less the timer's 0.02
    total = registry.get_sample_value("lag_seconds_sum")
    assert total is not None and total >= 0.3


def test_the_app_measures_its_loop_all_along(api: Api) -> None:
    def count() -> float:
        for line in api.client.get("/metrics").text.splitlines():
            if line.startswith(f"{NAME}_count"):
                return float(line.split()[-1])
        raise AssertionError(f"{NAME} is not in /metrics")

    first = count()
    time.sleep(0.5)
    assert count() >= first + 2
