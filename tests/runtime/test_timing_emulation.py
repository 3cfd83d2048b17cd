"""Phase timings, and padding of the compute phase to an emulated speed."""

from __future__ import annotations

import time

import pytest
import torch

from agent.runtime.emulation import Emulator
from agent.runtime.timing import IterationTimer
from contract.spec import EmulatedWorker, Slowdown


def test_target_follows_model_and_slowdowns() -> None:
    w = EmulatedWorker(
        intercept_ms=2.0,
        per_sample_ms=0.5,
        slowdowns=[
            Slowdown(from_iteration=10, to_iteration=20, factor=3.0),
            Slowdown(from_iteration=15, to_iteration=16, factor=2.0),
        ],
    )
    e = Emulator(w)
    assert e.target_ms(0, 8) == pytest.approx(6.0)
    assert e.target_ms(9, 8) == pytest.approx(6.0)
    assert e.target_ms(10, 8) == pytest.approx(18.0)
    assert e.target_ms(15, 8) == pytest.approx(36.0)  # overlapping slowdowns multiply
    assert e.target_ms(20, 8) == pytest.approx(6.0)  # to_iteration is exclusive
    assert e.target_ms(12, 0) == 0.0  # 0 samples: no intercept either


def test_pad_sleeps_only_the_remainder_and_never_for_zero_samples() -> None:
    slept: list[float] = []
    e = Emulator(EmulatedWorker(intercept_ms=1.0, per_sample_ms=1.0), sleep=slept.append)
    assert e.pad(0, 9, elapsed_ms=4.0) == pytest.approx(6.0)
    assert e.pad(0, 9, elapsed_ms=12.0) == 0.0  # already slower than the target
    assert e.pad(0, 0, elapsed_ms=0.0) == 0.0
    assert slept == [pytest.approx(0.006)]
    assert e.padded_ms == pytest.approx(6.0)
    assert e.emulated is True


def test_timer_measures_phases_with_real_padding() -> None:
    timer = IterationTimer()
    emu = Emulator(EmulatedWorker(intercept_ms=5.0, per_sample_ms=1.0))
    timer.begin()
    time.sleep(0.01)
    timer.data_done()
    time.sleep(0.002)  # "real compute"
    emu.pad(3, 15, timer.compute_elapsed_ms())  # target 20 ms
    timer.compute_done()
    time.sleep(0.005)
    timer.sync_done()
    (t,) = timer.finish(iteration=3, plan_version=2, batch_size=15)
    assert (t.iteration, t.plan_version, t.batch_size) == (3, 2, 15)
    assert 10 <= t.data_ms < 30
    assert 20 <= t.compute_ms < 35
    assert 5 <= t.sync_ms < 25
    assert abs(t.ts - time.time()) < 1
    assert timer.drain() == []


def test_emulated_memory_raises_a_real_out_of_memory_error() -> None:
    w = EmulatedWorker(
        per_sample_ms=1.0, memory_mb=12_288, memory_base_mb=4_595, memory_per_sample_mb=90.7
    )
    e = Emulator(w)
    assert w.memory_cap == 84  # (12288 - 4595) / 90.7 = 84.8
    assert e.allocate(84) == pytest.approx(4_595 + 90.7 * 84)
    with pytest.raises(torch.OutOfMemoryError, match="85 samples needs 12304 MiB"):
        e.allocate(85)
    assert issubclass(torch.OutOfMemoryError, RuntimeError)  # what CUDA's allocator raises
    assert Emulator(EmulatedWorker(per_sample_ms=1.0)).allocate(10**6) is None  # not emulated


def test_timer_carries_the_peak_memory_noted_in_an_iteration() -> None:
    timer = IterationTimer()
    timer.begin()
    timer.data_done()
    timer.note_peak_memory(100.0)
    timer.note_peak_memory(250.0)  # one note per pass: the largest is the peak
    timer.note_peak_memory(200.0)
    timer.compute_done()
    timer.sync_done()
    (t,) = timer.finish(iteration=0, plan_version=1, batch_size=8)
    assert t.peak_memory_mb == 250.0
    timer.begin()  # a new iteration starts without a peak
    timer.data_done()
    timer.compute_done()
    timer.sync_done()
    assert timer.finish(iteration=1, plan_version=1, batch_size=8)[0].peak_memory_mb is None
