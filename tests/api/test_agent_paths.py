"""The fast paths against the plain path (``server.scale``), side by side: whatever happens, the
same heartbeats and telemetry posts get the same answers and leave the same rows."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from contract.enums import Role
from server.app import create_app
from server.context import AppContext, context_of
from server.db import transaction
from server.models import Host, IterationTelemetry
from server.scale.fast import FastPaths
from server.scale.plain import PlainPaths
from server.services import hosts
from tests.harness import FLEET_HOSTS, Api, driven, host_histories, make_settings, placement_rows

HOSTS = FLEET_HOSTS
OPS = host_histories(
    st.tuples(st.just("telemetry"), st.integers(0, 3)),
    st.tuples(st.just("bad"), st.sampled_from([b"{not json", b'{"workers": 3}', b""])),
    max_size=12,
)
"""What happens, and (for reports, beats and posts) on which host's agent."""


@contextmanager
def _two_apps(tmp: str) -> Iterator[tuple[Api, Api]]:
    with ExitStack() as stack:
        apis = []
        for fast in (True, False):
            url = f"sqlite:///{Path(tmp) / f'{fast}.db'}"
            client = stack.enter_context(
                TestClient(create_app(make_settings(url, fast_paths=fast)))
            )
            apis.append(driven(client))
        yield apis[0], apis[1]


def _context(api: Api) -> AppContext:
    return context_of(api.client.app)  # type: ignore[arg-type]


def test_the_setting_picks_the_paths() -> None:
    with tempfile.TemporaryDirectory() as tmp, _two_apps(tmp) as (fast, plain):
        assert isinstance(_context(fast).paths, FastPaths)
        assert isinstance(_context(plain).paths, PlainPaths)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_the_fast_paths_answer_and_store_what_the_plain_path_does(
    ops: list[tuple[str, Any, str]],
) -> None:
    """Jobs placed over two hosts, cancelled, ended or failed by reports, restarted when their
    hosts are taken for lost; heartbeats repeated, with fewer reports, quiet or malformed;
    telemetry posted by the hosts' agents: each request's status and body are the same on both
    paths (a launch credential, a fresh secret each time, compared by its presence), and so
    are the ranks, jobs, devices, hosts' states and telemetry rows they leave."""
    with tempfile.TemporaryDirectory() as tmp, _two_apps(tmp) as (fast, plain):
        sides = [_Side(fast), _Side(plain)]
        for op, arg, on in ops:
            outcomes = [side.do(op, arg, on) for side in sides]
            assert outcomes[0] == outcomes[1], (op, arg, on)
        assert _stored(fast) == _stored(plain)


class _Side:
    """One app driven through the operations, with what its agents report."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.hosts = {  # tokens named alike on both sides: refusals name them
            name: api.register(name, 2, api.token(Role.AGENT, host=name, name=f"agent-{name}"))
            for name in HOSTS
        }
        self.jobs: list[int] = []
        self.reports: dict[str, list[dict[str, Any]]] = {name: [] for name in HOSTS}
        self.iteration = 0

    def do(self, op: str, arg: Any, on: str) -> list[tuple[int, Any]]:
        api, report = self.api, self.reports[on]
        if op == "submit":
            self.jobs.append(int(api.submit(workers=arg, max_restarts=5)["id"]))
        elif op == "cancel" and arg < len(self.jobs):
            api.client.post(f"/api/v1/jobs/{self.jobs[arg]}/cancel", headers=api.headers())
        elif op == "report" and report:
            self.reports[on] = [{**report[0], "state": arg}, *report[1:]]
        elif op == "fewer":
            self.reports[on] = report[1:]
        elif op == "quiet":
            self.reports[on] = []
        elif op == "lost":
            context = _context(api)
            with context.write_lock, transaction(context.sessions) as s:
                hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=600), after_s=30)
        elif op == "telemetry":
            return [self._post(on, arg)]
        elif op == "bad":
            return [self._send(on, arg)]
        return [self._beat(name) for name in (HOSTS if op != "beat" else [on])]

    def _send(self, name: str, raw: bytes) -> tuple[int, Any]:
        host = self.hosts[name]
        r = self.api.client.post(
            f"/api/v1/hosts/{host['id']}/heartbeat",
            content=raw,
            headers={**self.api.headers(str(host["_token"])), "Content-Type": "application/json"},
        )
        return r.status_code, r.json()

    def _beat(self, name: str) -> tuple[int, Any]:
        host, sent = self.hosts[name], self.reports[name]
        r = self.api.client.post(
            f"/api/v1/hosts/{host['id']}/heartbeat",
            json={"workers": sent},
            headers=self.api.headers(str(host["_token"])),
        )
        body = r.json()
        if r.status_code == 200:
            self.reports[name] = [
                {
                    "job_id": a["job_id"],
                    "rank": a["rank"],
                    "state": "running",
                    "attempt": a["attempt"],
                }
                for a in body["assignments"]
                if a["desired"] == "run"
            ] or sent
            for a in body["assignments"]:
                a["worker_token"] = a.get("worker_token") is not None
        return r.status_code, body

    def _post(self, name: str, job: int) -> tuple[int, Any]:
        """One iteration of every rank the host's agent runs of the job (a rank it does not
        run, when it runs none: refused)."""
        if job >= len(self.jobs):
            return 0, None
        job_id = self.jobs[job]
        ranks = [r["rank"] for r in self.reports[name] if r["job_id"] == job_id] or [0]
        self.iteration += 1
        n = len(ranks)
        columns = {
            "rank": ranks,
            "iteration": [self.iteration] * n,
            "plan_version": [1] * n,
            "batch_size": [8] * n,
            "data_ms": [1.0] * n,
            "compute_ms": [10.0] * n,
            "sync_ms": [2.0] * n,
            "ts": [1_700_000_000.0] * n,
        }
        r = self.api.client.post(
            f"/api/v1/jobs/{job_id}/telemetry",
            json={"columns": columns},
            headers=self.api.headers(str(self.hosts[name]["_token"])),
        )
        return r.status_code, r.json()


def _stored(api: Api) -> tuple[list[Any], ...]:
    """The ranks, jobs and devices, the hosts' states and each job's telemetry rows."""
    with _context(api).sessions() as s:
        hosts_ = [tuple(r) for r in s.execute(select(Host.id, Host.status).order_by(Host.id))]
        rows = select(IterationTelemetry.job_id, func.count()).group_by(IterationTelemetry.job_id)
        telemetry = [tuple(r) for r in s.execute(rows.order_by(IterationTelemetry.job_id))]
        return (*placement_rows(s), hosts_, telemetry)
