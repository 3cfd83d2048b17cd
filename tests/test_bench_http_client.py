"""The fleet bench's lean HTTP client (``bench/http_client.py``) against a real uvicorn server
and against a raw socket server that misbehaves on purpose: bodies both ways, chunked answers,
kept-alive connections, the server closing, the connection cap and timeouts, and the app's own
time from its Server-Timing header."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from bench.http_client import LeanClient
from evenflow.local_cluster import free_port


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        body = await request.body()
        auth = request.headers.get("authorization", "")
        return Response(
            body,
            status_code=201,
            headers={"x-auth": auth, "x-type": request.headers.get("content-type", "")},
        )

    @app.get("/query")
    async def query(request: Request) -> dict[str, str]:
        return dict(request.query_params)

    @app.get("/chunked")
    async def chunked() -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(5):
                yield f"part{i};".encode()

        return StreamingResponse(parts())

    @app.get("/unchanged")
    async def unchanged() -> Response:
        return Response(status_code=304)

    @app.get("/slow")
    async def slow() -> dict[str, int]:
        await asyncio.sleep(0.3)
        return {"ok": 1}

    @app.get("/timed")
    async def timed() -> Response:
        return Response(b"t", headers={"Server-Timing": "app;dur=250.500"})

    return app


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_bodies_headers_and_query_round_trip(server_url: str) -> None:
    async def go() -> None:
        client = LeanClient(server_url, limit=4)
        try:
            body = b'{"x": "' + b"y" * 100_000 + b'"}'
            status, raw = await client.request("POST", "/echo", "tok-1", body)
            assert (status, raw) == (201, body)
            status, raw = await client.request("GET", "/query", params={"a": "1", "b": "x y"})
            assert (status, raw) == (200, b'{"a":"1","b":"x y"}')
            status, raw = await client.request("GET", "/chunked")
            assert (status, raw) == (200, b"part0;part1;part2;part3;part4;")
            assert await client.request("GET", "/unchanged") == (304, b"")
            # one request at a time: all of them went over the one kept-alive connection
            assert client.connections == 1
        finally:
            await client.close()

    asyncio.run(go())


def test_the_apps_own_time_comes_with_the_answer_when_it_sends_one(server_url: str) -> None:
    async def go() -> None:
        client = LeanClient(server_url, limit=1)
        try:
            first = await client.request_timed("GET", "/timed")
            assert first[:3] == (200, b"t", 0.2505)
            assert first.connect_s is not None and first.connect_s >= 0  # it opened one
            # the next answer on the same connection carries none: none, not the last one's
            assert await client.request_timed("GET", "/unchanged") == (304, b"", None, None)
        finally:
            await client.close()

    asyncio.run(go())


def test_the_connection_cap_queues_requests_and_says_how_long(server_url: str) -> None:
    waits: list[tuple[str, float]] = []

    async def go() -> None:
        client = LeanClient(server_url, limit=2, on_queued=lambda k, s: waits.append((k, s)))
        try:
            answers = await asyncio.gather(
                *(client.request("GET", "/slow", kind="poll") for _ in range(4))
            )
            assert [s for s, _ in answers] == [200] * 4
            assert client.connections == 2
        finally:
            await client.close()

    asyncio.run(go())
    assert len(waits) == 2 and {k for k, _ in waits} == {"poll"}
    assert all(s >= 0.2 for _, s in waits), waits


def test_a_request_past_its_timeout_raises_and_its_connection_is_not_reused(
    server_url: str,
) -> None:
    async def go() -> None:
        client = LeanClient(server_url, limit=4, timeout_s=0.05)
        try:
            with pytest.raises(TimeoutError):
                await client.request("GET", "/slow")
            assert client.connections == 0  # an answer may still come on it: closed
            client.timeout_s = 5.0
            assert (await client.request("GET", "/slow"))[0] == 200
        finally:
            await client.close()

    asyncio.run(go())


@contextlib.asynccontextmanager
async def _raw_server(answer: bytes, close_after: bool) -> AsyncIterator[tuple[str, list[int]]]:
    """Answers every request with ``answer``; ``close_after``: then closes the connection.
    Yields its URL and the number of requests each connection carried."""
    per_connection: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        per_connection.append(0)
        me = len(per_connection) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                per_connection[me] += 1
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", per_connection
    finally:
        server.close()
        await server.wait_closed()


def test_a_connection_the_server_closes_is_not_reused() -> None:
    async def go() -> list[int]:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        async with _raw_server(answer, close_after=True) as (url, per_connection):
            client = LeanClient(url, limit=1)
            for _ in range(3):
                assert await client.request("POST", "/x", "t", b"{}") == (200, b"ok")
            await client.close()
            return per_connection

    assert asyncio.run(go()) == [1, 1, 1]


def test_an_answer_cut_short_is_an_error_not_an_answer() -> None:
    async def go() -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"
        async with _raw_server(answer, close_after=True) as (url, _):
            client = LeanClient(url, limit=1)
            with pytest.raises(ConnectionError):
                await client.request("GET", "/x")
            assert client.connections == 0
            await client.close()

    asyncio.run(go())


def test_kept_alive_connections_carry_many_requests() -> None:
    async def go() -> list[int]:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        async with _raw_server(answer, close_after=False) as (url, per_connection):
            client = LeanClient(url, limit=2)
            for _ in range(5):
                assert await client.request("GET", "/x") == (200, b"ok")
            await client.close()
            return per_connection

    assert asyncio.run(go()) == [5]


def test_connections_opened_ahead_carry_a_burst_and_none_is_opened_for_it() -> None:
    """A fleet's agents each hold a connection: the generator opens one per host ahead, and a
    burst of requests then goes on those, none on a connection opened for it (the first request
    on such a one waited seconds at a loaded server)."""

    async def go() -> tuple[list[float | None], list[int], int]:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        async with _raw_server(answer, close_after=False) as (url, per_connection):
            client = LeanClient(url, limit=10)
            await client.open(4, at_once=2)
            opened = client.connections
            timed = await asyncio.gather(*(client.request_timed("GET", "/x") for _ in range(4)))
            burst = [t.connect_s for t in timed]
            more = await asyncio.gather(*(client.request_timed("GET", "/x") for _ in range(5)))
            burst.append(next(t.connect_s for t in more if t.connect_s is not None))
            await client.close()
            return burst, sorted(per_connection), opened

    connects, per_connection, opened = asyncio.run(go())
    assert opened == 4
    assert connects[:4] == [None] * 4, "the burst went on the connections opened ahead"
    assert connects[4] is not None and connects[4] >= 0, "a fifth at once needs a new one"
    assert per_connection == [1, 2, 2, 2, 2]
