"""Pack a job's code directory (its *context*) into a deterministic ``.tar.gz``.

``evenflow jobs submit job.yaml --context DIR`` uploads the archive and the job names it by
the archive's SHA-256, so the same directory content must give the same bytes every time:
members are sorted and their metadata (times, owners, modes) normalised. ``.git`` is always
left out, and so is whatever the root ``.evenflowignore`` (gitignore syntax) matches.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pathspec

IGNORE_FILE = ".evenflowignore"
ALWAYS_SKIPPED = ".git"
BIGGEST_COUNT = 5
_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackedContext:
    """An archive written by :func:`pack_directory` and what the CLI shows about it."""

    path: Path
    sha256: str
    size_bytes: int
    files: int
    biggest: list[tuple[str, int]]
    # The directory packed, so that messages can say where a .evenflowignore goes.
    directory: Path | None = None


@dataclass(frozen=True)
class _Entry:
    """One member to write: its name in the archive and where its content comes from."""

    name: str
    kind: Literal["dir", "file", "symlink"]
    source: Path
    link_target: str = ""


def pack_directory(directory: Path, out: Path) -> PackedContext:
    """Write a deterministic ``.tar.gz`` of ``directory`` to ``out`` and describe it.

    The whole tree is checked before anything is written, so a refused symlink or special
    file leaves no partial archive behind. ``out`` itself is never packed, even when it lies
    inside ``directory``.
    """
    if not directory.exists():
        raise ValueError(f"context directory {directory} does not exist")
    if not directory.is_dir():
        raise ValueError(f"context {directory} is not a directory")
    entries = _collect(directory, _load_ignore(directory), _own_name(directory, out))
    try:
        # filename="" keeps the output's name out of the gzip header, mtime=0 the time of day.
        with (
            open(out, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            sizes = [_add(tar, entry) for entry in entries]
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    packed = [(e.name, size) for e, size in zip(entries, sizes, strict=True) if e.kind == "file"]
    packed.sort(key=lambda item: (-item[1], item[0]))
    sha256, size_bytes = _digest(out)
    return PackedContext(
        path=out,
        sha256=sha256,
        size_bytes=size_bytes,
        files=len(packed),
        biggest=packed[:BIGGEST_COUNT],
        directory=directory,
    )


def over_limit_message(packed: PackedContext, limit_bytes: int) -> str:
    """A paragraph for a context over the server's size limit: what to leave out, and how."""
    text = (
        f"the context is {format_size(packed.size_bytes)} packed, over the server's limit of "
        f"{format_size(limit_bytes)}."
    )
    if packed.biggest:
        listed = ", ".join(f"{name} ({format_size(size)})" for name, size in packed.biggest)
        text += f" Its biggest files: {listed}."
    where = f"in {packed.directory}" if packed.directory is not None else "at the context's root"
    return (
        f"{text} Leave them out with a {IGNORE_FILE} {where} (gitignore syntax), "
        "or raise EVENFLOW_CONTEXT_MAX_BYTES on the server."
    )


def format_size(size: int) -> str:
    """``size`` bytes in binary units with one decimal (``70.2 MiB``); bytes below 1 KiB."""
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _load_ignore(directory: Path) -> pathspec.GitIgnoreSpec:
    """The root ``.evenflowignore`` as a spec (empty without one); nested ones are not read."""
    path = directory / IGNORE_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _own_name(directory: Path, out: Path) -> str | None:
    """``out``'s member name when it lies inside ``directory`` (so it is not packed into itself)."""
    try:
        return out.resolve().relative_to(directory.resolve()).as_posix()
    except ValueError:
        return None


def _collect(directory: Path, ignore: pathspec.GitIgnoreSpec, own: str | None) -> list[_Entry]:
    """Every member to pack, depth first in name order, refusing what cannot be shipped.

    An ignored directory is not entered, so as in git a negation cannot re-include a file
    under it.
    """
    entries: list[_Entry] = []

    def walk(folder: Path, prefix: str) -> None:
        with os.scandir(folder) as it:
            children = sorted(it, key=lambda child: child.name)
        for child in children:
            name = prefix + child.name
            if child.name == ALWAYS_SKIPPED or name == own:
                continue
            is_dir = child.is_dir(follow_symlinks=False)
            if ignore.match_file(name + "/" if is_dir else name):
                continue
            source = Path(child.path)
            if child.is_symlink():
                entries.append(_Entry(name, "symlink", source, _link_target(source, name)))
            elif is_dir:
                entries.append(_Entry(name, "dir", source))
                walk(source, name + "/")
            elif child.is_file(follow_symlinks=False):
                entries.append(_Entry(name, "file", source))
            else:
                raise ValueError(
                    f"{name} in the context is not a regular file, directory or symlink "
                    f"(a socket, FIFO or device); remove it or list it in {IGNORE_FILE}"
                )

    walk(directory, "")
    return entries


def _link_target(link: Path, name: str) -> str:
    """The target of symlink ``name`` if it is relative and stays inside the context."""
    target = os.readlink(link)
    if os.path.isabs(target):
        raise ValueError(
            f"symlink {name} in the context points to the absolute path {target}; "
            f"only relative links inside the context can be shipped ({IGNORE_FILE} can skip it)"
        )
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved == ".." or resolved.startswith("../"):
        raise ValueError(
            f"symlink {name} in the context points outside it ({target}); "
            f"only relative links inside the context can be shipped ({IGNORE_FILE} can skip it)"
        )
    return target


def _add(tar: tarfile.TarFile, entry: _Entry) -> int:
    """Write one member with normalised metadata; return the bytes of content written."""
    info = tarfile.TarInfo(entry.name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        tar.addfile(info)
        return 0
    if entry.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.mode = 0o777
        info.linkname = entry.link_target
        tar.addfile(info)
        return 0
    with open(entry.source, "rb") as content:
        # The size and mode of the file opened, not of a path that may change in between.
        status = os.fstat(content.fileno())
        info.type = tarfile.REGTYPE
        info.size = status.st_size
        info.mode = 0o755 if status.st_mode & stat.S_IXUSR else 0o644
        tar.addfile(info, content)
    return info.size


def _digest(path: Path) -> tuple[str, int]:
    """The SHA-256 (lowercase hex) and size of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as archive:
        while chunk := archive.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
