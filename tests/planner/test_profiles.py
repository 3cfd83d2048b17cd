"""Prior speeds from the published GPU figures, matched loosely by device name."""

from __future__ import annotations

import pytest

from server.planner.errors import InvalidInput
from server.planner.profiles import (
    CPU_DEFAULT_SAMPLES_PER_S,
    DEFAULT_PROFILES,
    load_gpu_profiles,
    parse_gpu_profiles,
    prior_speed,
)

CSV = DEFAULT_PROFILES

ROWS = [
    {"gpu": "A100 SXM4 80GB", "memory_gb": "80", "model": "resnet50", "precision": "tf32",
     "batch_per_gpu": "640", "samples_per_s": "1066", "measured": "yes", "source": "x"},
    {"gpu": "A100 SXM4 80GB", "memory_gb": "80", "model": "resnet50", "precision": "amp",
     "batch_per_gpu": "1280", "samples_per_s": "1582", "measured": "yes", "source": "x"},
    {"gpu": "A100 SXM4 80GB", "memory_gb": "80", "model": "bert-base-squad", "precision": "amp",
     "batch_per_gpu": "", "samples_per_s": "443", "measured": "yes", "source": "x"},
    {"gpu": "GTX 1080 Ti", "memory_gb": "11", "model": "resnet50", "precision": "fp32",
     "batch_per_gpu": "100", "samples_per_s": "196", "measured": "yes", "source": "x"},
    {"gpu": "GTX 1080", "memory_gb": "8", "model": "resnet50", "precision": "fp32",
     "batch_per_gpu": "16", "samples_per_s": "104", "measured": "yes", "source": "x"},
    {"gpu": "A10", "memory_gb": "24", "model": "resnet50", "precision": "fp32",
     "batch_per_gpu": "224", "samples_per_s": "349", "measured": "yes", "source": "x"},
]  # fmt: skip


PROFILES = parse_gpu_profiles(ROWS)


@pytest.mark.parametrize(
    ("name", "speed", "matched"),
    [
        ("NVIDIA A100-SXM4-80GB", 1066.0, "A100 SXM4 80GB"),
        ("NVIDIA GeForce GTX 1080 Ti", 196.0, "GTX 1080 Ti"),
        ("GeForce GTX 1080", 104.0, "GTX 1080"),
        ("NVIDIA A10", 349.0, "A10"),  # not A100
    ],
)
def test_loose_name_matching(name: str, speed: float, matched: str) -> None:
    prior = prior_speed(name, PROFILES)
    assert (prior.samples_per_s, prior.matched) == (speed, matched)


def test_precision_and_workload() -> None:
    a100 = "NVIDIA A100-SXM4-80GB"
    assert prior_speed(a100, PROFILES, precision="amp").samples_per_s == 1582.0
    assert prior_speed(a100, PROFILES, workload="bert-base-squad").samples_per_s == 443.0
    fallback = prior_speed("NVIDIA A10", PROFILES, workload="bert-base-squad")
    assert fallback.samples_per_s == 349.0 and "resnet50 used" in fallback.source


def test_cpu_and_unknown_devices() -> None:
    cpu = prior_speed("cpu", PROFILES)
    assert cpu.samples_per_s == CPU_DEFAULT_SAMPLES_PER_S and cpu.matched is None
    assert prior_speed("Intel Xeon Gold", PROFILES, cpu=True).samples_per_s == 10.0
    unknown = prior_speed("NVIDIA B200", PROFILES)
    assert unknown.matched is None and "no profile matches" in unknown.source
    assert unknown.samples_per_s == pytest.approx(349.0)  # median of the resnet50 figures


def test_bad_rows_are_named() -> None:
    with pytest.raises(InvalidInput, match="line 2"):
        parse_gpu_profiles([{**ROWS[0], "samples_per_s": "fast"}])
    with pytest.raises(InvalidInput, match="line 3"):
        parse_gpu_profiles([ROWS[0], {**ROWS[0], "samples_per_s": "0"}])


def test_the_shared_csv_loads_and_matches_driver_names() -> None:
    profiles = load_gpu_profiles(CSV)
    assert len(profiles) >= 30
    assert prior_speed("Tesla V100-SXM2-16GB", profiles).samples_per_s == 369.0
    assert prior_speed("NVIDIA H100 PCIe", profiles).matched == "H100 PCIe 80GB"
    assert prior_speed("NVIDIA H100 80GB HBM3", profiles, memory_gb=80).matched == "H100 SXM5 80GB"
