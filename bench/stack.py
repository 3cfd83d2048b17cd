"""`evenflow server` in a subprocess, for benchmarks that measure it over real HTTP."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from evenflow.local_cluster import server_process

TOKEN = "ef_bench-admin-token-0123456789"


def job_spec(size: int, **more: object) -> dict[str, object]:
    """A long-running job of ``size`` workers of the built-in MLP, 64 samples each."""
    return {
        "name": f"bench-{size}",
        "workload": {"builtin": "mlp"},
        "global_batch": 64 * size,
        "iterations": 10**6,
        "workers": size,
        **more,
    }


@contextmanager
def server(
    db_url: str, extra_env: Mapping[str, str] | None = None, args: Sequence[str] = ()
) -> Iterator[str]:
    """A control plane on a free port (hosts never marked lost); yields its base URL."""
    env = {
        **os.environ,
        "EVENFLOW_DATABASE_URL": db_url,
        "EVENFLOW_ADMIN_TOKEN": TOKEN,
        "EVENFLOW_HOST_LOST_AFTER_S": "86400",
        **(extra_env or {}),
    }
    with server_process(env, args) as (base, _):
        yield base
