"""The job spec: what a user submits (workload, global batch, workers, policy, emulation).

The control plane stores it; agents and workers read it back from their assignment.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import Field, JsonValue, field_validator, model_validator

from contract.base import Id, Name, Request, Text
from contract.enums import PolicyName


class Slowdown(Request):
    """Multiply a worker's emulated compute time by ``factor`` on iterations [from, to)."""

    from_iteration: int = Field(ge=0, le=10**12)
    to_iteration: int = Field(ge=1, le=10**12)
    factor: float = Field(gt=0, le=1000, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Slowdown:
        if self.to_iteration <= self.from_iteration:
            raise ValueError("to_iteration must be greater than from_iteration")
        return self


class EmulatedWorker(Request):
    """Emulated speed: pad real compute to factor * (intercept + per_sample * b).

    Emulated memory: with ``memory_mb``, one forward/backward pass of ``b`` samples needs
    ``memory_base_mb + memory_per_sample_mb * b``; more than ``memory_mb`` raises a real
    ``torch.OutOfMemoryError`` (the exception CUDA raises)."""

    per_sample_ms: float = Field(ge=0, le=1e5, allow_inf_nan=False)
    intercept_ms: float = Field(default=0.0, ge=0, le=1e5, allow_inf_nan=False)
    slowdowns: list[Slowdown] = Field(default_factory=list, max_length=64)
    name: Name | None = None
    memory_mb: int | None = Field(default=None, ge=1, le=10_000_000)
    """The emulated device's memory; None: no memory limit is emulated."""
    memory_base_mb: float = Field(default=0.0, ge=0, le=10_000_000, allow_inf_nan=False)
    """Memory of a pass that does not depend on the batch (weights, optimizer state, ...)."""
    memory_per_sample_mb: float = Field(default=0.0, ge=0, le=10_000_000, allow_inf_nan=False)
    """Activation memory per sample of a pass."""

    def peak_memory_mb(self, batch_size: int) -> float:
        """Emulated peak memory of one pass of ``batch_size`` samples (0 samples: none)."""
        if batch_size <= 0:
            return 0.0
        return self.memory_base_mb + self.memory_per_sample_mb * batch_size

    @property
    def memory_cap(self) -> int | None:
        """The largest batch one pass fits in ``memory_mb`` (None when memory is not emulated)."""
        if self.memory_mb is None:
            return None
        room = self.memory_mb - self.memory_base_mb
        if room < 0:
            return 0
        if self.memory_per_sample_mb == 0:
            return 10_000_000
        return min(10_000_000, int(room // self.memory_per_sample_mb))


ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

MAX_ARGS_BYTES = 16_384
"""Largest ``workload.args`` as compact JSON: they travel in every worker's environment."""

MAX_ARGS_DEPTH = 8
"""Deepest nesting of one argument's value (lists and objects within each other)."""


def _depth(value: object) -> int:
    """How many lists and objects ``value`` nests (0 for a number or a string)."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


class WorkloadSpec(Request):
    """What to train: a built-in workload or a user entrypoint ``module:function``."""

    builtin: Literal["mlp", "cnn-digits"] | None = None
    entrypoint: Text | None = Field(default=None, max_length=255)
    context: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The SHA-256 of the code archive uploaded for the job (``evenflow jobs submit --context
    DIR``, ``POST /api/v1/contexts``): every host unpacks it into the job's directory and runs
    the ranks there, with it first on ``sys.path``."""
    learning_rate: float = Field(default=0.05, gt=0, le=10, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    args: dict[Text, JsonValue] = Field(default_factory=dict, max_length=64)
    """What the entrypoint reads as ``ctx.args``: any JSON (numbers, strings, lists, nested
    objects), at most ``MAX_ARGS_BYTES`` as JSON and ``MAX_ARGS_DEPTH`` levels deep."""

    @field_validator("args")
    @classmethod
    def _bounded_args(cls, args: dict[str, JsonValue]) -> dict[str, JsonValue]:
        for key, value in args.items():
            depth = _depth(value)
            if depth > MAX_ARGS_DEPTH:
                raise ValueError(
                    f"args.{key} nests {depth} levels deep; at most {MAX_ARGS_DEPTH} are allowed"
                )
        size = len(json.dumps(args, separators=(",", ":"), allow_nan=False))
        if size > MAX_ARGS_BYTES:
            biggest = max(args, key=lambda k: len(json.dumps(args[k])))
            raise ValueError(
                f"args take {size} bytes as JSON, at most {MAX_ARGS_BYTES}; the largest is "
                f"args.{biggest}: pass big inputs as files the entrypoint reads"
            )
        return args

    @model_validator(mode="after")
    def _one_of(self) -> WorkloadSpec:
        if (self.builtin is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of builtin or entrypoint")
        if self.entrypoint is not None and not ENTRYPOINT.match(self.entrypoint):
            raise ValueError("entrypoint must look like 'package.module:function'")
        if self.context is not None and self.entrypoint is None:
            raise ValueError("a context holds the code of an entrypoint: give one")
        return self


class OutputsSpec(Request):
    """Where the files a job writes under ``ctx.output_dir`` go (they become its artifacts)."""

    path: Text | None = Field(default=None, min_length=1, max_length=1024)
    """A directory or fsspec URL every host reaches (``/shared/out``, ``s3://bucket/out``): the
    job's outputs go under ``<path>/job-<id>/`` and are listed where they are. Default: each
    rank's own directory on its host's disk, whose files are uploaded to the control plane when
    the rank ends (at most ``EVENFLOW_ARTIFACT_MAX_BYTES`` a job) and listed with their hosts."""


class EnvironmentSpec(Request):
    """Where a job's ranks run on each host."""

    python: str | None = Field(default=None, min_length=2, max_length=1024, pattern=r"^/\S+$")
    """The interpreter of a prepared environment (a venv or conda env holding torch, the job's
    dependencies and Evenflow itself: ``/opt/envs/train/bin/python``), the same path on every
    host; default the agent's own. Checked on each host before the ranks start: it must import
    Evenflow's runtime and a torch that can run the job's backend."""


class PolicySpec(Request):
    name: PolicyName = Field(default=PolicyName.ADAPTIVE, strict=False)
    rebalance_every: int = Field(default=20, ge=1, le=1_000_000)
    """Re-plan cadence in iterations."""
    min_gain: float = Field(default=0.03, ge=0, le=1, allow_inf_nan=False)
    """Issue a new plan only if it predicts at least this fractional cut in iteration time."""
    explore_iterations: int = Field(default=10, ge=0, le=10_000)
    """Iterations at the start that perturb batch sizes so each worker's model is identifiable."""
    granularity: int = Field(default=1, ge=1, le=4096)
    memory_headroom: float = Field(default=0.1, ge=0, le=0.9, allow_inf_nan=False)
    """Fraction of each device's memory plans leave unused when they derive a worker's memory
    cap (the most samples one pass may hold) from its fitted memory model."""
    exclude: bool = True
    """Whether a straggler answer may take a rank out of the gradient all-reduce for a while
    (when that pays for its cost); false: it re-plans the batch shares instead. Training
    frameworks that count their own steps (``evenflow.integrations``) need false; a sharded
    (``fsdp``) job never excludes."""


class CheckpointSpec(Request):
    """Periodic checkpoints a failed job resumes from (``agent.runtime.checkpoint``)."""

    every_iterations: int = Field(default=100, ge=1, le=100_000_000)
    """Write one after every this many iterations (counted from 0 across epochs); a restart
    re-runs at most this many."""
    path: Text | None = Field(default=None, min_length=1, max_length=1024)
    """A directory or fsspec URL (``/shared/ckpt``, ``file:///...``, ``s3://bucket/x``); the job's
    checkpoints go under ``<path>/job-<id>/``. Default: the agent's job directory on rank 0's
    host, which a multi-host job resumes from only when rank 0 comes back to that host."""
    keep: int = Field(default=3, ge=1, le=1000)
    """How many of the newest checkpoints are kept (older ones are deleted)."""


class JobSpec(Request):
    name: Name
    workload: WorkloadSpec
    global_batch: int = Field(ge=1, le=10_000_000)
    iterations: int | None = Field(default=None, ge=1, le=100_000_000)
    epochs: int | None = Field(default=None, ge=1, le=100_000)
    workers: int | None = Field(default=None, ge=1, le=1024)
    max_workers: int | None = Field(default=None, ge=1, le=1024)
    """With ``workers``: take up to this many devices when they are free (``workers`` is then
    the minimum); placement picks the count that maximises predicted throughput."""
    devices: list[Id] | None = Field(default=None, min_length=1, max_length=1024)
    """Explicit device ids (from GET /hosts); instead of ``workers``."""
    policy: PolicySpec = Field(default_factory=PolicySpec)
    environment: EnvironmentSpec = Field(default_factory=EnvironmentSpec)
    outputs: OutputsSpec = Field(default_factory=OutputsSpec)
    emulation: list[EmulatedWorker] | None = Field(default=None, max_length=1024)
    """One entry per rank; labels the job as emulated everywhere it shows."""
    max_batch_per_worker: int | None = Field(default=None, ge=1, le=10_000_000)
    priority: int = Field(default=0, ge=-100, le=100)
    rendezvous_timeout_s: float = Field(default=120.0, gt=0, le=3600, allow_inf_nan=False)
    """How long the ranks may take to meet (reach rank 0's address and port, all join); past
    it the job fails with a reason naming the address and port that could not be reached."""
    collective_timeout_s: float = Field(default=600.0, ge=10, le=86_400, allow_inf_nan=False)
    """How long a rank waits in a collective (an all-reduce, a re-synchronisation) for the
    others before the job fails: long enough for a slow checkpoint write or a rank-0-only
    evaluation, short enough that a rank lost inside a collective ends the job."""
    checkpoint: CheckpointSpec | None = None
    engine: Literal["ddp", "fsdp"] = "ddp"
    """How the ranks hold the model: ``ddp``, a whole replica on every rank, gradients summed
    exactly over unequal shares; ``fsdp``, parameters, gradients and optimizer state sharded
    over the ranks (PyTorch's FSDP2), every rank running the same number of passes and none
    ever excluded."""
    gradient_sync: Literal["auto", "overlap", "coalesced"] = "auto"
    """How a ``ddp`` job sums gradients: ``overlap``, PyTorch's DistributedDataParallel with an
    exact weighting hook (bucketed all-reduces during backward); ``coalesced``, one all-reduce
    after backward (faster for small models and on CPUs); ``auto``, overlap on GPUs and
    coalesced on CPUs."""
    max_restarts: int = Field(default=3, ge=0, le=1000)
    """How many times the control plane restarts the job after a rank, its agent or its host
    fails (from the last checkpoint, or from iteration 0 without one) before it fails it."""

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.iterations is None) == (self.epochs is None):
            raise ValueError("give exactly one of iterations or epochs")
        if (self.workers is None) == (self.devices is None):
            raise ValueError("give exactly one of workers or devices")
        if self.devices is not None and len(set(self.devices)) != len(self.devices):
            raise ValueError("devices lists a device twice")
        if self.max_workers is not None:
            if self.workers is None or self.max_workers < self.workers:
                raise ValueError("max_workers needs workers (the minimum) and must be at least it")
            if self.emulation is not None and self.max_workers != self.workers:
                raise ValueError(
                    "an emulated job has one emulation entry per rank: give no max_workers"
                )
        n = self.world_size
        if self.emulation is not None and len(self.emulation) != n:
            raise ValueError(f"emulation has {len(self.emulation)} entries for {n} workers")
        if (
            self.max_batch_per_worker is not None
            and self.max_batch_per_worker * n < self.global_batch
        ):
            raise ValueError("global_batch exceeds workers * max_batch_per_worker")
        if self.global_batch % self.policy.granularity:
            raise ValueError("global_batch must be a multiple of policy.granularity")
        self._engine_fits()
        return self

    def _engine_fits(self) -> None:
        if self.engine != "fsdp":
            return
        if self.gradient_sync != "auto":
            raise ValueError("gradient_sync chooses how a ddp job sums gradients; fsdp has one way")
        if self.workload.builtin is not None:
            raise ValueError(
                f"engine fsdp shards a model's blocks; builtin {self.workload.builtin} has none "
                "(use an entrypoint whose model has layers, or engine ddp)"
            )

    @property
    def world_size(self) -> int:
        """The fewest ranks the job runs with (``workers``, or the explicit devices)."""
        return self.workers if self.workers is not None else len(self.devices or [])

    @property
    def max_world_size(self) -> int:
        """The most ranks placement may give the job (``max_workers`` when set)."""
        return self.max_workers or self.world_size
