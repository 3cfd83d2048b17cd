"""deploy/kubernetes renders with kustomize and every object validates against the Kubernetes
schemas (offline, strict: an unknown or misspelt field fails), and the deployment keeps its
promises: replicas behind a Service, probes and resource requests, agents on GPU nodes with
their own per-node token and never the admin token."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.harness import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
SECRET_FILES = {
    "admin-token": "ef_admin-token-for-trying",
    "postgres-password": "pg-password-for-trying",
    "database-url": "postgresql+psycopg://evenflow:pg@evenflow-postgres:5432/evenflow",
}


def render(directory: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render deploy/kubernetes"
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(KUBE / "base")


@pytest.fixture(scope="module")
def try_overlay(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The `try` overlay with the secret files a person creates (never committed)."""
    copy = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, copy)
    for name, value in SECRET_FILES.items():
        (copy / "overlays" / "try" / name).write_text(value)
    return render(copy / "overlays" / "try")


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("which", ["base", "try_overlay"])
def test_every_object_validates_strictly(which: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(which)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "evenflow"


def test_the_validator_refuses_a_misspelt_field(base: list[dict[str, Any]]) -> None:
    broken = find(base, "Deployment", "evenflow-server")
    broken = {**broken, "spec": {**broken["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_server_runs_replicated_behind_a_service_with_probes(
    base: list[dict[str, Any]],
) -> None:
    server = find(base, "Deployment", "evenflow-server")
    assert server["spec"]["replicas"] >= 2
    service = find(base, "Service", "evenflow-server")
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    pod = server["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    assert main["livenessProbe"]["httpGet"]["path"] == "/api/v1/health/live"
    assert main["readinessProbe"]["httpGet"]["path"] == "/api/v1/health"
    (migrate,) = pod["initContainers"]
    assert migrate["command"] == ["evenflow", "migrate"]
    env = {e["name"]: e for e in main["env"]}
    assert env["EVENFLOW_RUN_MIGRATIONS"]["value"] == "false"
    assert env["EVENFLOW_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "evenflow-database"


def test_every_container_requests_resources(try_overlay: list[dict[str, Any]]) -> None:
    workloads = [d for d in try_overlay if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]
    assert len(workloads) == 3
    for workload in workloads:
        for c in containers(workload):
            assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), c["name"]


def test_agents_run_on_gpu_nodes_with_their_own_node_token(base: list[dict[str, Any]]) -> None:
    agent = find(base, "DaemonSet", "evenflow-agent")
    pod = agent["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "--token-file=/etc/evenflow/agent-tokens/$(NODE_NAME)" in c["command"]
    assert "--name=$(NODE_NAME)" in c["command"]
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"evenflow-agent-tokens"}
    assert "env" not in c or all(
        "secretKeyRef" not in e.get("valueFrom", {}) for e in c.get("env", [])
    )


def test_no_agent_or_database_pod_can_read_the_admin_token(
    try_overlay: list[dict[str, Any]],
) -> None:
    readers = set()
    for workload in try_overlay:
        if workload["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        text = yaml.safe_dump(workload["spec"]["template"])
        if "evenflow-admin" in text:
            readers.add(workload["metadata"]["name"])
    assert readers == {"evenflow-server"}


def test_the_try_overlay_adds_postgres_and_the_secrets(try_overlay: list[dict[str, Any]]) -> None:
    find(try_overlay, "StatefulSet", "evenflow-postgres")
    find(try_overlay, "Service", "evenflow-postgres")
    for name in ("evenflow-admin", "evenflow-postgres", "evenflow-database"):
        find(try_overlay, "Secret", name)
    assert not [d for d in try_overlay if d["metadata"]["name"] == "evenflow-agent-tokens"]


def test_the_liveness_probe_answers_without_a_token_or_database(sqlite_api: Any) -> None:
    r = sqlite_api.client.get("/api/v1/health/live")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_evenflow_migrate_prepares_a_database(tmp_path: Path) -> None:
    from sqlalchemy import create_engine, inspect, text

    url = f"sqlite:///{tmp_path / 'k.db'}"
    env = {"EVENFLOW_DATABASE_URL": url, "EVENFLOW_ADMIN_TOKEN": "ef_k8s-admin-token-0123456789"}
    done = subprocess.run(
        [sys.executable, "-m", "evenflow.cli", "migrate"],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    engine = create_engine(url)
    try:
        assert {"jobs", "hosts", "api_tokens"} <= set(inspect(engine).get_table_names())
        with engine.connect() as c:
            roles = c.execute(text("SELECT role FROM api_tokens")).scalars().all()
        assert roles == ["admin"]  # bootstrapped from EVENFLOW_ADMIN_TOKEN
    finally:
        engine.dispose()
