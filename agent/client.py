"""A typed client of the REST API v1, used by the agent, the workers' runtime and the CLI.

It takes an ``httpx.Client`` so tests hand it the server's ``TestClient`` (an ``httpx.Client``)
and talk to the real app in-process, without sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

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
    ArtifactOut,
    AuditOut,
    CheckpointOut,
    ContextOut,
    EventOut,
    HostOut,
    JobOut,
    ModelOut,
    OverrideCreate,
    OverrideOut,
    Page,
    RankLogOut,
    TelemetryOut,
    TokenCreate,
    TokenCreated,
    TokenOut,
)
from contract.base import MAX_PAGE
from contract.dashboard import MetricsOut, SeriesOut, ThroughputOut
from contract.spec import JobSpec

API = "/api/v1"

T = TypeVar("T")


class ApiError(Exception):
    """The server answered with an error; ``detail`` is its message, ``field`` the culprit."""

    def __init__(self, status_code: int, detail: str, field: str | None = None) -> None:
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail, self.field = status_code, detail, field


def make_http(server: str, token: str | None, *, timeout: float = 10.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout)


Timeouts = tuple[float | None, float | None, float | None, float | None]
"""A request's own (connect, read, write, pool) timeouts. A tuple, not an ``httpx.Timeout``,
and no ``timeout=`` at all for the client's own: the same calls then also work through a test's
Starlette ``TestClient``, which is built on ``httpx2`` (whose ``Timeout`` and "client default"
sentinel are its own) once that is installed."""


def long_poll_timeout(client: httpx.Client, wait_s: float) -> Timeouts:
    """The client's timeouts with the read timeout extended by ``wait_s``: a long-poll's
    server may hold the request that long before it starts answering."""
    t = client.timeout
    read = None if t.read is None else t.read + wait_s
    return (t.connect, read, t.write, t.pool)


def timeout_arg(timeout: Timeouts | None) -> dict[str, Any]:
    """``timeout=`` for a request: none for the client's own."""
    return {} if timeout is None else {"timeout": timeout}


def _not_ours(resp: httpx.Response) -> str:
    """One line for an answer that is not the API's JSON (a proxy's or another server's page)."""
    kind = resp.headers.get("content-type", "no content type").split(";")[0]
    return (
        f"{resp.reason_phrase or 'error'} ({kind}) from {resp.request.url}: "
        "not an Evenflow API answer; is the server address right?"
    )


def _error(resp: httpx.Response) -> ApiError:
    try:
        body = resp.json()
        detail, field = str(body.get("detail", resp.text)), body.get("field")
    except ValueError:
        detail, field = _not_ours(resp), None
    return ApiError(resp.status_code, detail, field)


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
        timeout: Timeouts | None = None,
        content: Any = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        resp = self.http.request(
            method,
            API + path,
            json=json,
            params=params,
            headers={**self._headers, **(headers or {})},
            content=content,
            **timeout_arg(timeout),
        )
        if resp.status_code not in ok:
            raise _error(resp)
        return resp

    def _page(
        self,
        path: str,
        item: type[T],
        params: dict[str, Any] | None = None,
        *,
        limit: int | None,
        offset: int = 0,
        method: str = "GET",
    ) -> Page[T]:
        """One page of a list endpoint (``limit`` items from ``offset``), or with ``limit``
        None every item from ``offset`` on, read page by page (``total`` is the server's count
        at the last page: items added while it reads may be missed or seen twice)."""
        model = Page[item]  # type: ignore[valid-type]
        query = dict(params or {})
        items: list[T] = []
        while True:
            want = MAX_PAGE if limit is None else limit - len(items)
            query.update(limit=min(want, MAX_PAGE), offset=offset + len(items))
            page: Page[T] = model.model_validate(self._call(method, path, params=query).json())
            items += page.items
            done = limit is not None and len(items) >= limit
            if done or not page.items or offset + len(items) >= page.total:
                return Page[item](items=items, total=page.total)  # type: ignore[valid-type]

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

    def hosts(self, *, limit: int | None = None, offset: int = 0) -> Page[HostOut]:
        """Hosts by id (all of them unless ``limit``)."""
        return self._page("/hosts", HostOut, limit=limit, offset=offset)

    # -- contexts
    def upload_context(
        self, archive: Path, sha256: str, on_sent: Callable[[int], object] | None = None
    ) -> ContextOut:
        """Upload a code archive, streamed from the file a MiB at a time (``on_sent(bytes)``
        after each); the server checks its digest."""

        def pieces() -> Iterator[bytes]:
            with archive.open("rb") as f:
                while piece := f.read(1 << 20):
                    yield piece
                    if on_sent is not None:
                        on_sent(len(piece))

        resp = self._call(
            "POST",
            "/contexts",
            content=pieces(),
            headers={
                "X-Evenflow-Sha256": sha256,
                "Content-Type": "application/octet-stream",
                "Content-Length": str(archive.stat().st_size),
            },
            timeout=(self.http.timeout.connect, 300.0, 300.0, 30.0),
        )
        return ContextOut.model_validate(resp.json())

    def context_info(self, sha256: str) -> ContextOut | None:
        """The stored archive of that digest, or None when there is none."""
        resp = self._call("GET", f"/contexts/{sha256}/info", ok=(200, 404))
        return None if resp.status_code == 404 else ContextOut.model_validate(resp.json())

    def context_bytes(self, sha256: str) -> Iterator[bytes]:
        """A code archive's bytes as they arrive (a generator: the request is made when the
        first piece is asked for, and closed when the caller stops)."""
        return self._bytes(f"/contexts/{sha256}")

    # -- artifacts
    def artifacts(self, job_id: int) -> Page[ArtifactOut]:
        """Every file a job left, by rank and name."""
        return self._page(f"/jobs/{job_id}/artifacts", ArtifactOut, limit=None)

    def artifact_bytes(self, job_id: int, artifact_id: int) -> Iterator[bytes]:
        """The bytes of an artifact the server holds a copy of, as they arrive."""
        return self._bytes(f"/jobs/{job_id}/artifacts/{artifact_id}/content")

    def _bytes(self, path: str) -> Iterator[bytes]:
        """A download's bytes, a MiB at a time, streamed (read timeout 300 s)."""
        with self.http.stream(
            "GET",
            API + path,
            headers=self._headers,
            timeout=(self.http.timeout.connect, 300.0, 30.0, 30.0),
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                raise _error(resp)
            yield from resp.iter_bytes(1 << 20)

    # -- jobs
    def submit(self, spec: JobSpec | dict[str, Any]) -> JobOut:
        body = (
            spec.model_dump(mode="json", exclude_none=True) if isinstance(spec, JobSpec) else spec
        )
        return JobOut.model_validate(self._call("POST", "/jobs", json=body).json())

    def jobs(
        self, *, status: str | None = None, limit: int | None = 100, offset: int = 0
    ) -> Page[JobOut]:
        """Jobs, newest first (``limit`` None: all of them)."""
        params = {"status": status} if status else {}
        return self._page("/jobs", JobOut, params, limit=limit, offset=offset)

    def job(self, job_id: int) -> JobOut:
        return JobOut.model_validate(self._call("GET", f"/jobs/{job_id}").json())

    def cancel(self, job_id: int) -> JobOut:
        return JobOut.model_validate(self._call("POST", f"/jobs/{job_id}/cancel").json())

    def logs(self, job_id: int, rank: int | None = None) -> Page[RankLogOut]:
        """Every rank's end (one rank's, with ``rank``)."""
        params = {} if rank is None else {"rank": rank}
        return self._page(f"/jobs/{job_id}/logs", RankLogOut, params, limit=None)

    def follow_logs(self, job_id: int, rank: int | None = None) -> Page[RankLogOut]:
        """``logs``, with the running ranks' live tails uploaded for the next 30 s."""
        params = {} if rank is None else {"rank": rank}
        return self._page(
            f"/jobs/{job_id}/logs/follow", RankLogOut, params, limit=None, method="POST"
        )

    # -- plans
    def plan(
        self, job_id: int, known_version: int | None = None, wait_s: float = 0.0
    ) -> PlanOut | None:
        """The current plan, or None when it is still ``known_version``; with ``wait_s``, a
        long-poll: the answer comes as soon as a newer plan exists, or None after ``wait_s``
        (at most 30; the read timeout is extended by it)."""
        params: dict[str, Any] | None = None
        timeout: Timeouts | None = None
        if known_version is not None:
            params = {"known_version": known_version}
            if wait_s > 0:
                params["wait_s"] = wait_s
                timeout = long_poll_timeout(self.http, wait_s)
        resp = self._call(
            "GET", f"/jobs/{job_id}/plan", params=params, ok=(200, 304), timeout=timeout
        )
        return None if resp.status_code == 304 else PlanOut.model_validate(resp.json())

    def checkpoints(
        self, job_id: int, *, limit: int | None = 100, offset: int = 0
    ) -> Page[CheckpointOut]:
        """A job's checkpoints, newest first."""
        path = f"/jobs/{job_id}/checkpoints"
        return self._page(path, CheckpointOut, limit=limit, offset=offset)

    def plans(self, job_id: int, *, limit: int | None = None, offset: int = 0) -> Page[PlanOut]:
        """A job's plans, newest first (all of them unless ``limit``)."""
        return self._page(f"/jobs/{job_id}/plans", PlanOut, limit=limit, offset=offset)

    # -- telemetry
    def post_telemetry(self, job_id: int, batch: TelemetryBatch) -> TelemetryAck:
        body = batch.columnar().model_dump(mode="json", exclude_none=True)
        resp = self._call("POST", f"/jobs/{job_id}/telemetry", json=body)
        return TelemetryAck.model_validate(resp.json())

    def telemetry(
        self,
        job_id: int,
        *,
        since_iteration: int = 0,
        rank: int | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> Page[TelemetryOut]:
        """A job's timings from ``since_iteration`` on, by iteration and rank (all of them
        unless ``limit``)."""
        params: dict[str, Any] = {"since_iteration": since_iteration}
        if rank is not None:
            params["rank"] = rank
        path = f"/jobs/{job_id}/telemetry"
        return self._page(path, TelemetryOut, params, limit=limit, offset=offset)

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

    def models(self, job_id: int) -> Page[ModelOut]:
        """Each rank's fitted performance model, by rank."""
        return self._page(f"/jobs/{job_id}/models", ModelOut, limit=None)

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
    def events(self, job_id: int, *, limit: int | None = None, offset: int = 0) -> Page[EventOut]:
        """A job's straggler events, newest first (all of them unless ``limit``)."""
        return self._page(f"/jobs/{job_id}/events", EventOut, limit=limit, offset=offset)

    def overrides(
        self, job_id: int, *, limit: int | None = None, offset: int = 0
    ) -> Page[OverrideOut]:
        """Overrides applied to a job, newest first (all of them unless ``limit``)."""
        return self._page(f"/jobs/{job_id}/overrides", OverrideOut, limit=limit, offset=offset)

    def override(self, job_id: int, req: OverrideCreate) -> OverrideOut:
        resp = self._call(
            "POST", f"/jobs/{job_id}/overrides", json=req.model_dump(mode="json", exclude_none=True)
        )
        return OverrideOut.model_validate(resp.json())

    def audit(
        self, *, target: str | None = None, limit: int | None = 100, offset: int = 0
    ) -> Page[AuditOut]:
        """Who did what, newest first."""
        params = {"target": target} if target else {}
        return self._page("/audit", AuditOut, params, limit=limit, offset=offset)

    # -- tokens
    def create_token(self, req: TokenCreate) -> TokenCreated:
        resp = self._call("POST", "/tokens", json=req.model_dump(mode="json", exclude_none=True))
        return TokenCreated.model_validate(resp.json())

    def tokens(self, *, limit: int | None = None, offset: int = 0) -> Page[TokenOut]:
        """Tokens by id, revoked ones included (all of them unless ``limit``)."""
        return self._page("/tokens", TokenOut, limit=limit, offset=offset)

    def revoke_token(self, token_id: int) -> TokenOut:
        return TokenOut.model_validate(self._call("DELETE", f"/tokens/{token_id}").json())
