"""Plan-change notifications: waking long-polls here, and telling the other server processes.

A plan is committed by the controller (``server.controller``, usually a process of its own), by
an operator's override or by a job start (any API process). Whoever commits it calls
:meth:`PlanBus.publish` from the session's ``after_commit`` hook (``server.scale.cache.Caches``), and
every other process on the same database reads the job ids from its own socket, clears its
plan cache entries and wakes its long-polls (``GET /jobs/{id}/plan?known_version=&wait_s=``).

The bus is a directory of Unix datagram sockets, one per listening process, named by a hash of
the database (``$TMPDIR/evenflow-<uid>-<hash>/``); a publisher sends one datagram of comma
separated job ids to each. That needs no broker and works on SQLite and PostgreSQL alike, for
processes on one machine (the API workers and the controller ``evenflow server`` starts).
Delivery is best effort, but a loss is not silent: a publisher that could not send to a
listener (its queue full; on PostgreSQL, the publishing connection down) sends it
:data:`LOST` first when it next can, and a listener that lost its ``LISTEN`` knows it did; either
way the listener's ``on_lost`` treats everything as changed (every cached answer dropped, every
long-poll woken to re-read). So what a cache keeps from the buses' ids need not expire for fear
of a lost notification (``server.scale.host_answers``); a long-poll still re-reads every ``RECHECK_S``.

On PostgreSQL the same ids travel by ``LISTEN``/``NOTIFY`` instead (:class:`PgNotifyBus`), so
any number of ``evenflow server`` instances on different machines share one database: a plan
committed by any of them wakes long-polls held by any other. :func:`open_bus` picks the bus for
a database URL; both kinds publish, listen and close alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import psycopg
from sqlalchemy import make_url

from server.locks import sqlite_file

log = logging.getLogger("evenflow.notify")

RECHECK_S = 1.0
"""A waiting long-poll re-reads the current plan this often even without a notification."""

_names = itertools.count()

LOST = "*"
"""The payload a publisher sends before its next ids when it failed to send some to a listener:
"you may have missed notifications". A listener's ``on_lost`` runs on it (``subscribe``)."""

LOST_RETRY_S = 1.0
"""How often a PostgreSQL bus that failed to send tries again to send :data:`LOST`, with
nothing else to send (its database may be back)."""

PLACEMENT = 0
"""The id a poke on the wake bus carries when it asks the controller for placement only (a job
was submitted, devices were added or freed): no job has id 0."""


class PlanWaiters:
    """Long-polls waiting for a job's next plan, on one event loop; :meth:`notify` from any
    thread. One event per job, replaced when it fires, so waking 256 pollers is one call."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[int, asyncio.Event] = {}
        self.closed = False
        """The server is stopping: long-polls answer now rather than wait (``close``)."""

    def close(self) -> None:
        """Wake every long-poll to answer at once (304), from any thread: a server stopping
        with long-polls held otherwise waits out its graceful-shutdown timeout and then
        cancels them with an error and a traceback per request."""
        self.closed = True
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(lambda: self._fire(list(self._events)))

    def event(self, job_id: int) -> asyncio.Event:
        """The event the job's next plan sets; take it *before* reading the current plan."""
        self._loop = asyncio.get_running_loop()
        ev = self._events.get(job_id)
        if ev is None:
            ev = self._events[job_id] = asyncio.Event()
        return ev

    def _fire(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            ev = self._events.pop(job_id, None)
            if ev is not None:
                ev.set()

    def notify_all(self) -> None:
        """Wake every long-poll to read its plan again (from any thread): notifications may
        have been lost (the plan bus's LISTEN connection was down)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(lambda: self._fire(list(self._events)))

    def notify(self, job_ids: Iterable[int]) -> None:
        loop, ids = self._loop, list(job_ids)
        if loop is None or not ids:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fire(ids)
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(self._fire, ids)


def bus_dir(database_url: str, channel: str = "") -> Path | None:
    """The bus directory of a database, or None for an in-memory SQLite database. ``channel``
    names another bus on the same database: ``"hosts"`` carries the ids of hosts whose heartbeat
    answer changed (``server.scale.host_answers``); ``"wake"`` carries job ids the other way, from the
    API processes to the controller (urgent telemetry: run a round now)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        db = sqlite_file(database_url)
        if db is None:
            return None
        key = f"sqlite:{db}"
    else:
        key = url.set(password=None).render_as_string(hide_password=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    suffix = f"-{channel}" if channel else ""
    return Path(tempfile.gettempdir()) / f"evenflow-{os.getuid()}-{digest}{suffix}"


class Received(NamedTuple):
    """What a listener read off its socket: the ids, and whether a publisher said it failed to
    send it some (:data:`LOST`)."""

    ids: set[int]
    lost: bool = False


class PlanBus:
    """Job ids of committed plans, from any process to every other listening one."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._sock: socket.socket | None = None
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._out: socket.socket | None = None
        self._owed: set[str] = set()
        """Listeners' sockets a datagram could not be sent to (a full queue): each is sent
        :data:`LOST` before the next one."""

    @classmethod
    def for_database(cls, database_url: str, channel: str = "") -> PlanBus:
        return cls(bus_dir(database_url, channel))

    def _ensure_dir(self) -> bool:
        if self.directory is None:
            return False
        with contextlib.suppress(FileExistsError):
            self.directory.mkdir(mode=0o700)
        st = os.lstat(self.directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("plan bus %s is not a private directory of ours: not used", self.directory)
            self.directory = None
            return False
        return True

    def listen(self) -> socket.socket | None:
        """This process's socket (non-blocking), bound in the bus directory; None without one."""
        for _ in range(3):  # another process may remove the directory as its last listener
            if self._sock is not None or not self._ensure_dir():
                return self._sock
            assert self.directory is not None
            path = self.directory / f"{os.getpid()}-{next(_names)}.sock"
            with contextlib.suppress(FileNotFoundError):  # left by a dead process with our pid
                path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            try:
                sock.bind(str(path))
            except FileNotFoundError:
                sock.close()
                continue
            self._sock, self._path = sock, path
            return sock
        return self._sock

    @staticmethod
    def read(sock: socket.socket) -> Received:
        """Every job id waiting on ``sock``, without blocking, and whether a publisher said
        it had failed to send some."""
        ids: set[int] = set()
        lost = False
        while True:
            try:
                data = sock.recv(65_536)
            except (BlockingIOError, InterruptedError):
                return Received(ids, lost)
            for part in data.split(b","):
                if part.isdigit():
                    ids.add(int(part))
                elif part == LOST.encode():
                    lost = True

    def publish(self, job_ids: Iterable[int]) -> None:
        """Send the ids to every other listener; never raises (best effort, see the module)."""
        ids = sorted(set(job_ids))
        if not ids or self.directory is None:
            return
        message = ",".join(map(str, ids)).encode()
        try:
            peers = [p for p in os.scandir(self.directory) if p.name.endswith(".sock")]
        except OSError:
            return
        with self._lock:
            if self._out is None:
                self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._out.setblocking(False)
            for peer in peers:
                if self._path is not None and peer.path == str(self._path):
                    continue
                try:
                    if peer.path in self._owed:
                        self._out.sendto(LOST.encode(), peer.path)
                        self._owed.discard(peer.path)
                    self._out.sendto(message, peer.path)
                except (ConnectionRefusedError, FileNotFoundError):  # its process is gone
                    self._owed.discard(peer.path)
                    with contextlib.suppress(OSError):
                        os.unlink(peer.path)
                except OSError:  # a full queue: told so with the next datagram it can take
                    self._owed.add(peer.path)
                    log.debug("plan bus: could not notify %s", peer.path, exc_info=True)

    def close(self) -> None:
        with self._lock:
            for s in (self._sock, self._out):
                if s is not None:
                    s.close()
            self._sock = self._out = None
            if self._path is not None:
                with contextlib.suppress(OSError):
                    self._path.unlink()
                self._path = None
                if self.directory is not None:  # the last listener leaves no directory behind
                    with contextlib.suppress(OSError):
                        self.directory.rmdir()


PlanListener = Callable[[set[int]], None]


PG_CHANNELS = {
    "": "evenflow_plans",
    "wake": "evenflow_wake",
    "hosts": "evenflow_hosts",
    "tokens": "evenflow_tokens",
}
"""The NOTIFY channel of each bus; NOTIFY is scoped to one database, so the names need no hash."""

PG_PAYLOAD_BYTES = 7_900
"""A NOTIFY payload must stay under 8,000 bytes: longer id lists go out as several."""


CLOSE_SEND_S = 5.0
"""How long closing a PostgreSQL bus waits for what was published to be sent."""


BUS_NAME = "evenflow-bus"
"""The ``application_name`` of a PostgreSQL bus's connections, unless the database URL names
one (``server.db.make_engine``)."""


class PgNotifyBus:
    """Job ids between processes on any machines sharing one PostgreSQL database.

    :meth:`publish` hands the ids to a thread of the bus, which sends ``pg_notify`` on a
    connection of its own (autocommit, opened on first use and again after it breaks), the ids
    of every commit that published while it sent the last ones together in the next: a commit
    never waits for a round trip of its own, nor for another commit's (sent in the committing
    thread, one after the other on the one connection, they took a twentieth of a 1,250-host
    fleet's API samples, inside the heartbeats' database slots). :meth:`subscribe` runs a thread
    that holds a ``LISTEN`` connection and hands each notification's ids to a callback,
    reconnecting when the connection is lost. Like :class:`PlanBus` it never raises into the
    committing code, and no loss is silent: ids it could not send (its connection down twice
    over) are followed by :data:`LOST` once it can send again (tried every ``LOST_RETRY_S``
    when nothing else comes), and a listener whose ``LISTEN`` broke runs ``on_lost`` when it
    is back.
    Like :class:`PlanBus`, its listeners are not sent what it published itself (PostgreSQL tells
    every listener, the sender's own connection included: a notification from this bus's
    publishing connection is skipped), since the publisher has acted on it already: a
    heartbeat's own commit, echoed back, dropped the answer that heartbeat had just kept
    (``server.scale.host_answers``)."""

    def __init__(self, conninfo: str, channel: str = "") -> None:
        self.conninfo = conninfo
        self.channel = PG_CHANNELS[channel]
        self._out: psycopg.Connection | None = None
        self._lock = threading.Lock()
        """Held while the publishing connection is used or replaced."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pending: set[int] = set()
        """Ids published and not sent yet."""
        self._wanted = threading.Condition()
        """Guards ``_pending`` and ``_sender``; notified when ids are published."""
        self._sender: threading.Thread | None = None
        self._closing = False
        self._idle = threading.Event()
        """Set while everything published has been sent (or failed to be)."""
        self._idle.set()
        self._own_pid: int | None = None
        """The server process id of this bus's publishing connection, while it has one."""
        self._lost = False
        """Ids published were not sent: :data:`LOST` goes out before the next."""

    @classmethod
    def for_database(cls, database_url: str, channel: str = "") -> PgNotifyBus:
        url = make_url(database_url).set(drivername="postgresql")
        if "application_name" not in url.query:  # an operator's own name stays
            url = url.update_query_dict({"application_name": BUS_NAME})
        return cls(url.render_as_string(hide_password=False), channel)

    def publish(self, job_ids: Iterable[int]) -> None:
        """Notify every other listener of the database, at once from the bus's thread; never
        raises, never waits for the database."""
        ids = set(job_ids)
        if not ids:
            return
        with self._wanted:
            if self._closing:
                return
            self._pending |= ids
            self._idle.clear()
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_loop, name=f"{self.channel}-notify", daemon=True
                )
                self._sender.start()
            self._wanted.notify()

    def _send_loop(self) -> None:
        """Send what was published, together, until :meth:`close` (and what it left)."""
        while True:
            with self._wanted:
                while not self._pending and not self._closing:
                    if self._lost:  # try again to say so, with nothing else to send
                        if not self._wanted.wait(LOST_RETRY_S):
                            break
                    else:
                        self._wanted.wait()
                if not self._pending and (self._closing or not self._lost):
                    return
                ids, self._pending = sorted(self._pending), set()
            try:
                self._send(ids)
            except Exception:  # a bug must not end this process's notifications for good
                self._lost = True
                log.exception("plan bus: sending on %s failed", self.channel)
            with self._wanted:
                if not self._pending:
                    self._idle.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was published has been sent; whether it has."""
        return self._idle.wait(timeout)

    def _send(self, ids: list[int]) -> None:
        """Send ``ids`` (:data:`LOST` first if an earlier send failed); on failure remember
        that it did."""
        with self._lock:
            for attempt in range(2):  # once more on a fresh connection if the pooled one broke
                try:
                    if self._out is None or self._out.closed:
                        self._out = psycopg.connect(self.conninfo, autocommit=True)
                        self._own_pid = self._out.info.backend_pid
                    payloads = [LOST] if self._lost else []
                    for payload in [*payloads, *_payloads(ids)]:
                        self._out.execute("SELECT pg_notify(%s, %s)", (self.channel, payload))
                        if payload == LOST:
                            self._lost = False
                    return
                except (psycopg.Error, OSError):
                    self._drop_out()
                    if attempt:  # said once, not at every retry while the database is away
                        level = logging.DEBUG if self._lost else logging.WARNING
                        log.log(level, "plan bus: NOTIFY on %s failed", self.channel, exc_info=True)
                        self._lost = True

    def subscribe(
        self,
        on_ids: Callable[[set[int]], None],
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """Call ``on_ids`` with each notification's job ids, from a thread, until :meth:`close`;
        ``on_lost`` whenever some may have been missed: each time the ``LISTEN`` starts
        (anything sent while it was down is lost), and when a publisher says it failed to send
        some (:data:`LOST`)."""
        thread = threading.Thread(
            target=self._listen,
            args=(on_ids, on_lost),
            name=f"{self.channel}-listen",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()

    def _listen(
        self, on_ids: Callable[[set[int]], None], on_lost: Callable[[], None] | None
    ) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {self.channel}")
                    if on_lost is not None:
                        on_lost()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=RECHECK_S / 2):
                            if note.pid == self._own_pid:
                                continue  # this bus published it: acted on already
                            if note.payload == LOST:
                                if on_lost is not None:
                                    on_lost()
                                continue
                            ids = {int(p) for p in note.payload.split(",") if p.isdigit()}
                            if ids:
                                on_ids(ids)
            except (psycopg.Error, OSError):
                log.warning("plan bus: LISTEN %s lost; reconnecting", self.channel, exc_info=True)
                self._stop.wait(RECHECK_S)
            except Exception:  # a callback's bug must not end notifications for good
                log.exception("plan bus: a listener of %s failed", self.channel)

    def _drop_out(self) -> None:
        self._own_pid = None
        if self._out is not None:
            with contextlib.suppress(Exception):
                self._out.close()
            self._out = None

    def close(self) -> None:
        """Send what was published, then stop the bus's threads and connections."""
        with self._wanted:
            self._closing = True
            sender, self._sender = self._sender, None
            self._wanted.notify()
        if sender is not None:
            sender.join(CLOSE_SEND_S)
        self._stop.set()
        for thread in self._threads:
            thread.join(RECHECK_S + 1)
        self._threads.clear()
        with self._lock:
            self._drop_out()


def _payloads(ids: list[int]) -> Iterable[str]:
    """Comma-separated ids, cut so that no payload passes :data:`PG_PAYLOAD_BYTES`."""
    chunk: list[str] = []
    size = 0
    for job_id in ids:
        part = str(job_id)
        if chunk and size + len(part) + 1 > PG_PAYLOAD_BYTES:
            yield ",".join(chunk)
            chunk, size = [], 0
        chunk.append(part)
        size += len(part) + 1
    if chunk:
        yield ",".join(chunk)


Bus = PlanBus | PgNotifyBus


def subscribe(
    bus: Bus, on_ids: Callable[[set[int]], None], on_lost: Callable[[], None] | None = None
) -> Callable[[], None]:
    """Call ``on_ids`` with the ids other processes publish on ``bus``: on this event loop from
    a Unix socket, or from the LISTEN thread on PostgreSQL; ``on_lost`` when some may have been
    missed (on PostgreSQL also each time it starts listening). Returns what stops the socket's
    reader (the bus's ``close`` stops the thread)."""
    if isinstance(bus, PgNotifyBus):
        bus.subscribe(on_ids, on_lost)
        return lambda: None
    sock = bus.listen()
    if sock is None:
        return lambda: None
    loop = asyncio.get_running_loop()

    def on_message() -> None:
        received = bus.read(sock)
        if received.lost and on_lost is not None:
            on_lost()
        if received.ids:
            on_ids(received.ids)

    fd = sock.fileno()  # (the socket may be closed by the time the reader is removed)
    loop.add_reader(fd, on_message)

    def stop() -> None:
        loop.remove_reader(fd)

    return stop


def open_bus(database_url: str, channel: str = "") -> Bus:
    """The notification bus of a database: LISTEN/NOTIFY on PostgreSQL, Unix sockets else."""
    if make_url(database_url).get_backend_name() == "postgresql":
        return PgNotifyBus.for_database(database_url, channel)
    return PlanBus.for_database(database_url, channel)
