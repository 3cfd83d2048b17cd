"""The agent's telemetry relay against the real app: workers post to the relay over a real
socket (as ``agent.runtime.remote`` does), the relay posts to the app in-process, and the
agent's loop is driven with the scripted launcher of ``test_agent_loop``. The relay keeps what
it acknowledges in a spool on disk: a relay started over a dead one's spool posts it."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from agent.backoff import Backoff
from agent.client import ApiClient
from agent.daemon import Agent, discover_devices
from agent.launcher import ProcessExit
from agent.relay import RELAY_ENV, TelemetryRelay
from agent.runtime.remote import RemoteControlPlane
from agent.runtime.telemetry import TelemetryClosed
from agent.spool import HEADER, Spool
from contract.agent import (
    Heartbeat,
    HeartbeatAck,
    MetricBatch,
    MetricPoint,
    TelemetryAck,
    TelemetryBatch,
    WorkerReport,
)
from contract.base import MAX_TELEMETRY_RECORDS
from contract.enums import JobStatus, Role, WorkerState
from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster
from server.context import context_of
from tests.agent.test_agent_loop import ScriptedLauncher
from tests.harness import Api, telemetry_record, until

RANKS = 8


class CountingPost:
    """The relay's post to the app, counted, and failing (as a server that is down) while
    ``down`` is set."""

    def __init__(self, client: ApiClient) -> None:
        self.client = client
        self.posts: list[tuple[int, int, bool]] = []  # (job, rows, urgent) of each post made
        self.failures = 0
        self.down = False

    def __call__(self, job_id: int, batch: TelemetryBatch) -> TelemetryAck:
        if self.down:
            self.failures += 1
            raise httpx.ConnectError("connection refused")
        # counted before it is sent: a test that sees the rows stored sees the post counted
        self.posts.append((job_id, len(batch.all_records()), batch.urgent))
        try:
            return self.client.post_telemetry(job_id, batch)
        except Exception:
            self.posts.pop()
            raise


@pytest.fixture
def relayed(
    api: Api, tmp_path: Path
) -> Iterator[tuple[Agent, ScriptedLauncher, CountingPost, Callable[..., TelemetryRelay]]]:
    """An agent of 8 devices; ``make_relay(**kw)`` gives it a started relay posting through a
    ``CountingPost`` (closed at the end)."""
    token = api.token(Role.AGENT, host="host-a")
    client = ApiClient(api.client, token)
    post = CountingPost(client)
    launcher = ScriptedLauncher()
    agent = Agent(
        client,
        name="host-a",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=RANKS),
        server_url="http://testserver",
        token=token,
        workdir=tmp_path,
        launcher=launcher,
    )
    agent.register()

    def make_relay(**kw: Any) -> TelemetryRelay:
        kw = {"flush_s": 3600.0, "post_metrics": client.post_metrics, **kw}
        kw.setdefault("spool", Spool(tmp_path / "spool" / "host-a"))
        agent.relay = TelemetryRelay(post, **kw)
        agent.relay.start()
        return agent.relay

    yield agent, launcher, post, make_relay
    if agent.relay is not None:
        post.down = False
        agent.relay.close(timeout_s=5)


def _running_job(api: Api, agent: Agent, launcher: ScriptedLauncher) -> int:
    job_id = int(api.submit(workers=RANKS, max_restarts=0)["id"])  # type: ignore[call-overload]
    agent.tick()  # launches the ranks
    agent.tick()  # reports them running
    assert len(launcher.specs) == RANKS
    return job_id


def _worker(launcher: ScriptedLauncher, job_id: int, rank: int) -> RemoteControlPlane:
    """What a launched rank's runtime builds from its environment."""
    env = launcher.specs[launcher.pid(job_id, rank)].env
    assert env[RELAY_ENV].startswith("http://127.0.0.1:")
    return RemoteControlPlane(
        httpx.Client(timeout=5.0),
        "http://server.invalid",  # anything but telemetry would fail: it must not be used
        env["EVENFLOW_TOKEN"],
        job_id,
        telemetry_relay=env[RELAY_ENV],
    )


def _batch(rank: int, iterations: range, urgent: bool = False) -> TelemetryBatch:
    return TelemetryBatch(
        records=[telemetry_record(rank, i) for i in iterations],
        urgent=urgent,
    )


def _stored(api: Api, job_id: int) -> int:
    r = api.client.get(f"/api/v1/jobs/{job_id}/telemetry?limit=1", headers=api.headers())
    assert r.status_code == 200, r.text
    return int(r.json()["total"])


def _server_posts(api: Api) -> int:
    return _server_posts_of(api.client.app)  # type: ignore[arg-type]


def _server_posts_of(app: FastAPI) -> int:
    """Telemetry posts the app answered 200, from its own request counters."""
    registry = context_of(app).metrics.requests
    return int(
        sum(
            s.value
            for family in registry.collect()
            for s in family.samples
            if s.name.endswith("_total")
            and s.labels["method"] == "POST"
            and s.labels["route"].endswith("/telemetry")
            and s.labels["status"] == "200"
        )
    )


def test_eight_ranks_batches_reach_the_server_as_one_post(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    before = _server_posts(api)
    for rank in range(RANKS):
        ack = _worker(launcher, job_id, rank).post_telemetry(_batch(rank, range(4)))
        assert (ack.accepted, ack.duplicates) == (4, 0)  # answered at once, from the buffer
    assert _stored(api, job_id) == 0 and relay.pending(job_id) == RANKS * 4
    assert relay.flush_all()
    assert post.posts == [(job_id, RANKS * 4, False)]
    assert _server_posts(api) - before == 1
    assert _stored(api, job_id) == RANKS * 4


def test_the_flusher_posts_on_its_cadence_and_splits_at_the_contract_limit(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, post, make_relay = relayed
    relay = make_relay(flush_s=0.2)
    job_id = _running_job(api, agent, launcher)
    rows = MAX_TELEMETRY_RECORDS + 10
    for start in range(0, rows, 4000):
        _worker(launcher, job_id, 3).post_telemetry(
            _batch(3, range(start, min(rows, start + 4000)))
        )
    until(lambda: _stored(api, job_id) == rows)
    sizes = [n for _, n, _ in post.posts]
    assert sum(sizes) == rows and max(sizes) <= MAX_TELEMETRY_RECORDS and len(sizes) <= 3
    assert relay.pending() == 0


def test_an_urgent_batch_is_posted_at_once_and_marked_urgent(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, post, make_relay = relayed
    make_relay()  # an hour's cadence: only urgency posts
    job_id = _running_job(api, agent, launcher)
    _worker(launcher, job_id, 1).post_telemetry(_batch(1, range(3)))
    _worker(launcher, job_id, 2).post_telemetry(_batch(2, range(3), urgent=True))
    until(lambda: _stored(api, job_id) == 6, timeout_s=5)
    assert post.posts == [(job_id, 6, True)]


def test_a_foreign_or_wrong_token_is_refused_and_stores_nothing(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    env = launcher.specs[launcher.pid(job_id, 0)].env
    url = f"{env[RELAY_ENV]}/api/v1/jobs/{job_id}/telemetry"
    body = _batch(0, range(2)).wire_json()
    other_host = api.token(Role.AGENT, host="host-b")
    for token in (f"efw_{uuid.uuid4().hex}", other_host, agent.token):  # not handed to a rank
        r = httpx.post(url, content=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 403 and "detail" in r.json()
    rank1 = launcher.specs[launcher.pid(job_id, 1)].env["EVENFLOW_TOKEN"]
    r = httpx.post(url, content=body, headers={"Authorization": f"Bearer {rank1}"})
    assert r.status_code == 403 and "rank 1 may not post rank 0" in r.json()["detail"]
    r = httpx.post(
        url.replace(f"/jobs/{job_id}/", f"/jobs/{job_id + 1}/"),
        content=body,
        headers={"Authorization": f"Bearer {env['EVENFLOW_TOKEN']}"},
    )
    assert r.status_code == 403
    assert httpx.post(url, content=body).status_code == 401
    r = httpx.post(
        url,
        content=b'{"records": []}',
        headers={"Authorization": f"Bearer {env['EVENFLOW_TOKEN']}"},
    )
    assert r.status_code == 422
    assert relay.pending() == 0 and relay.flush_all()
    assert post.posts == [] and _stored(api, job_id) == 0


def test_a_ranks_rows_reach_the_server_before_the_heartbeat_reporting_its_end(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, post, make_relay = relayed
    make_relay()  # an hour's cadence: only the agent's own flush posts
    job_id = _running_job(api, agent, launcher)
    seen: list[tuple[list[tuple[int, WorkerState]], int]] = []
    heartbeat = agent.client.heartbeat

    def watched(host_id: int, hb: Heartbeat) -> HeartbeatAck:
        seen.append(([(w.rank, w.state) for w in hb.workers], _stored(api, job_id)))
        return heartbeat(host_id, hb)

    agent.client.heartbeat = watched  # type: ignore[method-assign]
    _worker(launcher, job_id, 5).post_telemetry(_batch(5, range(10)))
    launcher.end(job_id, 5, ProcessExit(code=0))
    post.down = True  # the rows cannot go: the end is held back, not reported before them
    agent.tick()
    assert seen[-1] == ([], 0)
    post.down = False
    agent.tick()
    assert seen[-1] == ([(5, WorkerState.SUCCEEDED)], 10)
    job = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers()).json()
    assert {w["rank"]: w["state"] for w in job["workers"]}[5] == "succeeded"


def test_rows_posted_while_the_server_is_down_get_there_once_it_is_back(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, post, make_relay = relayed
    make_relay(flush_s=0.1, backoff=Backoff(0.05, 0.2))
    job_id = _running_job(api, agent, launcher)
    post.down = True
    for rank in (0, 7):
        _worker(launcher, job_id, rank).post_telemetry(_batch(rank, range(5)))
    until(lambda: post.failures >= 3)
    assert _stored(api, job_id) == 0
    post.down = False
    until(lambda: _stored(api, job_id) == 10)


def test_a_full_job_buffer_refuses_a_batch_rather_than_drop_acknowledged_rows(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, _post, make_relay = relayed
    relay = make_relay(max_rows=6)
    job_id = _running_job(api, agent, launcher)
    worker = _worker(launcher, job_id, 0)
    worker.post_telemetry(_batch(0, range(4)))
    with pytest.raises(httpx.HTTPStatusError) as refused:  # the sender keeps it and retries
        worker.post_telemetry(_batch(0, range(4, 8)))
    assert refused.value.response.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "2"
    assert relay.pending(job_id) == 4 and relay.rows_dropped == 0
    assert relay.flush_all()
    worker.post_telemetry(_batch(0, range(4, 8)))  # room again
    assert relay.flush_all()
    r = api.client.get(f"/api/v1/jobs/{job_id}/telemetry", headers=api.headers()).json()
    assert sorted(row["iteration"] for row in r["items"]) == list(range(8))


def _die(relay: TelemetryRelay) -> None:
    """What ``kill -9`` leaves of a relay: its endpoint gone, nothing flushed, the spool's
    files as they are."""
    with relay._cond:
        relay._closing = True
        relay._cond.notify_all()
    assert relay._server is not None
    relay._server.shutdown()
    relay._server.server_close()
    assert relay.spool is not None
    relay.spool.close()


def _points(api: Api, job_id: int) -> dict[tuple[str, int], list[int]]:
    r = api.client.get(f"/api/v1/jobs/{job_id}/metrics", headers=api.headers())
    assert r.status_code == 200, r.text
    return {(s["name"], s["rank"]): s["iteration"] for s in r.json()["series"]}


def _metric_batch(rank: int, iterations: range) -> MetricBatch:
    return MetricBatch(
        points=[MetricPoint(rank=rank, iteration=i, name="acc", value=0.5) for i in iterations]
    )


def test_what_a_dead_relay_acknowledged_is_posted_by_the_next_before_anything_else(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any], tmp_path: Path
) -> None:
    agent, launcher, post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    for rank in (0, 3):
        worker = _worker(launcher, job_id, rank)
        assert worker.post_telemetry(_batch(rank, range(5))).accepted == 5
        assert worker.post_metrics(_metric_batch(rank, range(5))).accepted == 5
    _die(relay)
    assert _stored(api, job_id) == 0 and _points(api, job_id) == {}
    post.posts.clear()
    again = make_relay()  # over the same spool, as a restarted agent's
    assert again.recovered == 20
    assert post.posts == [(job_id, 10, False)]  # in start(), before serving a worker; then
    # the metric points, in their own post (CountingPost counts the telemetry posts)
    assert _stored(api, job_id) == 10
    assert _points(api, job_id) == {("acc", 0): [0, 1, 2, 3, 4], ("acc", 3): [0, 1, 2, 3, 4]}
    assert again.pending() == 0 and list((tmp_path / "spool" / "host-a").iterdir()) == []


def test_a_torn_tail_of_the_spool_is_dropped_and_the_rest_posted(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any], tmp_path: Path
) -> None:
    agent, launcher, _post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    _worker(launcher, job_id, 1).post_telemetry(_batch(1, range(6)))
    _die(relay)
    (segment,) = (tmp_path / "spool" / "host-a").iterdir()
    with segment.open("ab") as f:
        f.write(b"EFS1\x00\x00\x01")  # the agent died in the middle of a header
    again = make_relay()
    assert again.spool is not None and again.spool.torn == 1
    assert _stored(api, job_id) == 6 and again.pending() == 0


def test_a_full_spool_answers_503_and_the_worker_keeps_its_rows(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any], tmp_path: Path
) -> None:
    agent, launcher, _post, make_relay = relayed
    first, four = (HEADER.size + len(_batch(2, range(n)).wire_json()) for n in (2, 4))
    relay = make_relay(spool=Spool(tmp_path / "small", max_bytes=first + four))
    job_id = _running_job(api, agent, launcher)
    worker = _worker(launcher, job_id, 2)
    worker.post_telemetry(_batch(2, range(2)))
    with pytest.raises(httpx.HTTPStatusError) as refused:
        worker.post_telemetry(_batch(2, range(2, 12)))
    assert refused.value.response.status_code == 503
    assert "bound" in refused.value.response.json()["detail"]
    assert relay.pending(job_id) == 2 and relay.refused == 1
    assert relay.flush_all()  # the server took them: the spool has room again
    worker.post_telemetry(_batch(2, range(2, 6)))
    assert relay.flush_all() and _stored(api, job_id) == 6


def test_a_spool_of_a_job_that_ended_meanwhile_is_dropped_with_a_log_line(
    api: Api,
    relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "evenflow.agent.relay")
    agent, launcher, _post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    _worker(launcher, job_id, 4).post_telemetry(_batch(4, range(3)))
    _die(relay)
    r = api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers())
    assert r.status_code in (200, 202), r.text
    again = make_relay()
    assert again.pending() == 0 and again.rows_dropped == 3
    assert list((tmp_path / "spool" / "host-a").iterdir()) == []  # never grows for it
    assert f"job {job_id} takes no more" in caplog.text


def test_an_ended_jobs_rows_are_dropped_and_its_workers_told(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    agent, launcher, _post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    worker = _worker(launcher, job_id, 2)
    worker.post_telemetry(_batch(2, range(3)))
    r = api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers())
    assert r.status_code in (200, 202), r.text
    assert relay.flush(job_id) and relay.pending() == 0  # 409: dropped, not retried
    with pytest.raises(TelemetryClosed):
        worker.post_telemetry(_batch(2, range(3, 5)))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_real_job_posts_through_its_agents_relay(tmp_path: Path) -> None:
    """The whole local stack: four gloo ranks on one agent post to its relay, the server gets
    fewer posts than the ranks made (one per job and flush), and every row."""
    iterations = 60
    spec = JobSpec.model_validate(
        {
            "name": "relayed",
            "workload": {"builtin": "mlp", "seed": 1},
            "global_batch": 64,
            "iterations": iterations,
            "workers": 4,
            "policy": {"name": "equal"},
            "emulation": [{"per_sample_ms": 5.0}] * 4,  # ~5 s: several flushes
        }
    )
    with LocalCluster(tmp_path, workers=4, agents=1) as cluster:
        before = _server_posts_of(cluster.app)
        job = cluster.submit(spec)
        done = cluster.wait(job.id, timeout_s=240)
        assert done.status is JobStatus.SUCCEEDED, done.error
        server_posts = _server_posts_of(cluster.app) - before
        stored = cluster.client.telemetry(job.id, limit=1).total
    jobdir = tmp_path / "local-a" / f"job-{job.id}"
    results = [json.loads((jobdir / f"rank-{r}.result.json").read_text()) for r in range(4)]
    worker_posts = sum(r["telemetry"]["posts"] for r in results)
    assert stored == 4 * iterations  # every rank's every row, flushed before its end
    assert all(r["telemetry"]["delivered"] == iterations for r in results)
    assert server_posts >= 1 and 2 * server_posts <= worker_posts, (server_posts, worker_posts)


def test_a_host_that_never_comes_back_loses_only_what_its_relay_took_since_its_last_post(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any], tmp_path: Path
) -> None:
    """The bound for a host whose disk is gone with it: the server lacks exactly what the relay
    acknowledged since its last post (at most one flush interval of rows), nothing older."""
    agent, launcher, _post, make_relay = relayed
    relay = make_relay()
    job_id = _running_job(api, agent, launcher)
    worker = _worker(launcher, job_id, 6)
    worker.post_telemetry(_batch(6, range(10)))
    assert relay.flush_all()  # the flusher's post
    worker.post_telemetry(_batch(6, range(10, 13)))
    _die(relay)  # and the host's disk with it: the spool is never read again
    r = api.client.get(f"/api/v1/jobs/{job_id}/telemetry", headers=api.headers()).json()
    assert sorted(row["iteration"] for row in r["items"]) == list(range(10))
    spool = Spool(tmp_path / "spool" / "host-a")
    assert [(key, len(payload) > 0) for key, payload in spool.recover(lambda k, p: 3)] == [
        ((job_id, "telemetry"), True)
    ]  # what was lost is what the spool held: the rows since the last post


def test_a_rank_reported_without_a_process_waits_for_its_jobs_rows_too(
    api: Api, relayed: tuple[Agent, ScriptedLauncher, CountingPost, Any]
) -> None:
    """A rank the agent reports without having run it (its predecessor did: a restarted
    agent's report) is held back like an ended rank while its job's spooled rows cannot go."""
    agent, launcher, post, make_relay = relayed
    make_relay()
    job_id = _running_job(api, agent, launcher)
    seen: list[tuple[list[tuple[int, WorkerState]], int]] = []
    heartbeat = agent.client.heartbeat

    def watched(host_id: int, hb: Heartbeat) -> HeartbeatAck:
        seen.append(([(w.rank, w.state) for w in hb.workers], _stored(api, job_id)))
        return heartbeat(host_id, hb)

    agent.client.heartbeat = watched  # type: ignore[method-assign]
    _worker(launcher, job_id, 5).post_telemetry(_batch(5, range(10)))
    agent.pending.append(
        WorkerReport(job_id=job_id, rank=5, state=WorkerState.FAILED, error="gone", exit_code=5)
    )
    post.down = True
    agent.tick()
    assert seen[-1] == ([], 0) and len(agent.pending) == 1
    post.down = False
    agent.tick()
    assert seen[-1] == ([(5, WorkerState.FAILED)], 10) and agent.pending == []
