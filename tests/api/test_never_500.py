"""Never a 500: text no database can store, bodies that are not UTF-8 JSON, and database
connections killed under the server. Each answers a 4xx in the ErrorOut shape (or just works),
and nothing stored is lost. On SQLite and PostgreSQL."""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import json
import pkgutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from sqlalchemy import create_engine, text

import server.api.routes as routes_package
from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from server.api.bodies import JSONRoute
from server.app import create_app
from tests.harness import (
    ADMIN_TOKEN,
    PG_ADMIN_URL,
    Api,
    make_settings,
    register_host,
    serving,
)

SURROGATE = "\ud800"


def _bodies(api: Api) -> dict[str, dict[str, Any]]:
    """A valid body for each write route, with a string in every place a client may put one."""
    api.register("h", devices=1)
    job = api.submit(workers=1, global_batch=8)["id"]
    return {
        "/api/v1/jobs": {
            "name": "j",
            "workload": {"builtin": "mlp", "args": {"note": "text", "depth": 2}},
            "global_batch": 8,
            "iterations": 1,
            "workers": 1,
        },
        "/api/v1/tokens": {"name": "t", "role": "viewer"},
        "/api/v1/hosts/register": {
            "protocol_version": PROTOCOL_VERSION,
            "name": "host-z",
            "address": "10.0.0.9",
            "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1}],
        },
        f"/api/v1/jobs/{job}/overrides": {"kind": "freeze", "reason": "why"},
        f"/api/v1/jobs/{job}/telemetry": {"records": []},
    }


def _with_surrogates(node: Any) -> Iterator[Any]:
    """Copies of ``node`` with one string (a value or a key) given a lone surrogate."""
    if isinstance(node, str):
        yield node + SURROGATE
    elif isinstance(node, dict):
        for key, value in node.items():
            yield {(k + SURROGATE if k == key else k): v for k, v in node.items()}
            for changed in _with_surrogates(value):
                yield {**node, key: changed}
    elif isinstance(node, list):
        for i, value in enumerate(node):
            for changed in _with_surrogates(value):
                yield [*node[:i], changed, *node[i + 1 :]]


def _stored(api: Api) -> tuple[int, int, int]:
    h = api.headers()
    return (
        api.client.get("/api/v1/jobs", headers=h).json()["total"],
        len(api.client.get("/api/v1/tokens", headers=h).json()["items"]),
        len(api.client.get("/api/v1/hosts", headers=h).json()["items"]),
    )


def test_a_lone_surrogate_in_any_string_is_a_422_naming_the_body(api: Api) -> None:
    headers = {**api.headers(), "Content-Type": "application/json"}
    api.register("host-a", devices=1)
    bodies = _bodies(api)
    before = _stored(api)
    probes = 0
    for path, body in bodies.items():
        for bad in _with_surrogates(body):
            raw = json.dumps(bad)  # ASCII: the surrogate travels as the escape \ud800
            assert "\\ud800" in raw
            r = api.client.post(path, content=raw, headers=headers)
            assert r.status_code == 422, (path, raw, r.text)
            out = r.json()
            assert out["field"] == "body" and "lone surrogate" in out["detail"], out
            probes += 1
    assert probes >= 20
    assert _stored(api) == before


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe{}", b'{"name": "caf\xe9"}', b"not json", b'{"name": ', b"\xef\xbb\xbf{}"],
    ids=["utf16-bom", "latin-1", "text", "truncated", "utf8-bom"],
)
def test_a_body_that_is_not_utf8_json_is_a_422_in_the_error_shape(api: Api, raw: bytes) -> None:
    headers = {**api.headers(), "Content-Type": "application/json"}
    bodies = _bodies(api)
    before = _stored(api)
    for path in bodies:
        r = api.client.post(path, content=raw, headers=headers)
        assert r.status_code == 422, (path, r.text)
        out = r.json()
        assert out["field"] == "body", out
        assert out["detail"].startswith("body:") and "JSON" in out["detail"], out
        assert set(out) <= {"detail", "field", "errors"}
    after = _stored(api)
    assert after == before  # nothing stored


def test_every_router_parses_bodies_strictly() -> None:
    """Every router's routes use ``JSONRoute`` (the one JSON parser that refuses what no
    database can store), so a new router cannot forget it."""
    modules = [
        importlib.import_module(f"server.api.routes.{m.name}")
        for m in pkgutil.iter_modules(routes_package.__path__)
    ]
    routers = [m.router for m in modules if hasattr(m, "router")]
    assert len(routers) >= 10
    for router in routers:
        assert router.route_class is JSONRoute, router
        assert all(isinstance(r, JSONRoute) for r in router.routes if isinstance(r, APIRoute))


# --------------------------------------------------------------------------- killed connections


def _kill_connections(url: str) -> int:
    """``pg_terminate_backend`` every connection to the database of ``url`` (the server's
    pooled ones, its LISTEN connection, the controller's lock)."""
    dbname = url.rsplit("/", 1)[1]
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            return int(
                c.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :d AND pid <> pg_backend_pid()"
                    ),
                    {"d": dbname},
                ).scalar_one()
            )
    finally:
        admin.dispose()


@pytest.mark.postgres
def test_pooled_connections_killed_under_the_server_are_replaced(pg_url: str) -> None:
    app = create_app(make_settings(pg_url, db_pool_size=4))
    spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 8, "iterations": 1}
    spec["workers"] = 1
    paths = ["/api/v1/jobs", "/api/v1/health", "/api/v1/hosts", "/api/v1/tokens"]
    with serving(app) as url:
        register_host(url, ADMIN_TOKEN)  # jobs are refused where no device could hold them

        def call(i: int) -> int:
            with httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
            ) as c:
                if i % 5 == 0:
                    return c.post("/api/v1/jobs", json={**spec, "name": f"j{i}"}).status_code
                return c.get(paths[i % len(paths)]).status_code

        def burst() -> list[int]:
            with cf.ThreadPoolExecutor(8) as pool:
                return list(pool.map(call, range(24)))

        first = burst()  # fills the pool
        assert all(code < 300 for code in first), first
        for _ in range(2):
            assert _kill_connections(pg_url) >= 1
            codes = burst()
            assert all(code < 300 for code in codes), codes
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
            assert c.get("/api/v1/jobs").json()["total"] == 15  # every accepted job is there
            viewer = c.post("/api/v1/tokens", json={"name": "v", "role": Role.VIEWER.value})
            assert viewer.status_code == 201
