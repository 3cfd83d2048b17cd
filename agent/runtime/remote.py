"""The runtime's two control-plane callables, over REST with an ``httpx.Client``.

This is only an adapter from the runtime's injected callables to HTTP; the agent's full client
lives in ``agent/client.py``. Endpoints (Bearer token)::

    GET  {server}/api/v1/jobs/{job_id}/plan?known_version=V&wait_s=W -> PlanOut (304: unchanged)
    POST {server}/api/v1/jobs/{job_id}/telemetry   TelemetryBatch -> TelemetryAck
    POST {server}/api/v1/jobs/{job_id}/metrics     MetricBatch -> MetricAck
    PUT  {server}/api/v1/jobs/{job_id}/rendezvous  RendezvousIn -> RendezvousOut (rank 0)
    GET  {server}/api/v1/jobs/{job_id}/rendezvous  -> RendezvousOut (port null until published)
    POST {server}/api/v1/jobs/{job_id}/checkpoints CheckpointReport -> CheckpointOut
    POST {server}/api/v1/jobs/{job_id}/artifacts   ArtifactReport -> ArtifactOut
    PUT  {server}/api/v1/jobs/{job_id}/artifacts/{id}/content   the file's bytes

``fetch_plan`` sends the version it last received as ``known_version`` (and ``If-None-Match``
with the last ETag, if the server gives one) and answers ``None`` on 304. With ``plan_wait_s``
it is a long-poll: the server holds the request until a newer plan is committed (then answers
at once) or ``plan_wait_s`` passes (then 304), so a new plan arrives within milliseconds
instead of a poll interval later; the request's read timeout is the client's plus
``plan_wait_s``. It raises on anything else that is not a 2xx. With ``telemetry_relay`` (the
agent's relay, ``agent.relay``: ``EVENFLOW_TELEMETRY_RELAY``) telemetry and metrics go there
instead, with the same bodies and credential; the relay keeps them on the host's disk before it
answers and posts a host's ranks in one batch per job. Everything else goes to the server (a
relay that cannot keep a batch answers 503, which the senders retry). ``post_telemetry`` raises on
failure, which makes the telemetry sender retry, except that it raises ``TelemetryClosed`` when
the job has ended (409, or 401: the rank's credential died with its job), which stops the
rank; ``post_metrics`` likewise. All run on the runtime's background threads, never in the
loop.

``publish_port`` and ``lookup_port`` carry rank 0's rendezvous port (chosen when it binds) to
the other ranks before the process group exists; they raise ``TelemetryClosed`` too once the
job has ended.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from agent.client import Timeouts, long_poll_timeout, timeout_arg
from agent.runtime.checkpoint import Saved
from agent.runtime.telemetry import TelemetryClosed
from contract.agent import (
    ArtifactReport,
    CheckpointReport,
    MetricAck,
    MetricBatch,
    PlanOut,
    RendezvousIn,
    RendezvousOut,
    TelemetryAck,
    TelemetryBatch,
)
from contract.base import MAX_PLAN_WAIT_S


class RemoteControlPlane:
    """``fetch_plan``, ``post_telemetry`` and ``post_metrics`` for one job, bound to a client,
    a server and a token."""

    def __init__(
        self,
        client: httpx.Client,
        server: str,
        token: str,
        job_id: int,
        *,
        plan_wait_s: float = 0.0,
        telemetry_relay: str | None = None,
    ) -> None:
        if not 0 <= plan_wait_s <= MAX_PLAN_WAIT_S:
            raise ValueError(f"plan_wait_s must be within 0..{MAX_PLAN_WAIT_S}")
        self._client = client
        self.plan_wait_s = plan_wait_s
        base = f"{server.rstrip('/')}/api/v1/jobs/{job_id}"
        self.plan_url = f"{base}/plan"
        relay = f"{telemetry_relay.rstrip('/')}/api/v1/jobs/{job_id}" if telemetry_relay else base
        self.telemetry_url = f"{relay}/telemetry"
        self.metrics_url = f"{relay}/metrics"
        self.rendezvous_url = f"{base}/rendezvous"
        self.checkpoints_url = f"{base}/checkpoints"
        self.artifacts_url = f"{base}/artifacts"
        self._auth = {"Authorization": f"Bearer {token}"}
        self._etag: str | None = None
        self._version: int | None = None

    def fetch_plan(self) -> PlanOut | None:
        """The job's current plan; ``None`` when the server says it has not changed (after
        waiting up to ``plan_wait_s`` for a newer one)."""
        headers = dict(self._auth)
        if self._etag is not None:
            headers["If-None-Match"] = self._etag
        params: dict[str, int | float] = {}
        timeout: Timeouts | None = None
        if self._version is not None:
            params["known_version"] = self._version
            if self.plan_wait_s > 0:
                params["wait_s"] = self.plan_wait_s
                timeout = long_poll_timeout(self._client, self.plan_wait_s)
        response = self._client.get(
            self.plan_url, params=params, headers=headers, **timeout_arg(timeout)
        )
        if response.status_code == httpx.codes.NOT_MODIFIED:
            return None
        response.raise_for_status()
        plan = PlanOut.model_validate_json(response.content)
        self._etag = response.headers.get("ETag")
        self._version = plan.version
        return plan

    def post_telemetry(self, batch: TelemetryBatch) -> TelemetryAck:
        """Send one batch; raises ``httpx.HTTPError`` on failure (the sender retries)."""
        response = self._client.post(
            self.telemetry_url,
            content=batch.wire_json(),  # the columnar form: half the bytes to send and parse
            headers={**self._auth, "Content-Type": "application/json"},
        )
        _raise_for(response)
        return TelemetryAck.model_validate_json(response.content)

    def post_metrics(self, batch: MetricBatch) -> MetricAck:
        """Send metric points; raises ``httpx.HTTPError`` on failure (the sender retries)."""
        response = self._client.post(
            self.metrics_url,
            content=batch.model_dump_json(),
            headers={**self._auth, "Content-Type": "application/json"},
        )
        _raise_for(response)
        return MetricAck.model_validate_json(response.content)

    def publish_port(self, port: int) -> None:
        """Rank 0: the port its rendezvous store listens on."""
        response = self._client.put(
            self.rendezvous_url,
            content=RendezvousIn(port=port).model_dump_json(),
            headers={**self._auth, "Content-Type": "application/json"},
        )
        _raise_for(response)

    def lookup_port(self) -> int | None:
        """Rank 0's rendezvous port, or None while it has not published one."""
        response = self._client.get(self.rendezvous_url, headers=self._auth)
        _raise_for(response)
        return RendezvousOut.model_validate_json(response.content).port

    def report_checkpoint(self, rank: int, saved: Saved) -> None:
        """Tell the control plane of a checkpoint this rank wrote; raises on failure."""
        body = CheckpointReport(
            rank=rank,
            iteration=saved.iteration,
            size_bytes=saved.size_bytes,
            url=saved.url,
            write_ms=round(saved.write_ms, 3),
        )
        response = self._client.post(
            self.checkpoints_url,
            content=body.model_dump_json(),
            headers={**self._auth, "Content-Type": "application/json"},
        )
        _raise_for(response)

    def report_artifact(self, body: ArtifactReport) -> int:
        """Tell the control plane of a file this rank left; the artifact's id."""
        response = self._client.post(
            self.artifacts_url,
            content=body.model_dump_json(),
            headers={**self._auth, "Content-Type": "application/json"},
        )
        _raise_for(response)
        return int(response.json()["id"])

    def upload_artifact(self, artifact_id: int, path: str, size: int) -> None:
        """Upload the bytes of a reported artifact from this host's disk, a MiB at a time."""

        def pieces() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while piece := f.read(1 << 20):
                    yield piece

        response = self._client.put(
            f"{self.artifacts_url}/{artifact_id}/content",
            content=pieces(),
            headers={
                **self._auth,
                "Content-Type": "application/octet-stream",
                "Content-Length": str(size),
            },
            timeout=(30.0, 600.0, 600.0, 30.0),
        )
        if response.status_code == httpx.codes.REQUEST_ENTITY_TOO_LARGE:
            raise RuntimeError(f"not kept by the control plane: {_detail(response)}")
        _raise_for(response)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code in (httpx.codes.CONFLICT, httpx.codes.UNAUTHORIZED):
        raise TelemetryClosed(_detail(response))
    response.raise_for_status()


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text or response.reason_phrase
