"""docker-compose.yml parses (no engine needed for `config`) and runs the documented commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose_cmd() -> list[str]:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
    ):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(
            "CI=true but neither `docker compose` nor `docker-compose` is installed (make browser-deps)"
        )
    pytest.skip(
        "neither `docker compose` nor `docker-compose` is installed (make browser-deps installs it)"
    )


def test_compose_file_is_valid_and_matches_the_readme() -> None:
    cmd = _compose_cmd()
    env = {**os.environ, "EVENFLOW_ADMIN_TOKEN": "ef_compose-test-token-123456"}
    out = subprocess.run(
        [*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    services = config["services"]
    assert set(services) == {"postgres", "server", "agent-1", "agent-2"}
    assert services["server"]["environment"]["EVENFLOW_DATABASE_URL"].startswith(
        "postgresql+psycopg://"
    )
    readme = (ROOT / "README.md").read_text()
    for name in ("server", "agent-1", "agent-2"):
        command = services[name]["command"]
        command = " ".join(command) if isinstance(command, list) else command
        assert command.startswith("evenflow ")
        assert command in readme, f"README does not document the {name} command: {command}"


def test_compose_without_admin_token_is_refused() -> None:
    cmd = _compose_cmd()
    env = {k: v for k, v in os.environ.items() if k != "EVENFLOW_ADMIN_TOKEN"}
    out = subprocess.run(
        [*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode != 0
    assert "EVENFLOW_ADMIN_TOKEN" in out.stderr
