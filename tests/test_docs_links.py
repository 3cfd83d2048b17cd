"""The documentation holds together: every relative link in the repository's Markdown (the
README, ``docs/``, the changelog, anywhere outside tool and build folders) resolves to a file or
folder inside the repository, and every ``#anchor`` into a Markdown file names one of its
headings. External links (``http:``, ``https:``, ``mailto:``, any scheme) are not checked.

The README stays a front door: at most ``README_MAX_LINES`` lines, with the two commands shown.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

README_MAX_LINES = 300

SKIPPED_DIRS = frozenset({"node_modules", "test-artifacts", "build", "__pycache__", "results"})
"""Folders never searched for Markdown: dependencies, build and run outputs (and every folder
whose name starts with a dot: ``.venv``, ``.git``, tool caches)."""

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"
)
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"""<[a-z][^>]*\s(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    """Every ``*.md`` under ``root``, outside dot-folders and ``SKIPPED_DIRS``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")
        )
        found += [Path(folder) / f for f in sorted(files) if f.lower().endswith(".md")]
    return found


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with inline code spans blanked."""
    lines, fence = [], ""
    for number, line in enumerate(text.splitlines(), start=1):
        opened = FENCE.match(line)
        if fence:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = ""
            continue
        if opened:
            fence = opened.group(1)
            continue
        lines.append((number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every link and image in the Markdown ``text``."""
    found = []
    for number, line in _prose_lines(text):
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        targets += [m.group(1) for m in REFERENCE_DEFINITION.finditer(line)]
        targets += [m.group(1) for m in HTML_LINK.finditer(line)]
        found += [(number, t.strip("<>").strip()) for t in targets]
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped, spaces as
    hyphens (``What `make demo` shows`` -> ``what-make-demo-shows``)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a Markdown file defines: its headings' slugs (a repeated one numbered as
    GitHub does: ``name``, ``name-1``, ...) and explicit ``id``/``name`` attributes."""
    seen: Counter[str] = Counter()
    found = set()
    for _, line in _prose_lines(text):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
        found.update(m.group(1) for m in HTML_ANCHOR.finditer(line))
    return found


def _anchors_of(path: Path) -> set[str]:
    return anchors(path.read_text(encoding="utf-8"))


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of the Markdown file ``path``, one line each."""
    text = path.read_text(encoding="utf-8")
    problems = []
    for number, target in links(text):
        if not target or SCHEME.match(target):
            continue  # external (http, https, mailto, ...): not checked
        where = f"{path.relative_to(root)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if not file_part:
            resolved = path.resolve()
        elif file_part.startswith("/"):
            resolved = (root / file_part.lstrip("/")).resolve()
        else:
            resolved = (path.parent / file_part).resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where}: points outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where}: no such file or folder")
            continue
        in_markdown = resolved.is_file() and resolved.suffix.lower() == ".md"
        if anchor and in_markdown and unquote(anchor).lower() not in _anchors_of(resolved):
            problems.append(f"{where}: no heading '#{anchor}' in {resolved.name}")
    return problems


MARKDOWN = markdown_files()


def test_the_documentation_is_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "CHANGELOG.md", "docs/README.md"} <= names
    assert not any(n.startswith((".venv/", "node_modules/")) for n in names)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = len(readme.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}"
    for command in ("make demo", "make test"):
        assert command in readme, f"README.md does not show `{command}`"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# A page\n\n## Its part\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n"
        "[ok](docs/there.md) [ok](docs/there.md#its-part) [ok](#top) [web](https://example.com)\n"
        "`[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
        "[gone](docs/missing.md) [bad anchor](docs/there.md#nowhere) [out](../shared/x.md)\n"
        "[ref]: docs/also-missing.md\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ")[1] for p in problems] == [
        "docs/missing.md",
        "docs/there.md#nowhere",
        "../shared/x.md",
        "docs/also-missing.md",
    ], problems
