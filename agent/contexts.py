"""Job contexts on an agent host: fetch a code archive once per host, verify it, unpack it safely.

A context is an archive (tar, tar.gz or zip) of the user's code, named by the SHA-256 of its
bytes. ``ContextCache`` keeps verified archives in one directory (``<sha256>.archive``, bounded
by total size, least recently used evicted first), downloads each hash once even when several
threads ask at the same time, and unpacks into a job's directory, marking a complete unpack with
``.evenflow-context`` so a second call is a no-op. The archive is untrusted input, so
``unpack_archive`` copies every entry through its own loop: it refuses paths that leave the
target, links other than symlinks that stay inside it, special files, and archives that unpack
past a size or entry limit (counted on the bytes written, not the headers); on any error the
target is removed again. Symlinks are created last, so no file is ever written through one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

MARKER = ".evenflow-context"
"""Written last into an unpacked context, holding its SHA-256: the unpack is complete."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_SPECIAL = {
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
}


class ContextError(RuntimeError):
    """A context cannot be fetched, is corrupt, or is unsafe; the message says why in one line
    (it becomes the failed rank's reason shown to users)."""


class ContextCache:
    """Verified context archives in ``directory``, at most ``max_bytes`` in all (LRU by mtime).

    ``fetch(sha256)`` yields an archive's bytes in chunks (an HTTP streaming download); one
    download may bring at most ``max_archive_bytes``."""

    def __init__(
        self,
        directory: Path,
        fetch: Callable[[str], Iterable[bytes]],
        *,
        max_bytes: int = 4 * 2**30,
        max_archive_bytes: int = 64 * 2**20,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.max_archive_bytes = max_archive_bytes
        self._fetch = fetch
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._evicting = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        # Downloads cut short by a crash: this cache owns the directory, none is in flight yet.
        for partial in self.directory.glob(".*.partial"):
            with contextlib.suppress(OSError):
                partial.unlink()

    def archive(self, sha256: str) -> Path:
        """The path of the verified archive named ``sha256``, downloaded if not cached.

        The path stays valid until storing other archives evicts it (it is the newest now)."""
        _check_sha(sha256)
        with self._lock(sha256):
            return self._archive_locked(sha256)

    def unpack(
        self,
        sha256: str,
        target: Path,
        *,
        max_unpacked_bytes: int = 512 * 2**20,
        max_files: int = 100_000,
    ) -> Path:
        """Unpack context ``sha256`` into ``target`` (empty or absent) and return ``target``;
        at once if ``target`` already holds a complete unpack of it (its marker)."""
        _check_sha(sha256)
        target = Path(target)
        with self._lock(f"unpack:{os.path.abspath(target)}"):
            held = _read_marker(target)
            if held == sha256:
                return target
            if held is not None:
                raise ContextError(f"cannot unpack context {sha256} into {target}: it holds {held}")
            with self._lock(sha256):
                path = self._archive_locked(sha256)
                # Opened under the hash's lock: eviction may unlink it now, the file stays readable.
                source = _open_archive(path)
            with source:
                _unpack_stream(source, path.name, target, max_unpacked_bytes, max_files)
            _write_marker(target, sha256)
        return target

    def _lock(self, key: str) -> threading.Lock:
        """One lock per hash (or per unpack target), created on first use."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def _archive_locked(self, sha256: str) -> Path:
        """``archive`` with the hash's lock held: touch the cached file or download it."""
        path = self.directory / f"{sha256}.archive"
        try:
            os.utime(path)  # its use, for LRU eviction
            return path
        except FileNotFoundError:
            pass
        self._download(sha256, path)
        self._evict(keep=path)
        return path

    def _download(self, sha256: str, path: Path) -> None:
        """Fetch into a temporary file beside ``path``, hashing as it goes; move it into place
        only if the bytes hash to ``sha256``. No partial file is left behind on any error."""
        fd, partial = tempfile.mkstemp(dir=self.directory, prefix=f".{sha256}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                digest = self._copy_fetched(sha256, out)
                out.flush()
                os.fsync(out.fileno())
            if digest != sha256:
                raise ContextError(f"context {sha256} is corrupt: its bytes hash to {digest}")
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise

    def _copy_fetched(self, sha256: str, out: IO[bytes]) -> str:
        """Write the fetched chunks to ``out`` and return their SHA-256 (hex)."""
        hasher, size = hashlib.sha256(), 0
        try:
            chunks = iter(self._fetch(sha256))
        except Exception as exc:
            raise _fetch_error(sha256, exc) from exc
        try:
            while True:
                try:
                    chunk = next(chunks)
                except StopIteration:
                    return hasher.hexdigest()
                except Exception as exc:
                    raise _fetch_error(sha256, exc) from exc
                size += len(chunk)
                if size > self.max_archive_bytes:
                    limit = _size(self.max_archive_bytes)
                    raise ContextError(f"context {sha256} is larger than {limit} (the limit)")
                hasher.update(chunk)
                out.write(chunk)
        finally:
            close = getattr(chunks, "close", None)  # ends the download when it stops early
            if callable(close):
                with contextlib.suppress(Exception):
                    close()

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used archives until all weigh at most ``max_bytes``,
        never ``keep`` (the one just stored)."""
        with self._evicting:
            entries: list[tuple[int, str, Path, int]] = []
            for path in self.directory.glob("*.archive"):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, path.name, path, st.st_size))
            total = sum(entry[3] for entry in entries)
            for _, _, path, size in sorted(entries):
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                total -= size


def unpack_archive(archive: Path, target: Path, *, max_unpacked_bytes: int, max_files: int) -> None:
    """Safely unpack a tar, tar.gz or zip ``archive`` (told apart by its magic bytes) into
    ``target``, which must be empty or absent; on any error ``target`` is removed again."""
    with _open_archive(Path(archive)) as source:
        _unpack_stream(source, Path(archive).name, Path(target), max_unpacked_bytes, max_files)


@dataclass
class _Budget:
    """What an unpack may still write: bytes and entries, counted as they are written."""

    max_bytes: int
    max_files: int
    written: int = 0
    entries: int = 0

    def entry(self, name: str) -> None:
        self.entries += 1
        if self.entries > self.max_files:
            raise ContextError(
                f"context has more than {self.max_files} entries (the limit) at entry {name!r}"
            )

    def spend(self, size: int, name: str) -> None:
        self.written += size
        if self.written > self.max_bytes:
            raise ContextError(
                f"context unpacks past {_size(self.max_bytes)} (the limit) at entry {name!r}:"
                " a compressed bomb?"
            )


def _unpack_stream(
    source: IO[bytes], label: str, target: Path, max_unpacked_bytes: int, max_files: int
) -> None:
    """Unpack the archive read from ``source`` into ``target``; remove ``target`` on error."""
    _prepare_target(target)
    try:
        root = Path(os.path.realpath(target))
        budget = _Budget(max_unpacked_bytes, max_files)
        magic = source.read(4)
        source.seek(0)
        if magic in (b"PK\x03\x04", b"PK\x05\x06"):
            _unpack_zip(source, root, budget)
        else:
            with _open_tar(source, magic[:2] == b"\x1f\x8b", label) as tar:
                _unpack_tar(tar, root, budget)
    except ContextError:
        shutil.rmtree(target, ignore_errors=True)
        raise
    except Exception as exc:
        shutil.rmtree(target, ignore_errors=True)
        raise ContextError(
            f"context archive {label} could not be unpacked: {_describe(exc)}"
        ) from exc
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


def _open_tar(source: IO[bytes], gzipped: bool, label: str) -> tarfile.TarFile:
    """A tar reader over ``source``; not a tar (nor gzip): the clear ContextError."""
    try:
        return tarfile.open(fileobj=source, mode="r:gz" if gzipped else "r:")
    except tarfile.ReadError as exc:
        if gzipped:
            raise ContextError(
                f"context archive {label} is gzip but not a readable tar.gz: {exc}"
            ) from exc
        raise ContextError(f"context archive {label} is not a tar, tar.gz or zip archive") from exc


def _unpack_tar(tar: tarfile.TarFile, root: Path, budget: _Budget) -> None:
    """Directories and files first, each checked then copied; symlinks last, each checked
    again where it lands and all of them once more after the last is made."""
    links: list[tuple[str, tuple[str, ...], str]] = []
    for member in tar:
        name = member.name
        budget.entry(name)
        parts = _safe_parts(name)
        _check_tar_type(member)
        if member.issym():
            _check_link(name, parts, member.linkname, root)
        try:  # the second line of defence: Python's own rules for untrusted data
            tarfile.data_filter(member, str(root))
        except tarfile.FilterError as exc:
            raise ContextError(f"context entry {name!r} is refused by tarfile: {exc}") from exc
        if not parts:
            if member.isdir():
                continue  # "." or "./": the target itself
            raise ContextError(f"context entry {name!r} has an empty path")
        dest = _destination(root, parts, name)
        if member.isdir():
            _make_dir(dest, name)
        elif member.issym():
            links.append((name, parts, member.linkname))
        else:
            stream = tar.extractfile(member)
            if stream is None:
                raise ContextError(f"context entry {name!r} has no data to read")
            with stream:
                _write_file(stream, dest, _file_mode(member.mode), budget, name)
    _make_links(root, links)


def _check_tar_type(member: tarfile.TarInfo) -> None:
    """Regular files, directories and symlinks only."""
    if member.isfile() or member.isdir() or member.issym():
        return
    if member.islnk():
        raise ContextError(
            f"context entry {member.name!r} is a hard link (to {member.linkname!r}): refused"
        )
    kind = _SPECIAL.get(member.type, f"a special entry (tar type {member.type!r})")
    raise ContextError(f"context entry {member.name!r} is {kind}: refused")


def _check_link(name: str, parts: tuple[str, ...], linkname: str, root: Path) -> None:
    """A symlink's target must be relative and resolve inside ``root`` (as it stands now)."""
    if not linkname or "\x00" in linkname:
        raise ContextError(f"context entry {name!r} is a symbolic link without a valid target")
    if linkname.startswith("/"):
        raise ContextError(
            f"context entry {name!r} is a symbolic link to an absolute path ({linkname!r}): refused"
        )
    resolved = os.path.realpath(os.path.join(root, *parts[:-1], linkname))
    if not _inside(resolved, root):
        raise ContextError(
            f"context entry {name!r} is a symbolic link to {linkname!r}, outside the context:"
            " refused"
        )


def _make_links(root: Path, links: list[tuple[str, tuple[str, ...], str]]) -> None:
    """Create the symlinks, each checked where it lands; then check that every one of them
    still resolves inside ``root`` (a later link may redirect an earlier one)."""
    for name, parts, linkname in links:
        dest = _destination(root, parts, name)
        _check_link(name, parts, linkname, root)
        try:
            os.makedirs(dest.parent, exist_ok=True)
            os.symlink(linkname, dest)
        except FileExistsError as exc:
            raise _duplicate(name) from exc
    for name, parts, _ in links:
        if not _inside(os.path.realpath(root.joinpath(*parts)), root):
            raise ContextError(
                f"context entry {name!r} is a symbolic link that resolves outside the context"
                " through other links: refused"
            )


def _unpack_zip(source: IO[bytes], root: Path, budget: _Budget) -> None:
    """Every entry checked, then copied; zip symlinks and special files are refused."""
    with zipfile.ZipFile(source) as archive:
        for info in archive.infolist():
            name = info.filename
            budget.entry(name)
            parts = _safe_parts(name)
            mode = info.external_attr >> 16
            _check_zip_type(name, mode)
            if info.is_dir() or stat.S_ISDIR(mode):
                if parts:
                    _make_dir(_destination(root, parts, name), name)
                continue
            if not parts:
                raise ContextError(f"context entry {name!r} has an empty path")
            dest = _destination(root, parts, name)
            with archive.open(info) as stream:
                _write_file(stream, dest, _file_mode(mode or 0o644), budget, name)


def _check_zip_type(name: str, mode: int) -> None:
    """Unix mode bits of a zip entry (0 when made elsewhere): no symlinks, no special files."""
    if stat.S_ISLNK(mode):
        raise ContextError(f"context entry {name!r} is a symbolic link in a zip: refused")
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
        raise ContextError(
            f"context entry {name!r} is a special file (mode {stat.filemode(mode)}): refused"
        )


def _safe_parts(name: str) -> tuple[str, ...]:
    """The path components of an entry's name, refused if absolute, with ``..``, a backslash,
    a NUL, or under the reserved marker's name; ``()`` for the archive's root."""
    if "\x00" in name:
        raise ContextError(f"context entry {name!r} has a NUL in its path")
    if "\\" in name:
        raise ContextError(f"context entry {name!r} has a backslash in its path")
    if name.startswith("/"):
        raise ContextError(f"context entry {name!r} has an absolute path: refused")
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if ".." in parts:
        raise ContextError(f"context entry {name!r} has a '..' component: refused")
    if parts and parts[0] == MARKER:
        raise ContextError(f"context entry {name!r} uses the reserved name {MARKER}")
    return parts


def _destination(root: Path, parts: tuple[str, ...], name: str) -> Path:
    """Where an entry goes: its parent, resolved through any link, must be inside ``root``."""
    dest = root.joinpath(*parts)
    if not _inside(os.path.realpath(dest.parent), root):
        raise ContextError(f"context entry {name!r} would land outside the context: refused")
    return dest


def _make_dir(dest: Path, name: str) -> None:
    try:
        os.makedirs(dest, exist_ok=True)
    except FileExistsError as exc:
        raise _duplicate(name) from exc


def _write_file(stream: IO[bytes], dest: Path, mode: int, budget: _Budget, name: str) -> None:
    """Copy ``stream`` to a new file ``dest`` in chunks, counting every byte against the
    budget before it is written; never through a link, never over an existing file."""
    os.makedirs(dest.parent, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(dest, flags, 0o600)
    except FileExistsError as exc:
        raise _duplicate(name) from exc
    with os.fdopen(fd, "wb") as out:
        while chunk := stream.read(_CHUNK):
            budget.spend(len(chunk), name)
            out.write(chunk)
    os.chmod(dest, mode)


def _file_mode(mode: int) -> int:
    """Permissions without setuid, setgid, sticky or group/other write; the owner may read and
    write; executable by all who may read it only if the owner's execute bit is set."""
    mode = mode & 0o755 | 0o600
    return mode if mode & stat.S_IXUSR else mode & ~0o111


def _prepare_target(target: Path) -> None:
    """Create ``target``; if it is there it must be an empty directory (not a link)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ContextError(f"cannot unpack a context into {target}: it is not a directory")
    if target.is_dir():
        with os.scandir(target) as entries:
            if any(True for _ in entries):
                raise ContextError(f"cannot unpack a context into {target}: it is not empty")
    target.mkdir(parents=True, exist_ok=True)


def _read_marker(target: Path) -> str | None:
    """The hash a complete unpack in ``target`` holds, or None (absent, incomplete)."""
    try:
        return (target / MARKER).read_text(encoding="ascii").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ContextError(f"cannot read {target / MARKER}: {_describe(exc)}") from exc


def _write_marker(target: Path, sha256: str) -> None:
    """Mark the unpack complete (the last thing written); on failure remove ``target``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(target / MARKER, flags, 0o644)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(sha256 + "\n")
    except OSError as exc:
        shutil.rmtree(target, ignore_errors=True)
        raise ContextError(f"cannot mark context {sha256} unpacked: {_describe(exc)}") from exc


def _open_archive(path: Path) -> IO[bytes]:
    try:
        return path.open("rb")
    except OSError as exc:
        raise ContextError(f"context archive {path} cannot be read: {_describe(exc)}") from exc


def _check_sha(sha256: str) -> None:
    """Refuse anything but 64 lowercase hex digits before it goes into a path."""
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise ContextError(
            f"{repr(sha256)[:80]} is not a context's SHA-256 (64 lowercase hex digits)"
        )


def _inside(path: str, root: Path) -> bool:
    return os.path.commonpath([path, str(root)]) == str(root)


def _duplicate(name: str) -> ContextError:
    return ContextError(f"context entry {name!r} appears twice in the archive (or clashes)")


def _fetch_error(sha256: str, exc: Exception) -> ContextError:
    return ContextError(f"context {sha256} could not be fetched: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _size(n: int) -> str:
    """``512 MiB``, ``4 GiB``: a limit as people write it."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"
