"""The `evenflow` CLI against a real uvicorn server: tables for people, JSON for scripts,
non-zero exits with the server's message."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent.client import ApiClient, make_http
from agent.daemon import _log_tail_at
from contract.agent import LOG_TAIL_CHARS, DeviceInfo, Heartbeat, HostRegister, WorkerReport
from contract.api import HostOut, JobOut, TokenCreate
from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceKind, Role, WorkerState
from evenflow.cli import main
from evenflow.cli.jobs import new_log_text
from server.app import create_app
from tests.harness import ADMIN_TOKEN, LiveServer, make_settings, serving, wait_placed


@pytest.fixture
def env(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> LiveServer:
    monkeypatch.setenv("EVENFLOW_SERVER", live_server.url)
    monkeypatch.setenv("EVENFLOW_TOKEN", live_server.admin_token)
    return live_server


def _cpu_host(client: ApiClient, name: str) -> HostOut:
    """Register a host of two CPU devices through ``client`` (an admin's or its agent's)."""
    devices = [
        DeviceInfo(index=i, kind=DeviceKind.CPU, model="CPU", memory_mb=64) for i in range(2)
    ]
    return client.register_host(
        HostRegister(
            protocol_version=PROTOCOL_VERSION, name=name, address="127.0.0.1", devices=devices
        )
    )


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_submit_list_show_cancel(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = ApiClient(make_http(env.url, env.admin_token))
    _cpu_host(client, "cli-host")
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: cli-job\nworkload: {builtin: mlp}\nglobal_batch: 64\niterations: 10\nworkers: 2\n"
    )
    job = _json(capsys, "jobs", "submit", str(spec))
    # The submission answers before placement; the server's controller places it next.
    assert isinstance(job, dict) and job["status"] == "pending"
    _placed(client, job["id"])
    listed = _json(capsys, "jobs", "list")
    assert isinstance(listed, dict) and [j["id"] for j in listed["items"]] == [job["id"]]
    assert main(["jobs", "show", str(job["id"])]) == 0
    out = capsys.readouterr().out
    assert "cli-job" in out and "plan v1" in out and "[32, 32]" in out
    assert "waits" not in out
    # A second job waits for the first one's devices, and says so.
    second = _json(capsys, "jobs", "submit", str(spec))
    assert isinstance(second, dict)
    reason = f"needs 2 devices, 0 free, 2 busy with job {job['id']}"
    assert _placed(client, second["id"]).pending_reason == reason
    assert main(["jobs", "show", str(second["id"])]) == 0
    assert f"job {second['id']} waits: {reason}" in capsys.readouterr().out
    assert main(["jobs", "list"]) == 0
    assert f"job {second['id']} waits: {reason}" in capsys.readouterr().out
    client.cancel(second["id"])
    assert main(["hosts", "list"]) == 0
    assert "cli-host" in capsys.readouterr().out
    cancelled = _json(capsys, "jobs", "cancel", str(job["id"]))
    assert isinstance(cancelled, dict) and cancelled["status"] == "cancelled"
    assert main(["jobs", "cancel", str(job["id"])]) == 1
    assert "409" in capsys.readouterr().err


def _placed(client: ApiClient, job_id: int) -> JobOut:
    """The job once the server's controller has tried to place it."""
    deadline = time.monotonic() + 30
    while True:
        job = client.job(job_id)
        if job.status.value != "pending" or "controller" not in (job.pending_reason or ""):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def test_tokens_create_and_revoke(
    env: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    created = _json(capsys, "tokens", "create", "--role", "viewer", "--name", "dash")
    assert isinstance(created, dict) and created["token"].startswith("ef_")
    monkeypatch.setenv("EVENFLOW_TOKEN", created["token"])
    assert main(["jobs", "list"]) == 0
    assert main(["tokens", "create", "--role", "admin"]) == 1
    assert "admin role" in capsys.readouterr().err
    monkeypatch.setenv("EVENFLOW_TOKEN", env.admin_token)
    assert main(["tokens", "revoke", str(created["id"])]) == 0
    monkeypatch.setenv("EVENFLOW_TOKEN", created["token"])
    assert main(["jobs", "list"]) == 1
    assert "revoked" in capsys.readouterr().err


def test_bad_spec_file_and_unreachable_server(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(
        "name: x\nworkload: {builtin: mlp}\nglobal_batch: -3\niterations: 1\nworkers: 1\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["jobs", "submit", str(spec)])
    assert "global_batch" in str(exc.value)
    assert main(["jobs", "list", "--server", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def _column(table: str, header: str, after: str) -> str:
    """The text of one column of a one-row table, its folded pieces joined: the column spans
    from its header's offset to the next header's."""
    lines = table.splitlines()
    head = next(i for i, line in enumerate(lines) if f" {header} " in line)
    start, end = lines[head].index(f" {header} "), lines[head].index(f" {after} ")
    body = [line for line in lines[head + 2 :] if line.strip()]
    return "".join(line[start:end].strip() for line in body)


def test_spec_problems_all_in_words(tmp_path: Path) -> None:
    """Every problem of a spec at once, named by field, patterns in words, misspelt keys
    matched to what was meant; the server is never asked."""
    spec = tmp_path / "bad.yaml"
    spec.write_text(
        "name: 'my job!'\n"
        "workload: {builtin: mlp, sede: 3}\n"
        "globl_batch: 64\n"
        "iterations: 10\n"
        "workers: 2\n"
        "polcy: {name: minmax}\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["jobs", "submit", str(spec), "--server", "http://127.0.0.1:9"])
    message = str(exc.value)
    assert "has 5 problems" in message
    assert "name: must start with a letter or digit" in message
    assert "workload.sede: unknown key; did you mean 'seed'?" in message
    assert "globl_batch: unknown key; did you mean 'global_batch'?" in message
    assert "polcy: unknown key; did you mean 'policy'?" in message
    assert "global_batch: is required" in message
    assert "^[" not in message  # no raw regular expression


def test_server_without_scheme_accepted_bad_scheme_refused(
    env: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    host_port = env.url.removeprefix("http://")
    assert main(["jobs", "list", "--server", host_port]) == 0
    with pytest.raises(SystemExit) as exc:
        main(["jobs", "list", "--server", "ftp://example"])
    assert exc.value.code == 2
    assert "not an http(s) address" in capsys.readouterr().err


@pytest.fixture
def html_server() -> Iterator[str]:
    """Something that is not Evenflow on a port: every path is an HTML 404 page."""

    class Handler(BaseHTTPRequestHandler):
        def _page(self) -> None:
            body = b"<html><body><h1>404 Not Found</h1>" + b"x" * 2000 + b"</body></html>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _page

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_wrong_server_one_line_and_agent_stops(
    html_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["jobs", "list", "--server", html_server, "--token", "ef_x"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "<html>" not in err
    assert "not an Evenflow API answer" in err
    with pytest.raises(SystemExit) as exc:  # refused at once, not retried every few seconds
        main(
            [
                "agent",
                "--server",
                html_server,
                "--token",
                "ef_x",
                "--name",
                "h",
                "--address",
                "127.0.0.1",
                "--cpu-workers",
                "1",
                "--workdir",
                str(tmp_path),
            ]
        )
    assert "not an Evenflow API answer" in str(exc.value)


def test_plan_override_events_watch_and_devices(
    env: LiveServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    http = make_http(env.url, env.admin_token)
    client = ApiClient(http)
    host = _cpu_host(client, "watch-host")
    long_name = "a-rather-long-job-name-that-does-not-fit-in-a-column-" + "z" * 40
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: {long_name}\nworkload: {{builtin: mlp}}\nglobal_batch: 64\niterations: 10\nworkers: 2\n"
    )
    job = _json(capsys, "jobs", "submit", str(spec))
    assert isinstance(job, dict)
    job_id = str(job["id"])
    # Listed once placed: a pending job's reason column would fold into the name's lines.
    wait_placed(http, f"/api/v1/jobs/{job_id}", int(job_id))

    assert main(["jobs", "list"]) == 0
    listed = capsys.readouterr().out
    assert "…" not in listed  # folded at 80 columns, never cut short
    assert max(len(line) for line in listed.splitlines()) <= 80
    assert _column(listed, "name", "status") == long_name
    assert re.search(r"\b\d\d-\d\d \d\d:\d\d\b", listed)  # the created time, whole

    assert main(["hosts", "list"]) == 0
    hosts = capsys.readouterr().out
    assert "watch-host" in hosts
    for device in host.devices:  # the ids a spec's devices: names
        assert f" {device.id} " in hosts

    assert main(["jobs", "plan", job_id]) == 0
    assert "plan v1" in capsys.readouterr().out

    args = ["jobs", "override", job_id, "set_batches", "--batches", "40,24", "--reason", "try"]
    assert main([*args, "--preview"]) == 0
    assert "would make plan v" in capsys.readouterr().out
    assert client.plan(int(job_id)).batch_sizes == [32, 32]  # type: ignore[union-attr]
    assert main(args) == 0
    assert "[40, 24]" in capsys.readouterr().out
    assert client.plan(int(job_id)).batch_sizes == [40, 24]  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as exc:
        main(["jobs", "override", job_id, "set_batches", "--batches", "4,x", "--reason", "r"])
    assert "--batches must be integers" in str(exc.value)

    events = _json(capsys, "jobs", "events", job_id)
    assert events == {"items": [], "total": 0}  # --json prints the API's page

    assert main(["jobs", "watch", job_id, "--count", "2", "--interval", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert all(line.startswith(f"job {job_id} starting") for line in lines)
    assert "plan v2 [40, 24]" in lines[-1]


def test_agent_refuses_an_address_that_does_not_resolve(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before this, such an agent registered and its jobs sat at the rendezvous for 10 minutes."""
    argv = ["agent", "--name", "no-such-host.invalid", "--cpu-workers", "1"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--workdir", str(tmp_path / "w")])
    assert exc.value.code not in (0, None)
    assert "'no-such-host.invalid' does not resolve" in str(exc.value)
    hosts = ApiClient(make_http(env.url, env.admin_token)).hosts().items
    assert not hosts, "nothing was registered"


def test_jobs_metrics_prints_the_latest_value_per_series(
    env: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from contract.agent import MetricBatch, MetricPoint

    monkeypatch.setenv("COLUMNS", "80")
    client = ApiClient(make_http(env.url, env.admin_token))
    _cpu_host(client, "metrics-host")
    job = client.submit(
        {
            "name": "m",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "iterations": 10,
            "workers": 2,
        }
    )
    assert main(["jobs", "metrics", str(job.id)]) in (0, None)
    assert "no metrics yet" in capsys.readouterr().out
    points = [MetricPoint(rank=0, iteration=i, name="loss", value=2.0 - 0.1 * i) for i in range(10)]
    points += [MetricPoint(rank=r, iteration=9, name="acc", value=0.5 + r / 10) for r in range(2)]
    assert client.post_metrics(job.id, MetricBatch(points=points)).accepted == 12
    main(["jobs", "metrics", str(job.id)])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("loss", "acc"))]
    assert rows == [
        ["acc", "0", "9", "0.5", "0.5", "0.5"],
        ["acc", "1", "9", "0.6", "0.6", "0.6"],
        ["loss", "0", "9", "1.1", "1.1", "2"],
    ]
    data = _json(capsys, "jobs", "metrics", str(job.id), "--name", "loss")
    assert isinstance(data, dict) and [s["name"] for s in data["series"]] == ["loss"]
    assert data["series"][0]["value"][0] == 2.0
    with pytest.raises(SystemExit, match="has no metric nope \\(it has: acc, loss\\)"):
        main(["jobs", "metrics", str(job.id), "--name", "nope"])
    capsys.readouterr()
    main(["jobs", "watch", str(job.id), "--count", "1"])
    assert "loss 1.1" in capsys.readouterr().out


def test_jobs_show_lists_restarts_and_jobs_checkpoints_lists_checkpoints(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = ApiClient(make_http(env.url, env.admin_token))
    host = _cpu_host(client, "cli-host")
    job = client.submit(
        {
            "name": "ft",
            "workload": {"builtin": "mlp"},
            "global_batch": 64,
            "iterations": 100,
            "workers": 2,
            "checkpoint": {"every_iterations": 10, "path": str(tmp_path)},
        }
    )
    r = client.http.post(
        f"/api/v1/jobs/{job.id}/checkpoints",
        json={"rank": 0, "iteration": 10, "size_bytes": 4096, "url": f"{tmp_path}/x.pt"},
        headers={"Authorization": f"Bearer {env.admin_token}"},
    )
    assert r.status_code == 201, r.text
    # brackets in a reason are text, not markup (a traceback's paths were a MarkupError)
    error = 'OOM killed in [/usr/lib/python3/x.py] at "[bold]"'
    report = WorkerReport(job_id=job.id, rank=1, state=WorkerState.FAILED, error=error)
    client.heartbeat(host.id, Heartbeat(workers=[report]))
    assert main(["jobs", "show", str(job.id)]) == 0
    out = capsys.readouterr().out
    assert "restarts" in out and f"rank 1 failed: {error}" in out
    assert "iteration 10" in out and "restarts: 1 of at most 3" in out
    listed = _json(capsys, "jobs", "checkpoints", str(job.id))
    assert isinstance(listed, dict) and [c["iteration"] for c in listed["items"]] == [10]
    assert main(["jobs", "checkpoints", str(job.id)]) == 0
    assert "4.0 KiB" in capsys.readouterr().out


def test_jobs_logs_prints_each_ranks_tail(
    env: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_token = (
        ApiClient(make_http(env.url, env.admin_token))
        .create_token(TokenCreate(name="agent-logs-host", role=Role.AGENT, host="logs-host"))
        .token
    )
    agent = ApiClient(make_http(env.url, agent_token))
    host = _cpu_host(agent, "logs-host")
    admin = ApiClient(make_http(env.url, env.admin_token))
    job = admin.submit(
        {
            "name": "dies",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "iterations": 5,
            "workers": 2,
            "max_restarts": 0,  # the failure ends the job
        }
    )
    assert _placed(admin, job.id).status.value == "starting"
    assert main(["jobs", "logs", str(job.id)]) == 0
    assert "no rank has ended yet" in capsys.readouterr().out
    reports = [
        WorkerReport(
            job_id=job.id,
            rank=1,
            state=WorkerState.FAILED,
            exit_code=1,
            error="RuntimeError: boom",
            log_tail="step 3\nRuntimeError: boom\n",
        ),
        WorkerReport(
            job_id=job.id, rank=0, state=WorkerState.STOPPED, exit_code=-15, log_tail="step 3\n"
        ),
    ]
    agent.heartbeat(host.id, Heartbeat(workers=reports))
    assert main(["jobs", "logs", str(job.id), "--follow"]) == 0  # the job ended: returns
    out = capsys.readouterr().out
    assert "rank 0 (stopped, exit -15)" in out and "rank 1 (failed, exit 1)" in out
    assert "RuntimeError: boom" in out
    assert main(["jobs", "logs", str(job.id), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1" in out and "rank 0" not in out
    assert main(["jobs", "logs", str(job.id), "--rank", "9"]) == 1
    assert "no rank 9" in capsys.readouterr().err


def test_jobs_logs_follow_prints_running_ranks_lines_once_as_they_come(
    env: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_token = (
        ApiClient(make_http(env.url, env.admin_token))
        .create_token(TokenCreate(name="agent-follow-host", role=Role.AGENT, host="follow-host"))
        .token
    )
    agent = ApiClient(make_http(env.url, agent_token))
    host = _cpu_host(agent, "follow-host")
    admin = ApiClient(make_http(env.url, env.admin_token))
    job = admin.submit(
        {"name": "chatty", "workload": {"builtin": "mlp"}, "global_batch": 8, "workers": 2}
        | {"iterations": 5}
    )
    assert _placed(admin, job.id).status.value == "starting"

    def beat(*reports: WorkerReport) -> list[object]:
        return [
            a.follow_log_until
            for a in agent.heartbeat(host.id, Heartbeat(workers=list(reports))).assignments
        ]

    def report(rank: int, state: WorkerState, log: str | None = None) -> WorkerReport:
        end = None if log is None else len(log.encode())
        return WorkerReport(job_id=job.id, rank=rank, state=state, log_tail=log, log_end=end)

    running = WorkerState.RUNNING
    assert beat(report(0, running), report(1, running)) == [None, None]  # nobody follows
    follower = threading.Thread(
        target=main, args=(["jobs", "logs", str(job.id), "--follow", "--interval", "0.05"],)
    )
    follower.start()
    deadline = time.monotonic() + 10
    while None in beat():  # the follow reaches the agent with its heartbeat's answer
        assert time.monotonic() < deadline
        time.sleep(0.05)
    log = "step 1\n"
    beat(report(0, running, log))
    time.sleep(0.3)
    log += "step 2 [bold]\n"
    beat(report(0, running, log))
    time.sleep(0.3)
    beat(report(0, WorkerState.SUCCEEDED, log + "done\n"), report(1, WorkerState.SUCCEEDED, "r1\n"))
    follower.join(timeout=20)
    assert not follower.is_alive()
    out = capsys.readouterr().out
    assert out.count("step 1") == 1 and out.count("step 2 [bold]") == 1, out
    assert "rank 0 | step 1" in out and "rank 0 | step 2 [bold]" in out
    end = out.index("rank 0 (succeeded")
    assert out.index("step 2") < end < out.index("done") and "r1" in out
    assert admin.job(job.id).status.value == "succeeded"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(
                st.text(st.characters(codec="utf-8", exclude_characters="\n\x00"), max_size=60)
            ),
            st.integers(1, 60),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_a_followers_new_lines_join_up_to_the_whole_log(
    rounds: list[tuple[list[str], int]],
) -> None:
    """However a log grows between two looks (by less than a tail holds), the new text of each
    tail, joined, is the log from the first tail on: no line lost, none twice."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "rank-0.log"
        path.write_bytes(b"")
        whole, printed, seen = b"", "", None
        for lines, repeat in rounds:
            chunk = "".join(f"{line}\n" for line in lines).encode() * repeat
            assume(len(chunk) < LOG_TAIL_CHARS - 512)
            whole += chunk
            with path.open("ab") as f:
                f.write(chunk)
            tail, end = _log_tail_at(path)
            assert end == len(whole)
            if tail is None:
                continue
            if seen is None:  # what the first tail left out
                printed = whole[: end - len(tail.encode())].decode()
            printed += new_log_text(tail, end, seen)
            seen = end
        assert printed == whole.decode()


def test_submit_with_a_context_ships_the_directory_once(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cpu_host(ApiClient(make_http(env.url, env.admin_token)), "ctx-host")
    code = tmp_path / "mytrain"
    (code / "mytrain").mkdir(parents=True)
    (code / "mytrain" / "__init__.py").write_text("")
    (code / "mytrain" / "main.py").write_text("def train(ctx):\n    pass\n")
    (code / "data").mkdir()
    (code / "data" / "huge.bin").write_bytes(b"x" * 10_000)
    (code / ".evenflowignore").write_text("data/\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: shipped\nworkload: {entrypoint: 'mytrain.main:train'}\n"
        "global_batch: 8\niterations: 5\nworkers: 1\n"
    )
    assert main(["jobs", "submit", str(spec), "--context", str(code)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"context \S*mytrain: 3 files, [\d.]+ K?i?B packed, uploaded", out), out
    admin = ApiClient(make_http(env.url, env.admin_token))
    (job,) = admin.jobs().items
    sha = job.spec["workload"]["context"]
    info = admin.context_info(sha)
    assert info is not None and info.size_bytes < 10_000  # data/ was left out
    assert main(["jobs", "submit", str(spec), "--context", str(code)]) == 0  # the same code
    assert "already on the server" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="nowhere does not exist"):
        main(["jobs", "submit", str(spec), "--context", str(tmp_path / "nowhere")])


def test_a_context_over_the_servers_limit_is_refused_naming_its_biggest_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'e.db'}", context_max_bytes=4096))
    with serving(app) as url:
        monkeypatch.setenv("EVENFLOW_SERVER", url)
        monkeypatch.setenv("EVENFLOW_TOKEN", ADMIN_TOKEN)
        code = tmp_path / "code"
        code.mkdir()
        (code / "weights.bin").write_bytes(os.urandom(20_000))  # does not compress
        (code / "train.py").write_text("def main(ctx):\n    pass\n")
        spec = tmp_path / "job.yaml"
        spec.write_text(
            "name: big\nworkload: {entrypoint: 'train:main'}\nglobal_batch: 8\n"
            "iterations: 5\nworkers: 1\n"
        )
        with pytest.raises(SystemExit) as exc:
            main(["jobs", "submit", str(spec), "--context", str(code)])
        message = str(exc.value)
        assert "over the server's limit of 4.0 KiB" in message
        assert "weights.bin (19.5 KiB)" in message and ".evenflowignore" in message
