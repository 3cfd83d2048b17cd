"""The relay's spool: what workers handed to their agent, on the host's disk until the server
has it, so that an agent's crash (``kill -9``, an OOM kill, a reboot) loses nothing it
acknowledged.

One *stream* per job and kind (``telemetry``, ``metrics``), each a sequence of segment files
``<job>.<kind>.<seq>.spool`` under the spool directory (``workdir/spool/<host name>``). A
segment is a run of records, each one worker post as the relay took it::

    b"EFS1" | length: u32 big-endian | crc32(payload): u32 big-endian | payload (length bytes)

Appends go to a stream's newest segment, which is sealed (a new one begun) once it holds
``segment_bytes``. Items (rows, points) leave a stream from its front in the order they came
(:meth:`Spool.consumed`): a segment whose items have all left is deleted, so a stream's disk is
what the server has not yet taken, plus at most one segment.

Durability: :meth:`Spool.append` writes the record with one ``write`` and ``fdatasync`` before
it returns, and a new segment's directory entry is synced too, so a record whose append
returned survives a crash of the agent and of the host (the disk's own cache aside). The relay
acknowledges a worker's post only after that. A crash mid-append leaves a torn tail (a short
header or payload, or a checksum that does not match): :meth:`Spool.recover` drops it,
truncating the file there, and counts it (``torn``); it never raises for a bad file.

Bounded: appends past ``max_bytes`` for all streams together raise :class:`SpoolFull` (the
relay then answers 503 and the worker keeps its rows and retries); a write the disk refuses
(``ENOSPC``, ``EIO``) is undone (the file truncated back) and raises ``OSError``.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("evenflow.agent.spool")

MAGIC = b"EFS1"
HEADER = struct.Struct(">4sII")
MAX_RECORD_BYTES = 64 * 2**20
_NAME = re.compile(r"^(\d{1,18})\.([a-z]{1,16})\.(\d{1,12})\.spool$")

Key = tuple[int, str]
"""A stream: (job id, kind)."""


class SpoolFull(Exception):
    """Appending would take the spool past its bound."""


@dataclass
class _Segment:
    path: Path
    size: int
    items: int = 0
    """Items written to it that have not yet left (:meth:`Spool.consumed`)."""
    fd: int | None = None
    """Open for appending while it is its stream's newest."""


@dataclass
class _Stream:
    segments: deque[_Segment] = field(default_factory=deque)
    next_seq: int = 0


class Spool:
    """Append-only, checksummed, fsynced segment files per stream; see the module docstring.
    Thread-safe."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = 512 * 2**20,
        segment_bytes: int = 4 * 2**20,
        sync: bool = True,
    ) -> None:
        if max_bytes < 1 or segment_bytes < 1:
            raise ValueError("max_bytes and segment_bytes must be at least 1")
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.sync = sync
        """``fdatasync`` every append before it returns (off only to measure what it costs)."""
        self.torn = 0
        """Torn or corrupt tails dropped by :meth:`recover`."""
        self.torn_bytes = 0
        self.unreadable = 0
        """Whole records whose payload could not be read back (dropped)."""
        self._lock = threading.Lock()
        self._streams: dict[Key, _Stream] = {}
        self._bytes = 0
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def streams(self) -> list[Key]:
        with self._lock:
            return [key for key, s in self._streams.items() if s.segments]

    # ------------------------------------------------------------------ writing
    def append(self, key: Key, payload: bytes, items: int) -> None:
        """Write one record of ``items`` items, durably; raises :class:`SpoolFull` past the
        bound, ``OSError`` when the disk refuses (nothing of the record is left behind)."""
        record = HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload
        with self._lock:
            if self._bytes + len(record) > self.max_bytes:
                raise SpoolFull(
                    f"the spool holds {self._bytes} bytes; {len(record)} more would pass its "
                    f"bound of {self.max_bytes}"
                )
            stream = self._streams.setdefault(key, _Stream())
            segment = self._open_segment(key, stream)
            assert segment.fd is not None
            try:
                written = os.write(segment.fd, record)
                if written != len(record):
                    raise OSError(f"short write to {segment.path} ({written} of {len(record)})")
                if self.sync:
                    os.fdatasync(segment.fd)
            except OSError:
                self._undo(segment)
                raise
            segment.size += len(record)
            segment.items += items
            self._bytes += len(record)
            if segment.size >= self.segment_bytes:
                self._seal(segment)

    def _open_segment(self, key: Key, stream: _Stream) -> _Segment:
        """The stream's newest segment, open for appending (a new one when none is)."""
        if stream.segments and stream.segments[-1].fd is not None:
            return stream.segments[-1]
        path = self.directory / f"{key[0]}.{key[1]}.{stream.next_seq:012d}.spool"
        stream.next_seq += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        segment = _Segment(path, 0, fd=fd)
        stream.segments.append(segment)
        if self.sync:
            self._sync_directory()
        return segment

    def _undo(self, segment: _Segment) -> None:
        """Cut a failed append off its segment, so no half record stays behind."""
        try:
            assert segment.fd is not None
            os.ftruncate(segment.fd, segment.size)
        except OSError as exc:  # recover() drops the torn tail should the agent die now
            log.warning("cannot truncate %s after a failed write: %s", segment.path, exc)

    def _seal(self, segment: _Segment) -> None:
        if segment.fd is not None:
            os.close(segment.fd)
            segment.fd = None

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ leaving
    def consumed(self, key: Key, items: int) -> None:
        """``items`` items left the stream's front (the server took them, or they are dropped
        for good): segments with nothing left are deleted."""
        with self._lock:
            stream = self._streams.get(key)
            while stream and stream.segments and items > 0:
                segment = stream.segments[0]
                taken = min(items, segment.items)
                segment.items -= taken
                items -= taken
                if segment.items > 0:
                    break
                self._delete(stream.segments.popleft())
            if stream and stream.segments and stream.segments[0].items == 0:
                self._delete(stream.segments.popleft())  # an empty newest one: begun anew
            if items > 0:
                log.warning("stream %s: %d item(s) left that the spool did not hold", key, items)

    def drop(self, key: Key) -> int:
        """Delete the whole stream; the items it held."""
        with self._lock:
            stream = self._streams.pop(key, None)
            held = 0
            while stream and stream.segments:
                segment = stream.segments.popleft()
                held += segment.items
                self._delete(segment)
            return held

    def _delete(self, segment: _Segment) -> None:
        self._seal(segment)
        self._bytes -= segment.size
        try:
            segment.path.unlink(missing_ok=True)
        except OSError as exc:  # found again by recover(): resent, which the server dedupes
            log.warning("cannot delete spool segment %s: %s", segment.path, exc)

    def close(self) -> None:
        with self._lock:
            for stream in self._streams.values():
                for segment in stream.segments:
                    self._seal(segment)

    # ------------------------------------------------------------------ reading back
    def recover(self, count: Callable[[Key, bytes], int | None]) -> list[tuple[Key, bytes]]:
        """Every record an earlier agent left, stream by stream in the order written, taken
        on as this spool's (sealed segments). ``count`` tells a record's items from its
        payload, or ``None`` for one that cannot be read (dropped and counted, ``unreadable``).
        Torn tails are cut off; nothing here raises for a bad file."""
        found: dict[Key, list[tuple[int, Path]]] = {}
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match is not None:
                key = (int(match.group(1)), match.group(2))
                found.setdefault(key, []).append((int(match.group(3)), path))
        records: list[tuple[Key, bytes]] = []
        with self._lock:
            for key in sorted(found):
                stream = self._streams.setdefault(key, _Stream())
                for seq, path in sorted(found[key]):
                    stream.next_seq = max(stream.next_seq, seq + 1)
                    items = 0
                    for payload in self._read(path):
                        n = count(key, payload)
                        if n is None:
                            self.unreadable += 1
                            log.warning("spool segment %s: a record that is not %s", path, key[1])
                            continue
                        items += n
                        records.append((key, payload))
                    try:
                        size = path.stat().st_size
                        if items == 0:
                            path.unlink()
                            continue
                    except OSError as exc:
                        log.warning("spool segment %s: %s", path, exc)
                        continue
                    stream.segments.append(_Segment(path, size, items))
                    self._bytes += size
        return records

    def _read(self, path: Path) -> Iterator[bytes]:
        """The whole records of one segment; a torn or corrupt tail is truncated off."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            log.warning("cannot read spool segment %s (%s); skipped", path, exc)
            return
        at = 0
        while at < len(data):
            header = data[at : at + HEADER.size]
            ok = len(header) == HEADER.size
            if ok:
                magic, length, crc = HEADER.unpack(header)
                payload = data[at + HEADER.size : at + HEADER.size + length]
                ok = magic == MAGIC and len(payload) == length and zlib.crc32(payload) == crc
            if not ok:
                self._cut(path, at, len(data) - at)
                return
            yield payload
            at += HEADER.size + length

    def _cut(self, path: Path, at: int, dropped: int) -> None:
        self.torn += 1
        self.torn_bytes += dropped
        log.warning(
            "spool segment %s: dropped a torn or corrupt tail of %d byte(s) at offset %d",
            path,
            dropped,
            at,
        )
        try:
            os.truncate(path, at)
        except OSError as exc:
            log.warning("cannot truncate %s: %s", path, exc)
