"""Many concurrent requests on a small connection pool: none fails, none waits for ever.

A sync route's session is opened, used and closed in three worker-thread hops. Without a bound
on the requests doing database work, every worker thread could wait for a pool connection held
by requests that wait for a thread to give it back (bench/fleet.py found it at 1,250 hosts:
``QueuePool limit ... reached``). The database slots (``AppContext.db_slots``) keep the
requests holding connections fewer than the threads and the connections."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from contract.base import PROTOCOL_VERSION
from server.app import create_app
from server.context import context_of
from tests.harness import ADMIN_TOKEN, make_settings, serving

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def _flood(url: str, host_id: int, n: int) -> Counter[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60, limits=limits) as c:

        async def one(i: int) -> int:
            if i % 2:
                r = await c.post(f"/api/v1/hosts/{host_id}/heartbeat", json={"workers": []})
            else:
                r = await c.get("/api/v1/hosts")
            return r.status_code

        return Counter(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.mark.parametrize("pool_size", [1, 2])
def test_a_flood_on_a_tiny_pool_is_all_answered(db_url: str, pool_size: int) -> None:
    # 1 connection (+2 overflow) against anyio's 40 worker threads and 160 requests at once:
    # the old session dependency deadlocked here until the pool's 30 s timeout, then 500s.
    app = create_app(make_settings(db_url, db_pool_size=pool_size))
    assert context_of(app).db_slots.value == 3 * pool_size  # bounded by the pool
    with serving(app) as url:
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "name": "flood",
            "address": "127.0.0.1",
            "devices": [{"index": 0, "kind": "cpu", "model": "cpu", "memory_mb": 1024}],
        }
        reg = httpx.post(url + "/api/v1/hosts/register", json=body, headers=AUTH, timeout=30)
        assert reg.status_code == 201, reg.text
        statuses = asyncio.run(asyncio.wait_for(_flood(url, reg.json()["id"], 160), 25))
    assert statuses == Counter({200: 160})
