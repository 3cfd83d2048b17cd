"""A lean keep-alive HTTP/1.1 client for the fleet bench's simulated agents.

The fleet generator (``bench/fleet.py``) shares the 2-core machine with the server it
measures, and every figure it reports includes its own event loop's delays. Through aiohttp a
request cost the generator about 0.3 ms of CPU (its request context, tracing signals, header
multidicts, URL objects, payload registry): py-spy of a 500-host run put 55% of the
generator's CPU in ``ClientSession._request`` and below, and at 1,250 hosts the generator's
loop ran 325 ms late at p50. A real fleet's agents run on hosts of their own, so that CPU is
pure artefact, taken from the server.

This client does what the fleet needs and no more: requests whose head is mostly built once
(per token), written on a kept-alive connection taken from a bounded pool, the answer parsed
by ``httptools`` (the parser uvicorn serves with: content length and chunked bodies alike),
one request per connection at a time. A connection the server closed is never reused; a
request that fails on one is an error of the kind its exception names, as with aiohttp. Each
answer's ``Server-Timing`` (``app;dur=ms``, ``server.metrics.MetricsMiddleware``) is kept with
it (``request_timed``): how much of a request's latency the app itself spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlencode, urlsplit

import httptools

IDLE_CLOSE_S = 20.0
"""A connection idle this long is closed rather than reused (the server closes its side after
30 s, ``serve.py``'s ``timeout_keep_alive``: reusing it then would race that close)."""


class ConnectionClosed(ConnectionError):
    """The server closed the connection before its answer was complete."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.app_s: float | None = None
        """The app's time on the answer being read, from its ``Server-Timing`` header."""
        self.reusable = True
        self.idle_since = time.monotonic()
        self.served = 0
        """Requests sent on it so far."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(exc or ConnectionClosed("the server closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"server-timing" and b"dur=" in value:
            with contextlib.suppress(ValueError):
                self.app_s = float(value.split(b"dur=", 1)[1].split(b";", 1)[0]) / 1000

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if not self.parser.should_keep_alive():
            self.reusable = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), b"".join(self.body)))
        self.body = []

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    async def send(self, request: bytes) -> tuple[int, bytes]:
        assert self.transport is not None and self.waiter is None
        self.app_s = None
        self.served += 1
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class Timed(NamedTuple):
    """An answer (``LeanClient.request_timed``)."""

    status: int
    body: bytes
    app_s: float | None
    """The app's own time on it, from its ``Server-Timing`` (None where it had none)."""
    connect_s: float | None
    """How long opening its connection took, where the request opened the one it went on
    (its latency has it); None where it went on one already open."""


class LeanClient:
    """Requests to one server (``base``: ``http://host:port``) over at most ``limit``
    connections. ``on_queued(kind, seconds)`` hears of each request that found every
    connection taken and how long it waited for one (time inside its latency that the server
    never saw)."""

    def __init__(
        self,
        base: str,
        limit: int,
        timeout_s: float = 60.0,
        on_queued: Callable[[str, float], None] | None = None,
    ) -> None:
        url = urlsplit(base)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self._host_line = f"Host: {url.netloc}\r\n".encode()
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(limit)
        self._idle: deque[_Connection] = deque()
        self._open: set[_Connection] = set()
        self._on_queued = on_queued
        self._heads: dict[tuple[str, str | None], bytes] = {}

    def _head(self, method: str, token: str | None) -> bytes:
        """The request's head after its request line, less its length: built once per token."""
        key = (method, token)
        head = self._heads.get(key)
        if head is None:
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            kind = "Content-Type: application/json\r\n" if method != "GET" else ""
            head = self._heads[key] = self._host_line + (auth + kind).encode()
        return head

    async def request(
        self,
        method: str,
        path: str,
        token: str | None = None,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
        kind: str = "other",
    ) -> tuple[int, bytes]:
        """The answer's status and body. Raises ``OSError`` (refused, reset, closed) or
        ``TimeoutError`` for a request that got no whole answer."""
        timed = await self.request_timed(method, path, token, body, params, kind)
        return timed.status, timed.body

    async def request_timed(
        self,
        method: str,
        path: str,
        token: str | None = None,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
        kind: str = "other",
    ) -> Timed:
        """As ``request``, with the app's own time on it and what opening its connection took."""
        if params:
            path = f"{path}?{urlencode(params)}"
        length = b"" if body is None else b"Content-Length: %d\r\n" % len(body)
        request = b"".join(
            (f"{method} {path} HTTP/1.1\r\n".encode(), self._head(method, token), length, b"\r\n")
        )
        if body:
            request += body
        if self._slots.locked() and self._on_queued is not None:
            t0 = time.perf_counter()
            await self._slots.acquire()
            self._on_queued(kind, time.perf_counter() - t0)
        else:
            await self._slots.acquire()
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                t0 = time.perf_counter()
                conn, opened = await self._take()
                connect_s = time.perf_counter() - t0 if opened else None
                status, answer = await conn.send(request)
                return Timed(status, answer, conn.app_s, connect_s)
        finally:
            if conn is not None:
                self._give_back(conn)
            self._slots.release()

    async def open(self, n: int, at_once: int = 64) -> None:
        """Open ``n`` connections ahead (``at_once`` at a time) and keep them idle for the
        requests to come, as a fleet's agents each hold one kept alive (each heartbeats every
        2 s). Opened as a burst needed them instead, the first request on each waited seconds
        at a loaded server: every one of 161 heartbeats that waited over 3 s outside the app
        in a 1,250-host run did."""
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(at_once)

        async def one() -> None:
            async with gate:
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
            self._open.add(conn)
            conn.idle_since = time.monotonic()
            self._idle.append(conn)

        await asyncio.gather(*(one() for _ in range(n)))

    async def _take(self) -> tuple[_Connection, bool]:
        """An idle connection, or one opened now (then True)."""
        now = time.monotonic()
        while self._idle:
            # The least recently used: every open connection stays in use, as each agent's own
            # does. Taking the most recent one left the rest idle until they aged out, so a
            # burst of requests at once opened hundreds anew, and the first request on a new
            # connection waited seconds for the server at 1,250 hosts (bench/fleet.py).
            conn = self._idle.popleft()
            if conn.reusable and now - conn.idle_since < IDLE_CLOSE_S:
                return conn, False
            self._drop(conn)
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        self._open.add(conn)
        return conn, True

    def _give_back(self, conn: _Connection) -> None:
        if conn.reusable and conn.waiter is None:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:  # failed, timed out mid-answer, or the server said it closes
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)

    @property
    def connections(self) -> int:
        """Connections open now (idle or busy)."""
        return len(self._open)

    async def close(self) -> None:
        for conn in list(self._open):
            self._drop(conn)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks
