"""Agent tokens per host from the settings (``EVENFLOW_AGENT_TOKENS``, what docker-compose.yml
gives each agent service): bound to their host, never the admin token."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from contract.base import PROTOCOL_VERSION
from server.app import create_app
from server.config import parse_agent_tokens
from tests.harness import ADMIN_TOKEN, Api, make_settings

A, B = "ef_agent-a-token-0123456789", "ef_agent-b-token-0123456789"


def _api(tmp_path: Path, tokens: str) -> TestClient:
    url = f"sqlite:///{tmp_path / 'a.db'}"
    return TestClient(create_app(make_settings(url, agent_tokens=tokens)))


def test_each_agent_token_acts_for_its_own_host_only(tmp_path: Path) -> None:
    with _api(tmp_path, f"host-a={A}, host-b={B}") as client:
        api = Api(client)
        api.register("host-a", devices=1, token=A)
        api.register("host-b", devices=1, token=B)
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "name": "host-b",
            "address": "127.0.0.1",
            "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1}],
        }
        r = client.post("/api/v1/hosts/register", json=body, headers=api.headers(A))
        assert r.status_code == 403
        assert "bound to host 'host-a'" in r.json()["detail"]
        spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 8, "workers": 1}
        assert client.post("/api/v1/jobs", json=spec, headers=api.headers(A)).status_code == 403
        listed = client.get("/api/v1/tokens", headers=api.headers()).json()["items"]
        agents = {t["host"]: t for t in listed if t["role"] == "agent"}
        assert set(agents) == {"host-a", "host-b"}


def test_a_changed_agent_token_replaces_the_old_one(tmp_path: Path) -> None:
    with _api(tmp_path, f"host-a={A}") as client:
        Api(client).register("host-a", devices=1, token=A)
    new = "ef_agent-a-rotated-0123456789"
    with _api(tmp_path, f"host-a={new}") as client:
        api = Api(client)
        r = client.get("/api/v1/hosts", headers=api.headers(A))
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
        api.register("host-a", devices=1, token=new)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("host-a", "entry 1 is not 'host=token'"),
        (f"host-a={A},bad host={B}", "entry 2 is not 'host=token'"),
        ("host-a=short", "under 16 characters"),
        (f"host-a={A},host-a={B}", "names host-a twice"),
        (f"host-a={A},host-b={A}", "shares its token"),
    ],
)
def test_malformed_agent_tokens_are_refused_naming_the_entry(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_agent_tokens(text)
    with pytest.raises(ValidationError) as err:
        make_settings("sqlite://", agent_tokens=text)
    assert A not in str(err.value) and B not in str(err.value)


def test_the_admin_token_is_never_an_agent_token() -> None:
    with pytest.raises(ValidationError, match="must not contain the admin token"):
        make_settings("sqlite://", agent_tokens=f"host-a={ADMIN_TOKEN}")
