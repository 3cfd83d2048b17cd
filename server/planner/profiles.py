"""Prior device speeds from published GPU figures, for placing a job before any telemetry exists.

The figures ship beside this module in ``gpu_profiles.csv`` (``DEFAULT_PROFILES``; a copy of
``shared/data/gpu_profiles.csv``) (columns ``gpu, memory_gb, model, precision,
batch_per_gpu, samples_per_s, measured, source``). The caller loads them once (``load_gpu_profiles``
reads a path; ``parse_gpu_profiles`` takes rows already read), then asks ``prior_speed`` for each
device. Once a job runs, fitted models from telemetry replace these priors.

Names are matched loosely, because drivers report ``NVIDIA A100-SXM4-80GB`` or
``Tesla V100-PCIE-16GB`` where the table says ``A100 SXM4 80GB`` and ``V100 16GB``: both sides are
cut into lower-case tokens, vendor words dropped. A profile is a candidate only if its family token
(its first token with a digit that is not a memory size, such as ``a100`` or ``4090``) appears in
the device name; candidates score one point per shared token and lose half a point per profile
token the device name lacks (so ``GTX 1080`` prefers ``GTX 1080`` to ``GTX 1080 Ti``); ties go to
the closest memory size, then to measured rows. A CPU gets ``cpu_default``, an unknown GPU the
median of the profiled GPUs for the workload; the ``source`` says which happened.
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from server.planner.errors import InvalidInput

CPU_DEFAULT_SAMPLES_PER_S = 10.0
"""An order of magnitude for a CPU worker (ResNet-50-like work), not a measurement."""

VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla", "gpu", "graphics", "corporation"})
MEMORY_TOKEN = re.compile(r"^\d+gb$")
FULL_PRECISION = frozenset({"fp32", "tf32"})


@dataclass(frozen=True)
class GpuProfile:
    """One row of the published figures."""

    gpu: str
    memory_gb: float
    model: str
    """The workload, such as ``resnet50`` or ``bert-base-squad``."""
    precision: str
    batch_per_gpu: int | None
    samples_per_s: float
    measured: bool
    source: str


@dataclass(frozen=True)
class SpeedPrior:
    """A device's prior speed and where it came from."""

    samples_per_s: float
    matched: str | None
    """The profile's GPU name, or None when nothing matched."""
    source: str


def parse_gpu_profiles(rows: Iterable[Mapping[str, str]]) -> tuple[GpuProfile, ...]:
    """Profiles from csv rows (as ``csv.DictReader`` yields them)."""
    out = []
    for n, row in enumerate(rows, start=2):
        try:
            speed = float(row["samples_per_s"])
            batch = row.get("batch_per_gpu") or ""
            out.append(
                GpuProfile(
                    gpu=row["gpu"].strip(),
                    memory_gb=float(row["memory_gb"]),
                    model=row["model"].strip().lower(),
                    precision=row["precision"].strip().lower(),
                    batch_per_gpu=int(batch) if batch.strip() else None,
                    samples_per_s=speed,
                    measured=row.get("measured", "").strip().lower() == "yes",
                    source=row.get("source", "").strip(),
                )
            )
        except (KeyError, ValueError) as exc:
            raise InvalidInput(f"gpu profiles line {n}: {exc}", field="gpu_profiles") from exc
        if not math.isfinite(speed) or speed <= 0:
            raise InvalidInput(f"gpu profiles line {n}: bad samples_per_s", field="gpu_profiles")
    return tuple(out)


DEFAULT_PROFILES = Path(__file__).with_name("gpu_profiles.csv")


def load_gpu_profiles(path: str | Path = DEFAULT_PROFILES) -> tuple[GpuProfile, ...]:
    """Read and parse the profiles csv at ``path``."""
    with Path(path).open(newline="", encoding="utf-8") as handle:
        return parse_gpu_profiles(csv.DictReader(handle))


def tokens(name: str) -> tuple[str, ...]:
    """Lower-case alphanumeric tokens of a device name, vendor words dropped."""
    words = re.split(r"[^a-z0-9]+", name.lower())
    return tuple(w for w in words if w and w not in VENDOR_WORDS)


def _family(profile_tokens: tuple[str, ...]) -> str | None:
    for t in profile_tokens:
        if any(ch.isdigit() for ch in t) and not MEMORY_TOKEN.match(t):
            return t
    return None


def match_gpu(
    device_name: str, profiles: Iterable[GpuProfile], memory_gb: float | None = None
) -> str | None:
    """The profile GPU name that best matches ``device_name``, or None."""
    have = set(tokens(device_name))
    best: tuple[float, float, bool, str] | None = None
    for gpu, (memory, measured) in _gpus(profiles).items():
        want = tokens(gpu)
        family = _family(want)
        if family is None or family not in have:
            continue
        score = sum(t in have for t in want) - 0.5 * sum(t not in have for t in want)
        closeness = -abs(memory - memory_gb) if memory_gb is not None else 0.0
        key = (score, closeness, measured, gpu)
        if best is None or key[:3] > best[:3]:
            best = key
    return None if best is None else best[3]


def _gpus(profiles: Iterable[GpuProfile]) -> dict[str, tuple[float, bool]]:
    out: dict[str, tuple[float, bool]] = {}
    for p in profiles:
        memory, measured = out.get(p.gpu, (p.memory_gb, False))
        out[p.gpu] = (memory, measured or p.measured)
    return out


def _pick(rows: list[GpuProfile], precision: str | None) -> GpuProfile:
    def rank(p: GpuProfile) -> tuple[bool, bool, bool]:
        exact = precision is not None and p.precision == precision
        full = p.precision in FULL_PRECISION
        same_class = precision is None or (precision in FULL_PRECISION) == full
        return (exact, same_class, p.measured)

    return max(rows, key=rank)


def prior_speed(
    device_name: str,
    profiles: Iterable[GpuProfile],
    *,
    workload: str = "resnet50",
    precision: str | None = None,
    memory_gb: float | None = None,
    cpu: bool | None = None,
    cpu_default: float = CPU_DEFAULT_SAMPLES_PER_S,
) -> SpeedPrior:
    """Prior samples per second of ``device_name`` for ``workload``.

    ``precision`` prefers rows of that precision (None: full precision, fp32/tf32). A workload the
    matched GPU was not profiled on falls back to its ResNet-50 figure as a relative speed (what
    placement and balancing need). ``cpu`` forces (or rules out) the CPU default; by default a
    name containing "cpu" is a CPU.
    """
    rows = tuple(profiles)
    workload = workload.lower()
    precision = precision.lower() if precision else None
    is_cpu = "cpu" in tokens(device_name) if cpu is None else cpu
    if is_cpu:
        return SpeedPrior(cpu_default, None, "CPU default (an order of magnitude, not measured)")
    gpu = match_gpu(device_name, rows, memory_gb)
    if gpu is None:
        same = [p.samples_per_s for p in rows if p.model == workload]
        speed = statistics.median(same) if same else cpu_default
        return SpeedPrior(speed, None, f"no profile matches {device_name!r}; median of profiled")
    mine = [p for p in rows if p.gpu == gpu]
    for model, note in ((workload, ""), ("resnet50", f"; {workload} not profiled, resnet50 used")):
        candidates = [p for p in mine if p.model == model]
        if candidates:
            chosen = _pick(candidates, precision)
            return SpeedPrior(
                chosen.samples_per_s, gpu, f"{gpu} {chosen.model} {chosen.precision}{note}"
            )
    chosen = _pick(mine, precision)
    return SpeedPrior(
        chosen.samples_per_s, gpu, f"{gpu} {chosen.model}; neither {workload} nor resnet50 profiled"
    )
