"""`evenflow.contexts`: a code directory packs to the same bytes every time, leaves out `.git`
and what `.evenflowignore` lists, refuses links that escape it, and explains an oversize one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from evenflow.contexts import PackedContext, format_size, over_limit_message, pack_directory


def _write(path: Path, content: bytes | str = b"x", mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def _project(root: Path) -> Path:
    _write(root / "train.py", "print('train')\n")
    _write(root / "pkg" / "__init__.py", "")
    _write(root / "pkg" / "model.py", "class Model: ...\n")
    _write(root / "configs" / "base.yaml", "lr: 0.1\n")
    return root


def _members(archive: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(archive, "r:gz") as tar:
        return {member.name: member for member in tar.getmembers()}


def _names(archive: Path) -> list[str]:
    with tarfile.open(archive, "r:gz") as tar:
        return tar.getnames()


def test_same_directory_packs_to_same_bytes_even_after_touching_mtimes(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    first = pack_directory(src, tmp_path / "a.tar.gz")
    for path in [*src.rglob("*"), src]:
        os.utime(path, (1_700_000_000, 1_700_000_000))
    second = pack_directory(src, tmp_path / "b.tar.gz")

    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.sha256 == second.sha256
    assert first.sha256 == hashlib.sha256(first.path.read_bytes()).hexdigest()
    assert len(first.sha256) == 64 and first.sha256 == first.sha256.lower()
    assert first.size_bytes == first.path.stat().st_size
    assert first.files == 4


def test_same_content_elsewhere_created_in_another_order_gives_same_hash(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    other = tmp_path / "elsewhere" / "copy"
    for name in ["configs/base.yaml", "pkg/model.py", "train.py", "pkg/__init__.py"]:
        _write(other / name, (src / name).read_bytes())

    assert (
        pack_directory(src, tmp_path / "a.tar.gz").sha256
        == pack_directory(other, tmp_path / "b.tar.gz").sha256
    )


def test_archive_metadata_is_normalised(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    packed = pack_directory(src, tmp_path / "ctx.tar.gz")

    header = packed.path.read_bytes()[:10]
    assert header[:2] == b"\x1f\x8b"
    assert header[3] & 0x08 == 0  # no file name in the gzip header
    assert header[4:8] == b"\x00\x00\x00\x00"  # gzip mtime 0
    names = _names(packed.path)
    assert names == [
        "configs",
        "configs/base.yaml",
        "pkg",
        "pkg/__init__.py",
        "pkg/model.py",
        "train.py",
    ]
    for member in _members(packed.path).values():
        assert (member.mtime, member.uid, member.gid) == (0, 0, 0)
        assert (member.uname, member.gname) == ("", "")
        assert not member.name.startswith(("/", "./"))


def test_changed_file_changes_the_hash(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    before = pack_directory(src, tmp_path / "a.tar.gz")
    _write(src / "pkg" / "model.py", "class Model: pass\n")
    after = pack_directory(src, tmp_path / "b.tar.gz")

    assert before.sha256 != after.sha256


def test_git_is_skipped_anywhere(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    _write(src / ".git" / "HEAD", "ref: refs/heads/main\n")
    _write(src / ".git" / "objects" / "ab" / "cdef", b"\0" * 100)
    _write(src / "vendor" / "lib" / ".git", "gitdir: ../../.git/modules/lib\n")  # a submodule
    _write(src / "vendor" / "lib" / "lib.py", "")
    _write(src / ".gitignore", "*.pyc\n")

    names = _names(pack_directory(src, tmp_path / "ctx.tar.gz").path)

    assert not [name for name in names if ".git" in name.split("/")]
    assert "vendor/lib/lib.py" in names
    assert ".gitignore" in names


def test_evenflowignore_patterns_are_honoured(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    _write(src / ".evenflowignore", "# weights and data\n*.pt\n!keep.pt\ndata/\n/build\n")
    _write(src / "model.pt", b"w" * 10)
    _write(src / "ckpt" / "step1.pt", b"w" * 10)
    _write(src / "keep.pt", b"k")
    _write(src / "ckpt" / "keep.pt", b"k")
    _write(src / "data" / "train.csv", "a,b\n")
    _write(src / "data" / "keep.pt", b"k")  # under an ignored directory: stays out, as in git
    _write(src / "pkg" / "data" / "vocab.txt", "a\n")  # `data/` matches at any depth
    _write(src / "build" / "out.o", b"o")
    _write(src / "pkg" / "build" / "gen.py", "")  # `/build` is anchored at the root

    names = set(_names(pack_directory(src, tmp_path / "ctx.tar.gz").path))

    assert {"keep.pt", "ckpt/keep.pt", "pkg/build/gen.py", ".evenflowignore", "train.py"} <= names
    for left_out in [
        "model.pt",
        "ckpt/step1.pt",
        "data",
        "data/train.csv",
        "data/keep.pt",
        "pkg/data",
        "pkg/data/vocab.txt",
        "build",
        "build/out.o",
    ]:
        assert left_out not in names


def test_ignore_file_changes_the_hash_only_through_what_it_leaves_out(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    _write(src / "scratch.log", "noise\n")
    with_log = pack_directory(src, tmp_path / "a.tar.gz")
    _write(src / ".evenflowignore", "*.log\n")
    without_log = pack_directory(src, tmp_path / "b.tar.gz")
    _write(src / "scratch.log", "other noise, a different size\n")
    log_changed = pack_directory(src, tmp_path / "c.tar.gz")

    assert with_log.sha256 != without_log.sha256
    assert without_log.sha256 == log_changed.sha256


def test_modes_are_755_for_executables_and_directories_644_otherwise(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write(src / "run.sh", "#!/bin/sh\n", mode=0o755)
    _write(src / "private.sh", "#!/bin/sh\n", mode=0o700)
    _write(src / "notes.txt", "hi\n", mode=0o600)
    _write(src / "shared.txt", "hi\n", mode=0o664)
    (src / "empty").mkdir(mode=0o700)

    members = _members(pack_directory(src, tmp_path / "ctx.tar.gz").path)

    assert members["run.sh"].mode == 0o755
    assert members["private.sh"].mode == 0o755
    assert members["notes.txt"].mode == 0o644
    assert members["shared.txt"].mode == 0o644
    assert members["empty"].isdir() and members["empty"].mode == 0o755


def test_internal_relative_symlink_is_packed_as_a_symlink(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    (src / "current.yaml").symlink_to("configs/base.yaml")
    (src / "pkg" / "base.yaml").symlink_to("../configs/base.yaml")
    (src / "pkg" / "configs").symlink_to("../configs")  # a link to a directory is not followed

    packed = pack_directory(src, tmp_path / "ctx.tar.gz")
    members = _members(packed.path)

    assert members["current.yaml"].issym()
    assert members["current.yaml"].linkname == "configs/base.yaml"
    assert members["pkg/base.yaml"].issym()
    assert members["pkg/base.yaml"].linkname == "../configs/base.yaml"
    assert members["pkg/configs"].issym()
    assert "pkg/configs/base.yaml" not in members
    assert packed.files == 4


@pytest.mark.parametrize(
    ("link", "target"),
    [
        ("outside.txt", "../outside"),
        ("pkg/sneaky", "../../outside"),
        ("pkg/abs", "/etc/hostname"),
    ],
)
def test_symlink_leaving_the_directory_is_refused_by_name(
    tmp_path: Path, link: str, target: str
) -> None:
    src = _project(tmp_path / "src")
    _write(tmp_path / "outside", "secret\n")
    (src / link).symlink_to(target)
    out = tmp_path / "ctx.tar.gz"

    with pytest.raises(ValueError, match=link) as raised:
        pack_directory(src, out)

    assert target in str(raised.value)
    assert not out.exists()


def test_ignored_escaping_symlink_is_skipped(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    (src / "host-data").symlink_to("/tmp")
    _write(src / ".evenflowignore", "host-data\n")

    names = _names(pack_directory(src, tmp_path / "ctx.tar.gz").path)

    assert "host-data" not in names


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_fifo_is_refused_by_name(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    os.mkfifo(src / "pkg" / "pipe")

    with pytest.raises(ValueError, match="pkg/pipe"):
        pack_directory(src, tmp_path / "ctx.tar.gz")


def test_archive_written_inside_the_directory_is_not_packed_into_itself(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    out = src / "ctx.tar.gz"

    first = pack_directory(src, out)
    second = pack_directory(src, out)

    assert "ctx.tar.gz" not in _names(out)
    assert first.sha256 == second.sha256


def test_biggest_lists_the_largest_files_in_order(tmp_path: Path) -> None:
    src = tmp_path / "src"
    sizes = {"a.bin": 10, "data/b.bin": 700, "c.bin": 50, "d/e/f.bin": 3000, "g.bin": 1, "h": 90}
    for name, size in sizes.items():
        _write(src / name, b"\0" * size)
    _write(src / "tie1", b"\0" * 50)

    packed = pack_directory(src, tmp_path / "ctx.tar.gz")

    assert packed.files == 7
    assert packed.biggest == [
        ("d/e/f.bin", 3000),
        ("data/b.bin", 700),
        ("h", 90),
        ("c.bin", 50),
        ("tie1", 50),
    ]


def test_empty_directory_packs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()

    packed = pack_directory(src, tmp_path / "ctx.tar.gz")

    assert (packed.files, packed.biggest) == (0, [])
    assert _names(packed.path) == []


def test_missing_or_non_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        pack_directory(tmp_path / "nope", tmp_path / "ctx.tar.gz")
    file = _write(tmp_path / "file.txt", "x")
    with pytest.raises(ValueError, match="not a directory"):
        pack_directory(file, tmp_path / "ctx.tar.gz")
    assert not (tmp_path / "ctx.tar.gz").exists()


def test_over_limit_message_names_the_limit_and_the_biggest_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _write(src / "data" / "big.bin", os.urandom(300 * 1024))
    _write(src / "train.py", "print('hi')\n")
    packed = pack_directory(src, tmp_path / "ctx.tar.gz")

    message = over_limit_message(packed, 256 * 1024)

    assert "over the server's limit of 256.0 KiB" in message
    assert f"the context is {format_size(packed.size_bytes)} packed" in message
    assert "data/big.bin (300.0 KiB)" in message
    assert message.index("data/big.bin") < message.index("train.py")
    assert f".evenflowignore in {src}" in message
    assert "EVENFLOW_CONTEXT_MAX_BYTES" in message
    assert "\n" not in message


def test_over_limit_message_without_a_directory_or_files() -> None:
    packed = PackedContext(
        path=Path("ctx.tar.gz"), sha256="0" * 64, size_bytes=2 * 1024**3, files=0, biggest=[]
    )

    message = over_limit_message(packed, 64 * 1024**2)

    assert message.startswith("the context is 2.0 GiB packed, over the server's limit of 64.0 MiB.")
    assert "biggest" not in message
    assert ".evenflowignore at the context's root" in message


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (int(70.2 * 1024**2), "70.2 MiB"),
        (64 * 1024**2, "64.0 MiB"),
        (3 * 1024**3, "3.0 GiB"),
    ],
)
def test_format_size_uses_binary_units_with_one_decimal(size: int, text: str) -> None:
    assert format_size(size) == text


def test_directory_copied_with_shutil_keeps_its_hash(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    _write(src / "run.sh", "#!/bin/sh\n", mode=0o755)
    copy = tmp_path / "copy"
    shutil.copytree(src, copy, symlinks=True)

    assert (
        pack_directory(src, tmp_path / "a.tar.gz").sha256
        == pack_directory(copy, tmp_path / "b.tar.gz").sha256
    )
