"""A typed client of the REST API v1, used by the agent, the workers' runtime and the CLI.

It takes an ``httpx.Client`` so tests hand it the server's ``TestClient`` (an ``httpx.Client``)
and talk to the real app in-process, without sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from contract.agent import (
    Heartbeat,
    HeartbeatAck,
    HostRegister,
    MetricAck,
    MetricBatch,
    PlanOut,
    TelemetryAck,
    TelemetryBatch,
)
from contract.api import (
    AuditOut,
    CheckpointOut,
    EventOut,
    HostOut,
    JobList,
    JobOut,
    ModelOut,
    OverrideCreate,
    OverrideOut,
    RankLogOut,
    TelemetryOut,
    TokenCreate,
    TokenCreated,
    TokenOut,
)
from contract.dashboard import MetricsOut, SeriesOut, ThroughputOut
from contract.spec import JobSpec

API = "/api/v1"


class ApiError(Exception):
    """The server answered with an error; ``detail`` is its message, ``field`` the culprit."""

    def __init__(self, status_code: int, detail: str, field: str | None = None) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail, self.field = status_code, detail, field


def make_http(server: str, token: str | None, *, timeout: float = 10.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout)


def long_poll_timeout(client: httpx.Client, wait_s: float) -> httpx.Timeout:
    """The client's timeouts with the read timeout extended by ``wait_s``: a long-poll's
    server may hold the request that long before it starts answering."""
    t = client.timeout
    read = None if t.read is None else t.read + wait_s
    return httpx.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool)


def _not_ours(resp: httpx.Response) -> str:
    """One line for an answer that is not the API's JSON (a proxy's or another server's page)."""
    kind = resp.headers.get("content-type", "no content type").split(";")[0]
    return (
        f"{resp.reason_phrase or 'error'} ({kind}) from {resp.request.url}: "
        "not an Evenflow API answer; is the server address right?"
    )


class ApiClient:
    def __init__(self, http: httpx.Client, token: str | None = None) -> None:
        self.http = http
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    # -- plumbing
    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        ok: tuple[int, ...] = (200, 201),
        timeout: Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        resp = self.http.request(
            method, API + path, json=json, params=params, headers=self._headers, timeout=timeout
        )
        if resp.status_code not in ok:
            try:
                body = resp.json()
                detail, field = str(body.get("detail", resp.text)), body.get("field")
            except ValueError:
                detail, field = _not_ours(resp), None
            raise ApiError(resp.status_code, detail, field)
        return resp

    # -- health
    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = self._call("GET", "/health").json()
        return data

    # -- hosts
    def register_host(self, req: HostRegister) -> HostOut:
        return HostOut.model_validate(
            self._call("POST", "/hosts/register", json=req.model_dump(mode="json")).json()
        )

    def heartbeat(self, host_id: int, hb: Heartbeat) -> HeartbeatAck:
        resp = self._call("POST", f"/hosts/{host_id}/heartbeat", json=hb.model_dump(mode="json"))
        return HeartbeatAck.model_validate(resp.json())

    def hosts(self) -> list[HostOut]:
        return [HostOut.model_validate(h) for h in self._call("GET", "/hosts").json()]

    # -- jobs
    def submit(self, spec: JobSpec | dict[str, Any]) -> JobOut:
        body = (
            spec.model_dump(mode="json", exclude_none=True) if isinstance(spec, JobSpec) else spec
        )
        return JobOut.model_validate(self._call("POST", "/jobs", json=body).json())

    def jobs(self, *, status: str | None = None, limit: int = 100) -> JobList:
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        return JobList.model_validate(self._call("GET", "/jobs", params=params).json())

    def job(self, job_id: int) -> JobOut:
        return JobOut.model_validate(self._call("GET", f"/jobs/{job_id}").json())

    def cancel(self, job_id: int) -> JobOut:
        return JobOut.model_validate(self._call("POST", f"/jobs/{job_id}/cancel").json())

    def logs(self, job_id: int, rank: int | None = None) -> list[RankLogOut]:
        params = {} if rank is None else {"rank": rank}
        resp = self._call("GET", f"/jobs/{job_id}/logs", params=params)
        return [RankLogOut.model_validate(r) for r in resp.json()]

    # -- plans
    def plan(
        self, job_id: int, known_version: int | None = None, wait_s: float = 0.0
    ) -> PlanOut | None:
        """The current plan, or None when it is still ``known_version``; with ``wait_s``, a
        long-poll: the answer comes as soon as a newer plan exists, or None after ``wait_s``
        (at most 30; the read timeout is extended by it)."""
        params: dict[str, Any] | None = None
        timeout: Any = httpx.USE_CLIENT_DEFAULT
        if known_version is not None:
            params = {"known_version": known_version}
            if wait_s > 0:
                params["wait_s"] = wait_s
                timeout = long_poll_timeout(self.http, wait_s)
        resp = self._call(
            "GET", f"/jobs/{job_id}/plan", params=params, ok=(200, 304), timeout=timeout
        )
        return None if resp.status_code == 304 else PlanOut.model_validate(resp.json())

    def checkpoints(self, job_id: int, *, limit: int = 100) -> list[CheckpointOut]:
        resp = self._call("GET", f"/jobs/{job_id}/checkpoints", params={"limit": limit})
        return [CheckpointOut.model_validate(c) for c in resp.json()]

    def plans(self, job_id: int) -> list[PlanOut]:
        return [
            PlanOut.model_validate(p) for p in self._call("GET", f"/jobs/{job_id}/plans").json()
        ]

    # -- telemetry
    def post_telemetry(self, job_id: int, batch: TelemetryBatch) -> TelemetryAck:
        body = batch.columnar().model_dump(mode="json", exclude_none=True)
        resp = self._call("POST", f"/jobs/{job_id}/telemetry", json=body)
        return TelemetryAck.model_validate(resp.json())

    def telemetry(
        self, job_id: int, *, since_iteration: int = 0, limit: int = 10_000
    ) -> list[TelemetryOut]:
        resp = self._call(
            "GET",
            f"/jobs/{job_id}/telemetry",
            params={"since_iteration": since_iteration, "limit": limit},
        )
        return [TelemetryOut.model_validate(r) for r in resp.json()]

    def post_metrics(self, job_id: int, batch: MetricBatch) -> MetricAck:
        resp = self._call("POST", f"/jobs/{job_id}/metrics", json=batch.model_dump(mode="json"))
        return MetricAck.model_validate(resp.json())

    def metrics(
        self,
        job_id: int,
        *,
        points: int = 500,
        names: Sequence[str] | None = None,
        rank: int | None = None,
    ) -> MetricsOut:
        """The job's training metrics, at most ``points`` per (name, rank)."""
        params: dict[str, Any] = {"points": points}
        if names:
            params["names"] = ",".join(names)
        if rank is not None:
            params["rank"] = rank
        resp = self._call("GET", f"/jobs/{job_id}/metrics", params=params)
        return MetricsOut.model_validate(resp.json())

    def models(self, job_id: int) -> list[ModelOut]:
        return [
            ModelOut.model_validate(m) for m in self._call("GET", f"/jobs/{job_id}/models").json()
        ]

    # -- dashboard figures
    def series(self, job_id: int, *, points: int = 50, window: int = 20) -> SeriesOut:
        resp = self._call(
            "GET", f"/jobs/{job_id}/series", params={"points": points, "window": window}
        )
        return SeriesOut.model_validate(resp.json())

    def throughput(self, job_id: int) -> ThroughputOut:
        resp = self._call("GET", "/dashboard/throughput", params={"ids": str(job_id)})
        return ThroughputOut.model_validate(resp.json()[0])

    # -- events, overrides, audit
    def events(self, job_id: int) -> list[EventOut]:
        return [
            EventOut.model_validate(e) for e in self._call("GET", f"/jobs/{job_id}/events").json()
        ]

    def override(self, job_id: int, req: OverrideCreate) -> OverrideOut:
        resp = self._call(
            "POST", f"/jobs/{job_id}/overrides", json=req.model_dump(mode="json", exclude_none=True)
        )
        return OverrideOut.model_validate(resp.json())

    def audit(self, *, target: str | None = None, limit: int = 100) -> list[AuditOut]:
        params: dict[str, Any] = {"limit": limit}
        if target:
            params["target"] = target
        return [
            AuditOut.model_validate(a) for a in self._call("GET", "/audit", params=params).json()
        ]

    # -- tokens
    def create_token(self, req: TokenCreate) -> TokenCreated:
        resp = self._call("POST", "/tokens", json=req.model_dump(mode="json", exclude_none=True))
        return TokenCreated.model_validate(resp.json())

    def tokens(self) -> list[TokenOut]:
        return [TokenOut.model_validate(t) for t in self._call("GET", "/tokens").json()]

    def revoke_token(self, token_id: int) -> TokenOut:
        return TokenOut.model_validate(self._call("DELETE", f"/tokens/{token_id}").json())
