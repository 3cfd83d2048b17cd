"""The relay's spool on its own: records read back in order after a crash, segments deleted once
their items have left, torn tails cut off and counted, a bound that refuses rather than
drops, and a write the disk refuses leaving nothing behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agent.spool import HEADER, Spool, SpoolFull

TELEMETRY = (7, "telemetry")
METRICS = (7, "metrics")


def _count(_key: tuple[int, str], payload: bytes) -> int | None:
    """Payloads of these tests: ``b"n:<items>:..."``."""
    parts = payload.split(b":")
    return int(parts[1]) if parts[0] == b"n" else None


def _payload(items: int, tag: str) -> bytes:
    return f"n:{items}:{tag}".encode()


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_records_are_read_back_in_order_by_a_new_spool(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=60)
    for i in range(5):
        spool.append(TELEMETRY, _payload(2, f"t{i}"), 2)
    spool.append(METRICS, _payload(1, "m0"), 1)
    # no close(): the process died
    again = Spool(tmp_path, segment_bytes=60)
    records = again.recover(_count)
    assert records == [(METRICS, _payload(1, "m0"))] + [
        (TELEMETRY, _payload(2, f"t{i}")) for i in range(5)
    ]
    assert again.used_bytes == spool.used_bytes and again.torn == 0
    assert sorted(again.streams()) == [METRICS, TELEMETRY]


def test_segments_go_once_their_items_have_left(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=36)  # two records (18 bytes each) a segment
    for i in range(6):
        spool.append(TELEMETRY, _payload(3, f"r{i}"), 3)
    assert len(_segments(tmp_path)) == 3
    spool.consumed(TELEMETRY, 5)  # the first segment (6 items) is not yet all gone
    assert len(_segments(tmp_path)) == 3
    spool.consumed(TELEMETRY, 1)
    assert len(_segments(tmp_path)) == 2
    spool.consumed(TELEMETRY, 12)
    assert _segments(tmp_path) == [] and spool.used_bytes == 0
    spool.append(TELEMETRY, _payload(1, "next"), 1)  # a new segment, numbered on
    assert _segments(tmp_path) == ["7.telemetry.000000000003.spool"]
    assert Spool(tmp_path).recover(_count) == [(TELEMETRY, _payload(1, "next"))]


def test_a_recovered_stream_is_consumed_and_appended_to_like_any(tmp_path: Path) -> None:
    Spool(tmp_path).append(TELEMETRY, _payload(4, "old"), 4)
    spool = Spool(tmp_path)
    assert len(spool.recover(_count)) == 1
    spool.append(TELEMETRY, _payload(1, "new"), 1)  # never into the old agent's segment
    assert len(_segments(tmp_path)) == 2
    spool.consumed(TELEMETRY, 4)
    assert _segments(tmp_path) == ["7.telemetry.000000000001.spool"]
    assert spool.drop(TELEMETRY) == 1 and _segments(tmp_path) == [] and spool.used_bytes == 0


@pytest.mark.parametrize(
    "tail",
    [
        b"EF",  # a short header
        HEADER.pack(b"EFS1", 100, 0) + b"n:3:only-part",  # a short payload
        HEADER.pack(b"EFS1", 6, 12345) + b"n:3:xx",  # a checksum that does not match
        b"\x00" * 64,  # zeros (a file extended, its data never written)
    ],
)
def test_a_torn_tail_is_cut_off_and_counted(tmp_path: Path, tail: bytes) -> None:
    spool = Spool(tmp_path)
    spool.append(TELEMETRY, _payload(2, "a"), 2)
    spool.append(TELEMETRY, _payload(2, "b"), 2)
    (path,) = tmp_path.iterdir()
    whole = path.stat().st_size
    with path.open("ab") as f:
        f.write(tail)
    again = Spool(tmp_path)
    assert again.recover(_count) == [(TELEMETRY, _payload(2, "a")), (TELEMETRY, _payload(2, "b"))]
    assert (again.torn, again.torn_bytes) == (1, len(tail))
    assert path.stat().st_size == whole  # truncated: the next agent finds it whole


def test_a_record_that_cannot_be_read_is_dropped_and_counted(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.append(TELEMETRY, b"not a batch", 1)
    (path,) = tmp_path.iterdir()
    again = Spool(tmp_path)
    assert again.recover(_count) == [] and again.unreadable == 1
    assert not path.exists()  # nothing left in it to send
    assert not (tmp_path / "stray.txt").exists()


def test_the_bound_refuses_appends_and_frees_as_items_leave(tmp_path: Path) -> None:
    record = HEADER.size + len(_payload(1, "x"))
    spool = Spool(tmp_path, max_bytes=3 * record)
    for _ in range(3):
        spool.append(TELEMETRY, _payload(1, "x"), 1)
    with pytest.raises(SpoolFull, match="bound"):
        spool.append(TELEMETRY, _payload(1, "x"), 1)
    spool.consumed(TELEMETRY, 3)
    spool.append(TELEMETRY, _payload(1, "x"), 1)
    assert spool.used_bytes == record


def test_a_write_the_disk_refuses_leaves_no_half_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path)
    spool.append(TELEMETRY, _payload(1, "kept"), 1)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdatasync", full)
    with pytest.raises(OSError, match="No space"):
        spool.append(TELEMETRY, _payload(5, "refused"), 5)
    monkeypatch.undo()
    again = Spool(tmp_path)
    assert again.recover(_count) == [(TELEMETRY, _payload(1, "kept"))] and again.torn == 0
