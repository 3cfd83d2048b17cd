"""docker-compose.yml parses (no engine needed for `config`) and runs the documented commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from server.config import parse_agent_tokens

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


TOKENS = {
    "EVENFLOW_ADMIN_TOKEN": "ef_compose-test-token-123456",
    "EVENFLOW_AGENT_1_TOKEN": "ef_compose-agent-1-token-1234",
    "EVENFLOW_AGENT_2_TOKEN": "ef_compose-agent-2-token-1234",
}


def test_compose_file_is_valid_and_matches_the_readme() -> None:
    cmd = _compose_cmd()
    env = {**os.environ, **TOKENS}
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
    # Each agent holds its own token, bound to its host name by the server; none the admin's.
    server_env = services["server"]["environment"]
    admin = TOKENS["EVENFLOW_ADMIN_TOKEN"]
    for n in ("1", "2"):
        agent_env = services[f"agent-{n}"]["environment"]
        assert agent_env["EVENFLOW_TOKEN"] == TOKENS[f"EVENFLOW_AGENT_{n}_TOKEN"]
        assert admin not in " ".join(str(v) for v in agent_env.values())
    assert parse_agent_tokens(server_env["EVENFLOW_AGENT_TOKENS"]) == {
        "agent-1": TOKENS["EVENFLOW_AGENT_1_TOKEN"],
        "agent-2": TOKENS["EVENFLOW_AGENT_2_TOKEN"],
    }


def test_compose_without_admin_token_is_refused() -> None:
    cmd = _compose_cmd()
    env = {**{k: v for k, v in os.environ.items() if k not in TOKENS}, **TOKENS}
    del env["EVENFLOW_ADMIN_TOKEN"]
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


def test_compose_without_an_agent_token_is_refused() -> None:
    cmd = _compose_cmd()
    env = {**{k: v for k, v in os.environ.items() if k not in TOKENS}, **TOKENS}
    del env["EVENFLOW_AGENT_2_TOKEN"]
    out = subprocess.run(
        [*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode != 0
    assert "EVENFLOW_AGENT_2_TOKEN" in out.stderr
