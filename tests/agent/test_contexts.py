"""Contexts on an agent host: the cache downloads each hash once and verifies it, and unpacking
untrusted archives refuses every way out of the target, every special file and every bomb,
leaving nothing behind. Archives are built here with tarfile, zipfile and gzip; no network."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from agent.contexts import MARKER, ContextCache, ContextError, unpack_archive

LIMITS = {"max_unpacked_bytes": 512 * 2**20, "max_files": 100_000}


# --- building archives -------------------------------------------------------------------------


def tar_bytes(members: Iterable[tuple[tarfile.TarInfo, bytes | None]], *, gz: bool = True) -> bytes:
    """A tar (gzipped unless ``gz`` is False) of the given headers and file contents."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def reg(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def entry(name: str, type_: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.linkname = linkname
    info.mode = 0o755 if type_ == tarfile.DIRTYPE else 0o644
    return info, None


def zip_bytes(entries: Iterable[tuple[str | zipfile.ZipInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            archive.writestr(name, data)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def good_tar() -> bytes:
    return tar_bytes(
        [
            entry("./", tarfile.DIRTYPE),
            entry("./pkg", tarfile.DIRTYPE),
            reg("./pkg/__init__.py", b""),
            reg("./pkg/train.py", b"print('hello')\n"),
            reg("./run.sh", b"#!/bin/sh\necho hi\n", mode=0o4775),
            reg("./data/nested/deep.txt", b"deep"),  # its parents have no entries of their own
            entry("./train.py", tarfile.SYMTYPE, "pkg/train.py"),
            entry("./pkg/data", tarfile.SYMTYPE, "../data"),
        ]
    )


# --- the layout every test checks: a target, and a sibling that must stay empty -----------------


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """``jobs/`` with an empty ``sibling/``; targets go to ``jobs/job``."""
    (tmp_path / "jobs" / "sibling").mkdir(parents=True)
    return tmp_path / "jobs"


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def assert_nothing_outside(jobs: Path) -> None:
    """Nothing but the target (if any) appeared beside it, and the sibling is still empty."""
    assert {p.name for p in jobs.iterdir()} <= {"sibling", "job"}
    assert list((jobs / "sibling").iterdir()) == []


def assert_refused(archive: Path, jobs: Path, match: str, **limits: int) -> ContextError:
    target = jobs / "job"
    with pytest.raises(ContextError, match=match) as info:
        unpack_archive(archive, target, **{**LIMITS, **limits})
    assert not target.exists() and not target.is_symlink()
    assert_nothing_outside(jobs)
    assert "\n" not in str(info.value)
    return info.value


# --- good archives -----------------------------------------------------------------------------


def test_tar_gz_unpacks_with_contents_modes_and_internal_symlinks(
    tmp_path: Path, jobs: Path
) -> None:
    target = jobs / "job"
    unpack_archive(write(tmp_path, "c.tar.gz", good_tar()), target, **LIMITS)
    assert (target / "pkg" / "train.py").read_bytes() == b"print('hello')\n"
    assert (target / "data" / "nested" / "deep.txt").read_bytes() == b"deep"
    assert (target / "train.py").is_symlink()
    assert os.readlink(target / "train.py") == "pkg/train.py"
    assert (target / "train.py").read_bytes() == b"print('hello')\n"
    assert (target / "pkg" / "data" / "nested" / "deep.txt").read_bytes() == b"deep"
    # setuid and group write dropped, the owner's execute bit kept
    assert stat.S_IMODE((target / "run.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "pkg" / "train.py").stat().st_mode) == 0o644
    assert_nothing_outside(jobs)


def test_plain_tar_unpacks(tmp_path: Path, jobs: Path) -> None:
    data = tar_bytes([reg("a.py", b"x = 1\n", mode=0o600)], gz=False)
    unpack_archive(write(tmp_path, "c.tar", data), jobs / "job", **LIMITS)
    assert (jobs / "job" / "a.py").read_text() == "x = 1\n"
    assert stat.S_IMODE((jobs / "job" / "a.py").stat().st_mode) == 0o600


def test_zip_unpacks_with_contents_and_modes(tmp_path: Path, jobs: Path) -> None:
    script = zipfile.ZipInfo("bin/run.sh")
    script.external_attr = (stat.S_IFREG | 0o6777) << 16
    windows = zipfile.ZipInfo("windows.txt")
    windows.external_attr = 0x20  # made on Windows: only the MS-DOS "archive" bit, no unix mode
    data = zip_bytes(
        [
            ("pkg/", b""),
            ("pkg/__init__.py", b""),
            ("pkg/model.py", b"class Model: ...\n"),
            (script, b"#!/bin/sh\n"),
            (windows, b"no unix mode"),
        ]
    )
    target = jobs / "job"
    unpack_archive(write(tmp_path, "c.zip", data), target, **LIMITS)
    assert (target / "pkg" / "model.py").read_bytes() == b"class Model: ...\n"
    assert stat.S_IMODE((target / "bin" / "run.sh").stat().st_mode) == 0o755
    assert (target / "windows.txt").read_bytes() == b"no unix mode"
    assert stat.S_IMODE((target / "windows.txt").stat().st_mode) == 0o644
    assert_nothing_outside(jobs)


def test_empty_zip_and_existing_empty_target(tmp_path: Path, jobs: Path) -> None:
    (jobs / "job").mkdir()
    unpack_archive(write(tmp_path, "c.zip", zip_bytes([])), jobs / "job", **LIMITS)
    assert list((jobs / "job").iterdir()) == []


# --- unsafe archives ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([reg("/etc/evil", b"x")], "'/etc/evil' has an absolute path"),
        ([reg("ok.py", b"x"), reg("../evil", b"x")], r"'../evil' has a '\.\.' component"),
        ([reg("pkg/../../evil", b"x")], r"has a '\.\.' component"),
        (
            [entry("passwd", tarfile.SYMTYPE, "../../etc/passwd")],
            "symbolic link to '../../etc/passwd', outside the context",
        ),
        (
            [entry("up", tarfile.SYMTYPE, "..")],
            "symbolic link to '..', outside the context",
        ),
        (
            [entry("passwd", tarfile.SYMTYPE, "/etc/passwd")],
            r"symbolic link to an absolute path \('/etc/passwd'\)",
        ),
        (
            [reg("a.py", b"x"), entry("b.py", tarfile.LNKTYPE, "a.py")],
            "'b.py' is a hard link",
        ),
        ([entry("tty", tarfile.CHRTYPE)], "'tty' is a character device"),
        ([entry("disk", tarfile.BLKTYPE)], "'disk' is a block device"),
        ([entry("pipe", tarfile.FIFOTYPE)], "'pipe' is a FIFO"),
        ([reg(MARKER, b"f" * 64)], "reserved name"),
        ([reg("a.py", b"1"), reg("a.py", b"2")], "'a.py' appears twice"),
        ([reg("dir\\evil", b"x")], "backslash"),
    ],
)
def test_unsafe_tar_is_refused_and_leaves_nothing(
    tmp_path: Path,
    jobs: Path,
    members: list[tuple[tarfile.TarInfo, bytes | None]],
    match: str,
) -> None:
    assert_refused(write(tmp_path, "c.tar.gz", tar_bytes(members)), jobs, match)


def test_symlink_chain_out_of_the_target_is_refused(tmp_path: Path, jobs: Path) -> None:
    """Each link alone stays inside, but ``a/b -> ..`` through ``a -> .`` is the parent."""
    members = [entry("a", tarfile.SYMTYPE, "."), entry("a/b", tarfile.SYMTYPE, "..")]
    assert_refused(write(tmp_path, "c.tar", tar_bytes(members)), jobs, "outside the context")


def test_symlink_redirected_by_a_later_symlink_is_refused(tmp_path: Path, jobs: Path) -> None:
    """``x -> d/..`` is inside while ``d`` is absent; ``d -> .`` then points ``x`` outside."""
    members = [entry("x", tarfile.SYMTYPE, "d/.."), entry("d", tarfile.SYMTYPE, ".")]
    assert_refused(
        write(tmp_path, "c.tar", tar_bytes(members)), jobs, "outside the context through other"
    )


def test_file_through_a_symlink_in_the_archive_is_not_written_outside(
    tmp_path: Path, jobs: Path
) -> None:
    """A link then a file "inside" it: links are made last, so the file never goes through."""
    members = [entry("a", tarfile.SYMTYPE, "sub"), reg("a/x.py", b"x")]
    assert_refused(write(tmp_path, "c.tar", tar_bytes(members)), jobs, "'a' appears twice")


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([("ok.py", b"x"), ("../x", b"evil")], r"'../x' has a '\.\.' component"),
        ([("/abs.py", b"evil")], "'/abs.py' has an absolute path"),
    ],
)
def test_unsafe_zip_paths_are_refused(
    tmp_path: Path, jobs: Path, entries: list[tuple[str, bytes]], match: str
) -> None:
    assert_refused(write(tmp_path, "c.zip", zip_bytes(entries)), jobs, match)


def test_zip_symlink_is_refused(tmp_path: Path, jobs: Path) -> None:
    link = zipfile.ZipInfo("passwd")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    data = zip_bytes([("ok.py", b"x"), (link, b"/etc/passwd")])
    assert_refused(write(tmp_path, "c.zip", data), jobs, "'passwd' is a symbolic link in a zip")


def test_zip_special_file_is_refused(tmp_path: Path, jobs: Path) -> None:
    fifo = zipfile.ZipInfo("pipe")
    fifo.external_attr = (stat.S_IFIFO | 0o644) << 16
    assert_refused(write(tmp_path, "c.zip", zip_bytes([(fifo, b"")])), jobs, "special file")


def test_gzip_bomb_is_refused_on_bytes_written(tmp_path: Path, jobs: Path) -> None:
    data = tar_bytes([reg("ok.py", b"x"), reg("zeros.bin", bytes(2 * 2**20))])
    assert len(data) < 64 * 2**10  # a small archive...
    error = assert_refused(
        write(tmp_path, "c.tar.gz", data),
        jobs,
        r"context unpacks past 1 MiB \(the limit\) at entry 'zeros.bin': a compressed bomb\?",
        max_unpacked_bytes=2**20,
    )
    assert "1 MiB" in str(error)


def test_zip_bomb_is_refused(tmp_path: Path, jobs: Path) -> None:
    data = zip_bytes([("zeros.bin", bytes(2 * 2**20))])
    assert_refused(write(tmp_path, "c.zip", data), jobs, "past 1 MiB", max_unpacked_bytes=2**20)


def test_a_lying_size_header_does_not_help(tmp_path: Path, jobs: Path) -> None:
    """The sum of the header sizes is under the limit, the bytes are counted as written."""
    data = tar_bytes([reg(f"f{i}.bin", bytes(600 * 2**10)) for i in range(2)])
    assert_refused(write(tmp_path, "c.tgz", data), jobs, "past 1 MiB", max_unpacked_bytes=2**20)


def test_too_many_files_are_refused(tmp_path: Path, jobs: Path) -> None:
    data = tar_bytes([reg(f"f{i}.py", b"") for i in range(6)])
    assert_refused(write(tmp_path, "c.tgz", data), jobs, "more than 5 entries", max_files=5)
    data = zip_bytes([(f"f{i}.py", b"") for i in range(6)])
    assert_refused(write(tmp_path, "c.zip", data), jobs, "more than 5 entries", max_files=5)


def test_exactly_at_the_limits_is_fine(tmp_path: Path, jobs: Path) -> None:
    data = tar_bytes([reg(f"f{i}.bin", bytes(2**10)) for i in range(4)])
    unpack_archive(
        write(tmp_path, "c.tgz", data), jobs / "job", max_unpacked_bytes=4 * 2**10, max_files=4
    )
    assert len(list((jobs / "job").iterdir())) == 4


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"just some text, not an archive at all" * 20, "is not a tar, tar.gz or zip archive"),
        (b"", "is not a tar, tar.gz or zip archive"),
        (gzip.compress(b"not a tar inside"), "is gzip but not a readable tar.gz"),
        (b"PK\x03\x04" + b"\x00" * 100, "could not be unpacked"),
    ],
)
def test_not_an_archive_is_refused(tmp_path: Path, jobs: Path, data: bytes, match: str) -> None:
    assert_refused(write(tmp_path, "c.bin", data), jobs, match)


def test_truncated_tar_gz_is_refused_and_leaves_nothing(tmp_path: Path, jobs: Path) -> None:
    data = tar_bytes([reg("a.py", os.urandom(200_000))])
    assert_refused(write(tmp_path, "c.tgz", data[: len(data) // 2]), jobs, "could not be unpacked")


def test_non_empty_target_is_refused_and_kept(tmp_path: Path, jobs: Path) -> None:
    (jobs / "job").mkdir()
    (jobs / "job" / "mine.txt").write_text("keep me")
    with pytest.raises(ContextError, match="it is not empty"):
        unpack_archive(write(tmp_path, "c.tgz", good_tar()), jobs / "job", **LIMITS)
    assert (jobs / "job" / "mine.txt").read_text() == "keep me"


def test_target_that_is_a_symlink_or_a_file_is_refused(tmp_path: Path, jobs: Path) -> None:
    archive = write(tmp_path, "c.tgz", good_tar())
    (jobs / "job").symlink_to(jobs / "sibling")
    with pytest.raises(ContextError, match="it is not a directory"):
        unpack_archive(archive, jobs / "job", **LIMITS)
    (jobs / "job").unlink()
    (jobs / "job").write_text("a file")
    with pytest.raises(ContextError, match="it is not a directory"):
        unpack_archive(archive, jobs / "job", **LIMITS)
    assert (jobs / "job").read_text() == "a file"
    assert list((jobs / "sibling").iterdir()) == []


# --- the cache ---------------------------------------------------------------------------------


class FakeFetch:
    """Serves archives by hash in small chunks and counts calls; ``delay`` per chunk."""

    def __init__(self, archives: dict[str, bytes], delay: float = 0.0) -> None:
        self.archives = archives
        self.delay = delay
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, sha256: str) -> Iterator[bytes]:
        with self._lock:
            self.calls.append(sha256)
        data = self.archives[sha256]
        for start in range(0, len(data), 4096):
            if self.delay:
                time.sleep(self.delay)
            yield data[start : start + 4096]


def test_cache_downloads_once_for_two_calls(tmp_path: Path) -> None:
    data = good_tar()
    fetch = FakeFetch({sha(data): data})
    cache = ContextCache(tmp_path / "cache", fetch)
    first = cache.archive(sha(data))
    assert cache.archive(sha(data)) == first
    assert fetch.calls == [sha(data)]
    assert first == tmp_path / "cache" / f"{sha(data)}.archive"
    assert first.read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [first.name]


def test_cache_downloads_once_for_concurrent_threads(tmp_path: Path) -> None:
    data = good_tar() + bytes(64 * 2**10)  # tar ignores what follows its end
    fetch = FakeFetch({sha(data): data}, delay=0.002)
    cache = ContextCache(tmp_path / "cache", fetch)
    start = threading.Barrier(4)
    results: list[Path] = []

    def get() -> None:
        start.wait()
        results.append(cache.archive(sha(data)))

    threads = [threading.Thread(target=get) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fetch.calls == [sha(data)]
    assert len(results) == 4 and len(set(results)) == 1
    assert results[0].read_bytes() == data


def test_corrupt_download_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    data = good_tar()
    claimed = sha(b"something else")
    cache = ContextCache(tmp_path / "cache", FakeFetch({claimed: data}))
    with pytest.raises(ContextError, match=f"context {claimed} is corrupt") as info:
        cache.archive(claimed)
    assert f"its bytes hash to {sha(data)}" in str(info.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_fetch_raising_becomes_a_context_error(tmp_path: Path) -> None:
    def fetch(sha256: str) -> Iterator[bytes]:
        yield b"some bytes"
        raise ConnectionError("server went away\nmid-stream")

    digest = sha(b"whatever")
    cache = ContextCache(tmp_path / "cache", fetch)
    with pytest.raises(ContextError) as info:
        cache.archive(digest)
    assert str(info.value) == (
        f"context {digest} could not be fetched: ConnectionError: server went away mid-stream"
    )
    assert isinstance(info.value.__cause__, ConnectionError)
    assert list((tmp_path / "cache").iterdir()) == []


def test_fetch_raising_at_once_becomes_a_context_error(tmp_path: Path) -> None:
    def fetch(sha256: str) -> Iterable[bytes]:
        raise KeyError(sha256)

    cache = ContextCache(tmp_path / "cache", fetch)
    with pytest.raises(ContextError, match="could not be fetched: KeyError"):
        cache.archive("0" * 64)
    assert list((tmp_path / "cache").iterdir()) == []


def test_download_past_the_archive_limit_is_refused_and_closed(tmp_path: Path) -> None:
    closed: list[bool] = []

    def fetch(sha256: str) -> Iterator[bytes]:
        try:
            while True:
                yield bytes(4096)
        finally:
            closed.append(True)

    cache = ContextCache(tmp_path / "cache", fetch, max_archive_bytes=64 * 2**10)
    with pytest.raises(ContextError, match=r"larger than 64 KiB \(the limit\)"):
        cache.archive("a" * 64)
    assert closed == [True]
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize(
    "bad", ["", "abc", "A" * 64, "g" * 64, "a" * 63, "a" * 65, "../" + "a" * 61, "a" * 64 + "\n"]
)
def test_invalid_sha_is_refused(tmp_path: Path, bad: str) -> None:
    fetch = FakeFetch({})
    cache = ContextCache(tmp_path / "cache", fetch)
    with pytest.raises(ContextError, match="64 lowercase hex digits"):
        cache.archive(bad)
    with pytest.raises(ContextError, match="64 lowercase hex digits"):
        cache.unpack(bad, tmp_path / "job")
    assert fetch.calls == []
    assert not (tmp_path / "job").exists()


def test_eviction_keeps_the_total_under_max_bytes_and_the_newest(tmp_path: Path) -> None:
    blobs = [tar_bytes([reg(f"f{i}.bin", os.urandom(3000))], gz=False) for i in range(4)]
    size = len(blobs[0])
    assert all(len(blob) == size for blob in blobs)
    fetch = FakeFetch({sha(blob): blob for blob in blobs})
    cache = ContextCache(tmp_path / "cache", fetch, max_bytes=2 * size + size // 2)
    paths = []
    for i, blob in enumerate(blobs[:2]):
        paths.append(cache.archive(sha(blob)))
        os.utime(paths[-1], ns=(i * 10**9, i * 10**9))  # deterministic ages
    cache.archive(sha(blobs[0]))  # used again: now the newest of the two
    cache.archive(sha(blobs[2]))  # stored: the least recently used (blobs[1]) goes
    names = {p.name for p in (tmp_path / "cache").glob("*.archive")}
    assert names == {f"{sha(blobs[0])}.archive", f"{sha(blobs[2])}.archive"}
    total = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.archive"))
    assert total <= cache.max_bytes
    assert fetch.calls == [sha(b) for b in blobs[:3]]


def test_an_archive_over_max_bytes_is_kept_itself(tmp_path: Path) -> None:
    small, big = good_tar(), good_tar() + bytes(20_000)
    cache = ContextCache(tmp_path / "cache", FakeFetch({sha(small): small, sha(big): big}))
    cache.max_bytes = 10_000
    cache.archive(sha(small))
    kept = cache.archive(sha(big))
    assert [p.name for p in (tmp_path / "cache").glob("*.archive")] == [kept.name]


def test_cache_unpacks_and_a_second_unpack_is_a_no_op(tmp_path: Path, jobs: Path) -> None:
    data = good_tar()
    fetch = FakeFetch({sha(data): data})
    cache = ContextCache(tmp_path / "cache", fetch)
    target = jobs / "job"
    assert cache.unpack(sha(data), target) == target
    assert (target / MARKER).read_text().strip() == sha(data)
    assert (target / "pkg" / "train.py").read_bytes() == b"print('hello')\n"
    marker_mtime = (target / MARKER).stat().st_mtime_ns
    (target / "added-by-the-job.log").write_text("the job ran here")
    assert cache.unpack(sha(data), target) == target
    assert (target / "added-by-the-job.log").exists()  # not unpacked again
    assert (target / MARKER).stat().st_mtime_ns == marker_mtime
    assert fetch.calls == [sha(data)]
    assert_nothing_outside(jobs)


def test_cache_unpack_of_another_hash_into_a_used_target_is_refused(
    tmp_path: Path, jobs: Path
) -> None:
    one, two = good_tar(), tar_bytes([reg("other.py", b"")])
    cache = ContextCache(tmp_path / "cache", FakeFetch({sha(one): one, sha(two): two}))
    cache.unpack(sha(one), jobs / "job")
    with pytest.raises(ContextError, match=f"it holds {sha(one)}"):
        cache.unpack(sha(two), jobs / "job")
    assert (jobs / "job" / "pkg" / "train.py").exists()


def test_cache_unpack_of_an_unsafe_archive_leaves_no_target(tmp_path: Path, jobs: Path) -> None:
    data = tar_bytes([reg("ok.py", b"x"), entry("passwd", tarfile.SYMTYPE, "/etc/passwd")])
    cache = ContextCache(tmp_path / "cache", FakeFetch({sha(data): data}))
    with pytest.raises(ContextError, match="symbolic link to an absolute path"):
        cache.unpack(sha(data), jobs / "job")
    assert not (jobs / "job").exists()
    assert_nothing_outside(jobs)
    assert cache.archive(sha(data)).exists()  # the archive is fine, its contents are not


def test_cache_concurrent_unpacks_into_one_target(tmp_path: Path, jobs: Path) -> None:
    data = good_tar()
    fetch = FakeFetch({sha(data): data}, delay=0.001)
    cache = ContextCache(tmp_path / "cache", fetch)
    errors: list[BaseException] = []

    def unpack() -> None:
        try:
            cache.unpack(sha(data), jobs / "job")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=unpack) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert fetch.calls == [sha(data)]
    assert (jobs / "job" / MARKER).read_text().strip() == sha(data)


def test_stale_partial_downloads_are_removed(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / f".{'a' * 64}.xyz.partial").write_bytes(b"half")
    ContextCache(cache_dir, FakeFetch({}))
    assert list(cache_dir.iterdir()) == []
