"""The package boundaries in docs/architecture.md, checked on every import statement.

``contract`` is the neutral wire contract; ``server`` and ``agent`` both depend on it and never on
each other; only ``evenflow`` (the CLI, the local cluster, the experiment harness) uses both.
The planner and the straggler detector stay pure: no database, no HTTP, no clock of their own.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

PROJECT = ("contract", "server", "agent", "evenflow", "frontend", "migrations")

FORBIDDEN: dict[str, set[str]] = {
    "contract": {"server", "agent", "evenflow", "frontend", "migrations"},
    "server": {"agent", "evenflow"},
    "agent": {"server", "evenflow", "frontend", "migrations"},
}
PURE = ("server/planner", "server/stragglers")
IMPURE_LIBRARIES = {"sqlalchemy", "fastapi", "starlette", "httpx", "uvicorn", "alembic", "psycopg"}


def imported_roots(path: Path) -> set[str]:
    """Every top-level module an ``import`` or ``from ... import`` in ``path`` names, lazy ones too."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_imported_roots_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import os.path\ndef f():\n    from server.db import x\n    import agent\n")
    assert imported_roots(sample) == {"os", "server", "agent"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_it_may(package: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {root}"
        for path in sources(package)
        for root in sorted(imported_roots(path) & FORBIDDEN[package])
    ]
    assert sources(package), f"no sources found for {package}"
    assert offences == []


def test_contract_needs_only_pydantic_and_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"pydantic", "contract", "__future__"}
    offences = [
        f"{path.relative_to(ROOT)} imports {root}"
        for path in sources("contract")
        for root in sorted(imported_roots(path) - allowed)
    ]
    assert offences == []


@pytest.mark.parametrize("package", PURE)
def test_pure_parts_touch_no_database_or_network(package: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {root}"
        for path in sources(package)
        for root in sorted(imported_roots(path) & (IMPURE_LIBRARIES | {"server"}))
        if not _is_pure_sibling(path, root)
    ]
    assert offences == []


def _is_pure_sibling(path: Path, root: str) -> bool:
    """``server.planner`` and ``server.stragglers`` may import each other and themselves."""
    if root != "server":
        return False
    tree = ast.parse(path.read_text())
    modules = [
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("server")
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("server")
    ]
    return all(m.startswith(("server.planner", "server.stragglers")) for m in modules)


def test_tests_import_shared_helpers_from_the_harness_never_from_conftest() -> None:
    """``conftest.py`` holds fixtures (pytest loads it); what tests share lives in
    ``tests/harness.py`` (and ``tests/ui/simulated.py``), imported like any module."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("conftest"):
                offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import ...")
    assert offenders == []
