"""A worker's environment comes from an allow-list: the agent's token and every variable its
operator marks secret never reach job code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.environment import (
    AGENT_SECRETS,
    device_variables,
    usable_cpus,
    worker_environment,
    worker_threads,
)

NAMES = st.one_of(
    st.sampled_from(
        [
            "PATH",
            "HOME",
            "LANG",
            "LC_ALL",
            "CUDA_VISIBLE_DEVICES",
            "NCCL_DEBUG",
            "OMP_NUM_THREADS",
            "TORCH_HOME",
            "PYTHONPATH",
            "AWS_SECRET_ACCESS_KEY",
            "EVENFLOW_DATABASE_URL",
            *AGENT_SECRETS,
        ]
    ),
    st.from_regex(r"[A-Z][A-Z0-9_]{0,20}", fullmatch=True),
)
SECRET = st.from_regex(r"s3cr3t-[a-z0-9]{8,16}", fullmatch=True)
PLAIN = st.from_regex(r"[a-z0-9/:._-]{0,24}", fullmatch=True)
JOB_VARS = {
    "EVENFLOW_TOKEN": "efw_rank-credential",
    "EVENFLOW_JOB_ID": "7",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


@given(
    plain=st.dictionaries(NAMES, PLAIN, max_size=12),
    secret=st.dictionaries(NAMES.filter(lambda n: n not in JOB_VARS), SECRET, max_size=6),
    agent_token=SECRET,
    embed=st.dictionaries(NAMES, PLAIN, max_size=3),
)
def test_no_secret_and_no_agent_token_ever_reaches_a_worker(
    plain: dict[str, str], secret: dict[str, str], agent_token: str, embed: dict[str, str]
) -> None:
    parent = {**plain, **secret, "EVENFLOW_TOKEN": agent_token}
    # allowed variables that carry a secret inside their value (a URL with a password, say)
    values = [*secret.values(), agent_token]
    for i, name in enumerate(sorted(embed)):
        parent.setdefault(name, f"{embed[name]}{values[i % len(values)]}/x")
    env = worker_environment(parent, JOB_VARS, secret_names=secret)
    hidden = [*secret.values(), agent_token]
    for name, value in env.items():
        assert not any(s in value for s in hidden), (name, value)
    assert not set(secret) & set(env)
    assert {k: env[k] for k in JOB_VARS} == JOB_VARS  # the rank's own credential and rendezvous


def test_what_training_needs_passes_and_nothing_else() -> None:
    parent = {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/src",
        "HOME": "/home/a",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "4",
        "EVENFLOW_TOKEN": "ef_agent-token-0123456789",
        "EVENFLOW_TOKEN_FILE": "/run/secrets/agent",
        "EVENFLOW_ADMIN_TOKEN": "ef_admin-token-0123456789",
        "EVENFLOW_DATABASE_URL": "postgresql://u:pw@db/x",
        "EVENFLOW_LOG_LEVEL": "DEBUG",
        "AWS_SECRET_ACCESS_KEY": "abc",
        "WANDB_API_KEY": "k",
        "NCCL_TOKEN_I_MARKED": "marked",
    }
    env = worker_environment(parent, JOB_VARS, secret_names=["NCCL_TOKEN_I_MARKED"])
    assert env == {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/src",
        "HOME": "/home/a",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "4",
        "EVENFLOW_LOG_LEVEL": "DEBUG",
        **JOB_VARS,
    }


@given(
    parent=st.lists(st.integers(0, 15).map(str), unique=True, max_size=8) | st.none(),
    index=st.integers(0, 7),
)
def test_a_cuda_rank_sees_only_its_own_gpu_and_a_cpu_rank_none(
    parent: list[str] | None, index: int
) -> None:
    """The device comes from the assignment: one GPU for a CUDA rank (the index-th the agent
    sees, through the agent's own CUDA_VISIBLE_DEVICES when set), none for a CPU rank."""
    agent_env = {} if parent is None else {"CUDA_VISIBLE_DEVICES": ",".join(parent)}
    cuda = device_variables("cuda", index, "nccl", agent_env)
    own = parent[index] if parent and index < len(parent) else str(index)
    assert cuda == {
        "EVENFLOW_BACKEND": "nccl",
        "EVENFLOW_DEVICE": "cuda:0",
        "CUDA_VISIBLE_DEVICES": own,
        "LOCAL_RANK": "0",
    }
    cpu = device_variables("cpu", index, "gloo", agent_env)
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["EVENFLOW_BACKEND"] == "gloo"
    assert cpu["EVENFLOW_DEVICE"] == "cpu"
    env = worker_environment(agent_env, {**JOB_VARS, **cpu})
    assert env["CUDA_VISIBLE_DEVICES"] == "", "the agent's own GPUs never leak to a CPU rank"


@pytest.mark.parametrize(
    ("devices", "cpus", "expected"), [(1, 16, "16"), (8, 16, "2"), (8, 4, "1"), (4, 2, "1")]
)
def test_a_rank_gets_the_hosts_cpus_shared_among_its_devices(
    devices: int, cpus: int, expected: str
) -> None:
    """One thread per rank starved a lone GPU rank's input path on a 16-CPU host; the host's CPUs
    are shared among the agent's devices instead, and the agent's own setting wins."""
    assert worker_threads(devices, {}, cpus) == expected
    assert worker_threads(devices, {"OMP_NUM_THREADS": "3"}, cpus) == "3"


@pytest.mark.parametrize(
    ("cpu_max", "limit"), [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000", 2)]
)
def test_a_cgroup_cpu_limit_caps_the_cpus_ranks_share(
    tmp_path: Path, cpu_max: str, limit: int | None
) -> None:
    """A container with a CPU limit sees every CPU of its node but gets its limit's worth: the
    ranks share that (rounded up), not the node's count. No cgroup file: no limit."""
    here = len(os.sched_getaffinity(0))
    f = tmp_path / "cpu.max"
    f.write_text(cpu_max)
    assert usable_cpus(f) == (here if limit is None else min(here, limit))
    assert usable_cpus(tmp_path / "absent") == here
