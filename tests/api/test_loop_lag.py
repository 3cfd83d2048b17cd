"""The API process's event-loop lag in /metrics: how long a request arriving now would wait
before the server could read it; and its garbage collections' pauses, which hold it all."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

from prometheus_client import CollectorRegistry, Histogram

from server.metrics import GcPauses, measure_loop_lag
from server.serve import GC_YOUNG_OBJECTS, settle_heap
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


def test_the_app_times_its_garbage_collections_by_generation(api: Api) -> None:
    """A full collection holds the whole process (loop and threads): /metrics has each one's
    pause under its generation, from the app's start until it stops."""

    def collections(generation: str) -> float:
        for line in api.client.get("/metrics").text.splitlines():
            if line.startswith(f'evenflow_gc_pause_seconds_count{{generation="{generation}"}}'):
                return float(line.split()[-1])
        return 0.0

    before = collections("2")
    kept = [[i] for i in range(200_000)]  # containers for the collector to walk
    gc.collect()
    gc.collect()
    assert collections("2") >= before + 2
    total = next(
        float(line.split()[-1])
        for line in api.client.get("/metrics").text.splitlines()
        if line.startswith('evenflow_gc_pause_seconds_sum{generation="2"}')
    )
    assert total > 0 and len(kept) == 200_000


def test_gc_pauses_stop_being_timed_once_stopped() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("gc_seconds", "gc", ["generation"], registry=registry)
    pauses = GcPauses.into(histogram)
    pauses.start()
    pauses.start()  # once only
    gc.collect()
    pauses.stop()
    gc.collect()
    assert registry.get_sample_value("gc_seconds_count", {"generation": "2"}) == 1
    assert pauses not in gc.callbacks


def test_a_server_process_freezes_its_start_and_collects_its_young_less_often() -> None:
    """``settle_heap`` (the API's and the controller's processes, once started): what exists
    then is out of the collector's view, and the youngest generation is collected every
    ``GC_YOUNG_OBJECTS`` allocations instead of Python's 700."""
    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_OBJECTS, *before[1:])
        assert before[0] < GC_YOUNG_OBJECTS
    finally:
        gc.unfreeze()  # the test process goes on: its garbage must stay collectable
        gc.set_threshold(*before)
