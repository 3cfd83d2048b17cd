"""The gate before the body (``server.api.gate``): cross-site writes refused, credentials
checked from the headers before a byte of the body is read, bad credentials throttled per
address, and bodies over the limit refused as they stream in."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import assume, given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from contract.enums import Role
from server.api.gate import cross_origin
from server.app import MAX_BODY_BYTES, create_app
from server.throttle import FailureLimit
from tests.harness import ADMIN_TOKEN, SAME_ORIGIN, Api, make_settings

FOREIGN = {"Origin": "http://testserver:8888"}  # a notebook on another port of the same host
SPEC = {
    "name": "j",
    "workload": {"builtin": "mlp"},
    "global_batch": 8,
    "iterations": 1,
    "workers": 1,
}


def _app(tmp_path: Path, **settings: Any) -> FastAPI:
    return create_app(make_settings(f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}", **settings))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(_app(tmp_path)) as c:
        yield c


def _status(api: Api, job_id: object) -> str:
    r = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers())
    return str(r.json()["status"])


# --------------------------------------------------------------------------- cross-site writes


def test_a_cookie_write_from_another_port_of_the_same_host_is_refused(sqlite_api: Api) -> None:
    api = sqlite_api
    api.register("h", devices=1)
    job = api.submit(workers=1, global_batch=8)["id"]
    api.client.cookies.set("evenflow_session", api.token(Role.OPERATOR))
    placed = _status(api, job)
    try:
        for headers in (
            FOREIGN,
            {"Referer": "http://testserver:8888/tree"},
            {"Origin": "null"},
            {"Origin": "https://testserver"},  # another scheme is another origin
            {},  # neither Origin nor Referer: refused for a cookie
        ):
            r = api.client.post(f"/api/v1/jobs/{job}/cancel", headers=headers)
            assert r.status_code == 403, headers
            assert r.json()["detail"].startswith("cross-origin request refused"), r.json()
            assert _status(api, job) == placed  # not cancelled
        ok = api.client.post(f"/api/v1/jobs/{job}/cancel", headers=SAME_ORIGIN)
        assert ok.status_code == 200 and ok.json()["status"] == "cancelled"
    finally:
        api.client.cookies.clear()


def test_a_same_origin_referer_stands_in_for_a_missing_origin(sqlite_api: Api) -> None:
    api = sqlite_api
    api.register("h", devices=1)
    job = api.submit(workers=1, global_batch=8)["id"]
    api.client.cookies.set("evenflow_session", api.token(Role.OPERATOR))
    try:
        r = api.client.post(
            f"/api/v1/jobs/{job}/cancel", headers={"Referer": f"http://testserver/jobs/{job}"}
        )
        assert r.status_code == 200
    finally:
        api.client.cookies.clear()


def test_bearer_clients_are_not_checked_for_origin(sqlite_api: Api) -> None:
    api = sqlite_api
    api.register("h", devices=1)
    job = api.submit(workers=1, global_batch=8)["id"]
    # Even with a (stale) session cookie beside it: a cross-site page cannot set the header.
    api.client.cookies.set("evenflow_session", "ef_stale-cookie")
    try:
        r = api.client.post(f"/api/v1/jobs/{job}/cancel", headers={**api.headers(), **FOREIGN})
        assert r.status_code == 200
    finally:
        api.client.cookies.clear()


def test_login_and_logout_need_this_servers_origin(sqlite_api: Api) -> None:
    client = sqlite_api.client
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    viewer = sqlite_api.token(Role.VIEWER)
    for headers in (FOREIGN, {}):
        r = client.post(
            "/login", content=f"token={viewer}", headers={**form, **headers}, follow_redirects=False
        )
        assert r.status_code == 403 and "set-cookie" not in r.headers
        r = client.post("/logout", headers=headers, follow_redirects=False)
        assert r.status_code == 403 and "set-cookie" not in r.headers
    r = client.post(
        "/login",
        content=f"token={viewer}",
        headers={**form, **SAME_ORIGIN},
        follow_redirects=False,
    )
    assert r.status_code == 303 and "evenflow_session=" in r.headers["set-cookie"]


def test_allowed_origins_admit_a_reverse_proxys_public_origin(tmp_path: Path) -> None:
    app = _app(tmp_path, allowed_origins="https://evenflow.example.com, http://proxy:8080")
    with TestClient(app) as client:
        api = Api(client)
        api.register("h", devices=1)
        job = api.submit(workers=1, global_batch=8)["id"]
        client.cookies.set("evenflow_session", api.token(Role.OPERATOR))
        r = client.post(f"/api/v1/jobs/{job}/cancel", headers=FOREIGN)
        assert r.status_code == 403
        r = client.post(
            f"/api/v1/jobs/{job}/cancel", headers={"Origin": "https://evenflow.example.com:443"}
        )
        assert r.status_code == 200


def test_an_allowed_origin_must_be_an_origin() -> None:
    with pytest.raises(ValueError, match="not an origin"):
        make_settings("sqlite://", allowed_origins="evenflow.example.com")
    with pytest.raises(ValueError, match="not an origin"):
        make_settings("sqlite://", allowed_origins="https://a.example/some/path")


_hosts = st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z]{2,6}){0,2}", fullmatch=True)
_ports = st.integers(1, 65535)


@given(host=_hosts, port=_ports, other=_ports, scheme=st.sampled_from(["http", "https"]))
def test_only_the_requests_own_scheme_host_and_port_pass(
    host: str, port: int, other: int, scheme: str
) -> None:
    assume(port != other)
    scope = {"scheme": scheme}

    def check(**headers: str) -> str | None:
        return cross_origin(scope, Headers({"host": f"{host}:{port}", **headers}), frozenset())

    own = f"{scheme}://{host.upper()}:{port}"
    assert check(origin=own) is None
    assert check(referer=own + "/jobs?x=1") is None
    if port == {"http": 80, "https": 443}[scheme]:
        assert check(origin=f"{scheme}://{host}") is None  # the default port left out
    assert check(origin=f"{scheme}://{host}:{other}") is not None
    assert check(referer=f"{scheme}://{host}:{other}/") is not None
    assert check(origin=f"{scheme}://{host}.evil.example:{port}") is not None


# --------------------------------------------------------------------------- before the body


@dataclass
class Answer:
    status: int
    body: bytes
    receives: int
    """How many times the app called ``receive()``: 0 means it never read the body."""


def _call(app: FastAPI, path: str, headers: dict[str, str], chunks: int, size: int) -> Answer:
    """One POST straight through the ASGI interface, its body offered as ``chunks`` chunks of
    ``size`` bytes (chunked: no Content-Length), counting what the app reads."""

    async def run() -> Answer:
        receives, sent = 0, []

        async def receive() -> dict[str, Any]:
            nonlocal receives
            receives += 1
            more = receives < chunks
            return {"type": "http.request", "body": b"x" * size, "more_body": more}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        async with app.router.lifespan_context(app):
            await app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return Answer(start["status"], body, receives)

    return asyncio.run(run())


@pytest.mark.parametrize(
    "path", ["/api/v1/jobs", "/api/v1/jobs/1/telemetry", "/api/v1/tokens", "/api/v1/nowhere"]
)
@pytest.mark.parametrize("token", [None, "ef_not-a-real-token"])
def test_a_caller_without_a_valid_token_is_refused_before_the_body_is_read(
    tmp_path: Path, path: str, token: str | None
) -> None:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    answer = _call(_app(tmp_path), path, headers, chunks=8, size=1024 * 1024)
    assert answer.status == 401, answer.body
    assert answer.receives == 0


def test_a_chunked_body_over_the_limit_is_refused_before_it_is_all_read(tmp_path: Path) -> None:
    chunk = 1024 * 1024
    headers = {"content-type": "application/json", "authorization": f"Bearer {ADMIN_TOKEN}"}
    for path in ("/api/v1/jobs", "/api/v1/jobs/1/telemetry", "/api/v1/hosts/1/heartbeat"):
        answer = _call(_app(tmp_path), path, headers, chunks=64, size=chunk)
        assert answer.status == 413, answer.body
        assert b"request body over 8388608 bytes" in answer.body
        assert answer.receives <= MAX_BODY_BYTES // chunk + 1  # stopped at the limit, not 64


def test_chunked_bodies_over_the_limit_get_413_in_the_error_shape(client: TestClient) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}

    def chunks() -> Iterator[bytes]:
        for _ in range(9):
            yield b" " * (1024 * 1024)

    paths = (
        "/api/v1/jobs",
        "/api/v1/jobs/1/telemetry",
        "/api/v1/tokens",
        "/api/v1/hosts/1/heartbeat",
    )
    for path in paths:
        r = client.post(path, content=chunks(), headers=headers)
        assert r.status_code == 413, (path, r.text)
        assert r.json() == {"detail": f"request body over {MAX_BODY_BYTES} bytes"}
    r = client.post("/login", content=b"token=" + b"a" * 5000, headers={**SAME_ORIGIN, **headers})
    assert r.status_code == 413 and r.json()["detail"] == "request body over 4096 bytes"


# --------------------------------------------------------------------------- bad credentials


def test_bad_tokens_are_throttled_per_address_but_valid_ones_still_work(tmp_path: Path) -> None:
    with TestClient(_app(tmp_path, auth_failures_max=3, auth_failures_window_s=600)) as client:
        api = Api(client)
        viewer = api.token(Role.VIEWER)
        api.register("h", devices=1)
        for _ in range(5):  # no token at all is not a bad token
            assert client.get("/api/v1/jobs").status_code == 401
        for i in range(3):
            r = client.get("/api/v1/jobs", headers=api.headers(f"ef_guess-{i}"))
            assert r.status_code == 401 and r.json()["detail"] == "unknown token"
        r = client.post("/api/v1/jobs", json=SPEC, headers=api.headers("ef_guess-3"))
        assert r.status_code == 429
        assert "at most 3 in 600 s" in r.json()["detail"]
        assert 0 < int(r.headers["Retry-After"]) <= 600
        # The same address with a valid token is not locked out.
        assert client.get("/api/v1/jobs", headers=api.headers(viewer)).status_code == 200
        assert client.post("/api/v1/jobs", json=SPEC, headers=api.headers()).status_code == 201
        assert client.get("/api/v1/jobs", headers=api.headers("ef_x")).status_code == 429
        # The dashboard's sign-in counts against the same limit, and still admits a good token.
        form = {"Content-Type": "application/x-www-form-urlencoded", **SAME_ORIGIN}
        r = client.post("/login", content="token=ef_guess-4", headers=form)
        assert r.status_code == 429 and "too many bad credentials" in r.text
        assert int(r.headers["Retry-After"]) > 0 and "set-cookie" not in r.headers
        r = client.post("/login", content=f"token={viewer}", headers=form, follow_redirects=False)
        assert r.status_code == 303 and "evenflow_session=" in r.headers["set-cookie"]


@given(
    cap=st.integers(1, 8),
    addresses=st.lists(st.sampled_from(["10.0.0.1", "10.0.0.2", "::1"]), max_size=40),
)
def test_each_address_has_its_own_budget_of_failures(cap: int, addresses: list[str]) -> None:
    limit = FailureLimit(cap, 3600)
    seen: Counter[str] = Counter()
    for address in addresses:
        seen[address] += 1
        retry_after = limit.fail(address)
        if seen[address] <= cap:
            assert retry_after is None
        else:
            assert retry_after is not None and 0 < retry_after <= 3600


# --------------------------------------------------------------------------- telemetry posts


def _columns(ranks: list[int], iteration: int = 1, **extra: Any) -> dict[str, Any]:
    n = len(ranks)
    return {
        "columns": {
            "rank": ranks,
            "iteration": [iteration] * n,
            "plan_version": [1] * n,
            "batch_size": [16] * n,
            "data_ms": [1.0] * n,
            "compute_ms": [10.0] * n,
            "sync_ms": [2.0] * n,
            "ts": [1_700_000_000.0] * n,
            **extra,
        }
    }


def test_a_telemetry_post_has_one_entry_point_which_stores_it_or_answers_its_bad_body(
    sqlite_api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw route (``server.api.raw``) answers every telemetry post: a well-formed one
    stored, a body that does not parse answered 422 in the app's words and never stored."""
    from server.api.routes import telemetry as route

    api = sqlite_api
    host = api.register("h", devices=2)
    job = api.submit(workers=2, global_batch=32)["id"]
    routed: list[int] = []
    through = route.store

    async def counted(context: Any, job_id: int, batch: Any, principal: Any) -> Any:
        routed.append(job_id)
        return await through(context, job_id, batch, principal)

    monkeypatch.setattr(route, "store", counted)
    agent = api.headers(str(host["_token"]))
    url = f"/api/v1/jobs/{job}/telemetry"
    r = api.client.post(url, json=_columns([0, 1]), headers=agent)
    assert r.status_code == 200, r.text
    assert r.json() == {"accepted": 2, "duplicates": 0}
    assert r.headers["content-type"] == "application/json"
    assert r.headers["server-timing"].startswith("app;dur=")
    assert routed == [job]  # stored by the route
    rows = api.client.get(f"{url}?limit=10", headers=api.headers()).json()
    assert rows["total"] == 2
    # A body that does not parse: the app's 422, naming the field.
    r = api.client.post(url, json=_columns([0, 1], batch_size=[16]), headers=agent)
    assert r.status_code == 422
    assert r.json()["field"] == "columns"
    assert "columns.batch_size has 1 values" in r.json()["detail"]
    r = api.client.post(url, content=b"{not json", headers=agent)
    assert r.status_code == 422 and r.json()["field"] == "body"
    assert routed == [job]
    metrics = api.client.get("/metrics").text
    route_name = 'route="/api/v1/jobs/{job_id}/telemetry"'
    assert f'evenflow_http_requests_total{{method="POST",{route_name},status="200"}} 1.0' in metrics
    assert f'evenflow_http_requests_total{{method="POST",{route_name},status="422"}} 2.0' in metrics
    assert "evenflow_telemetry_records_total 2.0" in metrics


def test_a_telemetry_post_is_refused_as_any_request_is(sqlite_api: Api) -> None:
    api = sqlite_api
    host = api.register("h", devices=2)
    other = api.register("other", devices=2)
    job = api.submit(workers=2, global_batch=32)["id"]
    agent, stranger = api.headers(str(host["_token"])), api.headers(str(other["_token"]))
    viewer = api.headers(api.token(Role.VIEWER))
    url = f"/api/v1/jobs/{job}/telemetry"
    cases: list[tuple[str, dict[str, str], dict[str, Any], int, str | None, str]] = [
        (url, api.headers(), _columns([2]), 422, "columns.rank.0", "columns.rank[0] is 2; job"),
        (url, agent, _columns([2]), 403, None, "rank 2 of job"),
        (url, stranger, _columns([0]), 403, None, "rank 0 of job"),
        (url, viewer, _columns([0]), 403, None, "this needs the admin role"),
        ("/api/v1/jobs/999/telemetry", api.headers(), _columns([0]), 404, None, "job 999"),
        (f"/api/v1/jobs/{2**31}/telemetry", agent, _columns([0]), 422, "job_id", ""),
    ]
    for path, headers, body, status, field, words in cases:
        r = api.client.post(path, json=body, headers=headers)
        assert r.status_code == status, (path, r.text)
        assert r.json().get("field") == field, r.text
        assert words in r.json()["detail"], r.text
    assert api.client.get(f"{url}?limit=10", headers=api.headers()).json()["total"] == 0
    ended = api.client.post(f"/api/v1/jobs/{job}/cancel", headers=api.headers())
    assert ended.status_code == 200, ended.text
    r = api.client.post(url, json=_columns([0]), headers=agent)
    assert r.status_code == 409 and r.json()["field"] == "status", r.text
