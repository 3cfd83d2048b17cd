"""What an uploaded code archive holds, checked before it is stored.

Agents unpack a job's archive themselves and refuse anything unsafe there (``agent.contexts``);
the server looks at the member list first, so that a person uploading an archive that could
never run hears why at once (422 naming the entry) instead of from every job's failed ranks.
Refused: what is not a tar, tar.gz or zip; absolute paths and ``..``; links leaving the archive
(hard links, and symlinks that are absolute or climb out); devices, FIFOs and other special
entries; and an archive whose members add up to more than ``CONTEXT_UNPACKED_RATIO`` times its
size (``CONTEXT_UNPACKED_MIN_BYTES`` at least): a compressed bomb.
"""

from __future__ import annotations

import posixpath
import stat
import tarfile
import zipfile
from typing import IO

from contract.base import CONTEXT_UNPACKED_MIN_BYTES, CONTEXT_UNPACKED_RATIO
from server.errors import Invalid

MAX_ENTRIES = 100_000
"""The most entries an archive may hold."""


def check_archive(spool: IO[bytes], size: int) -> None:
    """Refuse (``Invalid``, field ``body``) an archive an agent could not safely unpack."""
    limit = max(CONTEXT_UNPACKED_MIN_BYTES, CONTEXT_UNPACKED_RATIO * size)
    spool.seek(0)
    magic = spool.read(4)
    spool.seek(0)
    if magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        _check_zip(spool, limit)
        return
    try:
        with tarfile.open(fileobj=spool, mode="r:*") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise _refused(f"the archive is not a tar, tar.gz or zip archive ({exc})") from None
    _check_tar(members, limit)


def _check_tar(members: list[tarfile.TarInfo], limit: int) -> None:
    total = 0
    if len(members) > MAX_ENTRIES:
        raise _refused(f"the archive has {len(members)} entries, more than {MAX_ENTRIES}")
    for m in members:
        _check_name(m.name)
        if m.islnk():
            raise _refused(f"entry {m.name!r} is a hard link: pack the file itself")
        if m.issym():
            _check_link(m.name, m.linkname)
        elif not (m.isfile() or m.isdir()):
            raise _refused(f"entry {m.name!r} is a device, FIFO or other special file")
        total += m.size
        if total > limit:
            raise _refused(f"the archive unpacks past {limit} bytes at {m.name!r}: a bomb?")


def _check_zip(spool: IO[bytes], limit: int) -> None:
    try:
        with zipfile.ZipFile(spool) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise _refused(f"the archive is not a readable zip archive ({exc})") from None
    if len(infos) > MAX_ENTRIES:
        raise _refused(f"the archive has {len(infos)} entries, more than {MAX_ENTRIES}")
    total = 0
    for info in infos:
        _check_name(info.filename)
        mode = info.external_attr >> 16
        if mode and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise _refused(f"entry {info.filename!r} is a link or special file")
        total += info.file_size
        if total > limit:
            raise _refused(f"the archive unpacks past {limit} bytes at {info.filename!r}: a bomb?")


def _check_name(name: str) -> None:
    parts = name.replace("\\", "/").split("/")
    if name.startswith("/") or "\\" in name or ".." in parts or "\x00" in name:
        raise _refused(f"entry {name!r} would land outside the job's directory")


def _check_link(name: str, target: str) -> None:
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if target.startswith("/") or resolved == ".." or resolved.startswith("../"):
        raise _refused(f"symlink {name!r} points outside the archive ({target})")


def _refused(why: str) -> Invalid:
    return Invalid(f"{why}; nothing was stored", field="body")
