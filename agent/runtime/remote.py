"""The runtime's two control-plane callables, over REST with an ``httpx.Client``.

This is only an adapter from the runtime's injected callables to HTTP; the agent's full client
lives in ``agent/client.py``. Endpoints (Bearer token)::

    GET  {server}/api/v1/jobs/{job_id}/plan        -> PlanOut     (304 when unchanged)
    POST {server}/api/v1/jobs/{job_id}/telemetry   TelemetryBatch -> TelemetryAck

``fetch_plan`` sends ``If-None-Match`` with the last ETag the server gave (if it gives one) and
answers ``None`` on 304, so a server that supports it can skip re-sending an unchanged plan; it
raises on anything else that is not a 2xx. ``post_telemetry`` raises on failure, which makes the
telemetry sender retry. Both run on the runtime's background threads, never in the loop.
"""

from __future__ import annotations

import httpx

from agent.wire import PlanOut, TelemetryAck, TelemetryBatch


class RemoteControlPlane:
    """``fetch_plan`` and ``post_telemetry`` for one job, bound to a client, server and token."""

    def __init__(self, client: httpx.Client, server: str, token: str, job_id: int) -> None:
        self._client = client
        base = f"{server.rstrip('/')}/api/v1/jobs/{job_id}"
        self.plan_url = f"{base}/plan"
        self.telemetry_url = f"{base}/telemetry"
        self._auth = {"Authorization": f"Bearer {token}"}
        self._etag: str | None = None

    def fetch_plan(self) -> PlanOut | None:
        """The job's current plan; ``None`` when the server says it has not changed."""
        headers = dict(self._auth)
        if self._etag is not None:
            headers["If-None-Match"] = self._etag
        response = self._client.get(self.plan_url, headers=headers)
        if response.status_code == httpx.codes.NOT_MODIFIED:
            return None
        response.raise_for_status()
        plan = PlanOut.model_validate_json(response.content)
        self._etag = response.headers.get("ETag")
        return plan

    def post_telemetry(self, batch: TelemetryBatch) -> TelemetryAck:
        """Send one batch; raises ``httpx.HTTPError`` on failure (the sender retries)."""
        response = self._client.post(
            self.telemetry_url,
            content=batch.model_dump_json(),
            headers={**self._auth, "Content-Type": "application/json"},
        )
        response.raise_for_status()
        return TelemetryAck.model_validate_json(response.content)
