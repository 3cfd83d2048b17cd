"""The environment a worker process gets: an allow-list, never the agent's own.

Job code runs in the worker, so whatever is in its environment the job can read. The agent
therefore builds it from scratch: from its own environment only what training needs (the names
and prefixes below), then the job's variables that the agent sets itself (the rendezvous, the
``EVENFLOW_*`` job variables, the rank's own credential as ``EVENFLOW_TOKEN``). Never passed on:
the agent's credential (``EVENFLOW_TOKEN``, ``EVENFLOW_TOKEN_FILE``), any other server secret,
and every variable the agent's operator marks secret (``evenflow agent --secret-env NAME``);
nor any allowed variable whose value carries one of those secrets.

A rank's device comes from its assignment (:func:`device_variables`): a CUDA rank sees only its
own GPU (``CUDA_VISIBLE_DEVICES``, so it trains on ``cuda:0``), a CPU rank sees none (even on a
CUDA host) and trains with gloo.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

PASSED_NAMES = frozenset(
    {
        "PATH",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "HF_HOME",
        "XDG_CACHE_HOME",
        # the worker's own optional tuning (agent.runtime.worker)
        "EVENFLOW_LOG_LEVEL",
        "EVENFLOW_PLAN_POLL_S",
        "EVENFLOW_PLAN_WAIT_S",
        "EVENFLOW_TELEMETRY_S",
    }
)
"""Variables of the agent's environment a worker gets as they are."""

PASSED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "OMP_", "MKL_", "GLOO_", "TORCH_", "NVIDIA_")
"""Prefixes of such variables: locale, and what CUDA, NCCL, OpenMP, MKL, gloo and torch read."""

AGENT_SECRETS = frozenset(
    {"EVENFLOW_TOKEN", "EVENFLOW_TOKEN_FILE", "EVENFLOW_ADMIN_TOKEN", "EVENFLOW_AGENT_TOKENS"}
)
"""The agent's (and the server's) credentials: never taken from the agent's environment."""

MIN_SECRET_LEN = 8
"""A secret value at least this long is also looked for inside other passed values."""


def device_variables(
    kind: str, index: int, backend: str, parent_env: Mapping[str, str]
) -> dict[str, str]:
    """The variables that pin a rank to the device it was placed on: ``EVENFLOW_BACKEND``,
    ``EVENFLOW_DEVICE``, ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK``.

    ``index`` is the device's index as the agent's torch numbers it, i.e. within the agent's own
    ``CUDA_VISIBLE_DEVICES`` when the operator set one; the worker is given that physical entry.
    """
    if kind == "cuda":
        parent = parent_env.get("CUDA_VISIBLE_DEVICES", "")
        visible = [v.strip() for v in parent.split(",") if v.strip()]
        own = visible[index] if index < len(visible) else str(index)
        return {
            "EVENFLOW_BACKEND": backend,
            "EVENFLOW_DEVICE": "cuda:0",
            "CUDA_VISIBLE_DEVICES": own,
            "LOCAL_RANK": "0",
        }
    return {
        "EVENFLOW_BACKEND": backend,
        "EVENFLOW_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",  # a CPU rank on a CUDA host must not touch a GPU
        "LOCAL_RANK": str(index),
    }


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU limit of this process's group: ``QUOTA PERIOD`` (microseconds), or ``max``."""


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may use: those it may run on, fewer when its cgroup caps its CPU
    time (a container with a CPU limit sees all of the node's CPUs but gets its limit's worth)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 file (or an unreadable one): no limit known
    return cpus


def worker_threads(devices: int, agent_env: Mapping[str, str], cpus: int | None = None) -> str:
    """``OMP_NUM_THREADS`` for each rank: the agent's own when set, else the CPUs this agent may
    use (:func:`usable_cpus`) shared among its devices, at least 1. One thread each starved a GPU
    rank's input path: on an H100 host with 16 CPUs, gathering a 1,024-image batch took 443 ms
    of a 913 ms iteration."""
    if agent_env.get("OMP_NUM_THREADS"):
        return agent_env["OMP_NUM_THREADS"]
    if cpus is None:
        cpus = usable_cpus()
    return str(max(1, cpus // max(1, devices)))


def is_passed(name: str) -> bool:
    """Whether a variable of the agent's environment may reach a worker (secrets aside)."""
    return name in PASSED_NAMES or name.startswith(PASSED_PREFIXES)


def worker_environment(
    parent_env: Mapping[str, str],
    job_vars: Mapping[str, str],
    secret_names: Iterable[str] = (),
) -> dict[str, str]:
    """A worker's environment: the allowed part of ``parent_env`` (the agent's), then
    ``job_vars`` (set by the agent for this rank; they win). Variables named in
    ``secret_names`` or ``AGENT_SECRETS`` are never taken from ``parent_env``; a name in
    ``secret_names`` is not taken from ``job_vars`` either (except the rank's own
    ``EVENFLOW_TOKEN``), and no variable of ``parent_env``
    whose value contains a secret's value is passed."""
    marked = frozenset(secret_names)
    hidden = marked | AGENT_SECRETS
    secrets = [v for k, v in parent_env.items() if k in hidden and v]

    def leaks(value: str) -> bool:
        return any(s == value or (len(s) >= MIN_SECRET_LEN and s in value) for s in secrets)

    env = {k: v for k, v in parent_env.items() if is_passed(k) and k not in hidden and not leaks(v)}
    env.update({k: v for k, v in job_vars.items() if k not in marked - AGENT_SECRETS})
    return env
