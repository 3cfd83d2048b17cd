"""A job's ranks are all on one device kind (one process group, one backend), and rank 0's
rendezvous port is chosen by rank 0 and published with its own credential."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.enums import DeviceKind, Role
from server.models import Device
from server.planner import FreeDevice, JobRequest
from server.services import scheduler
from tests.api.test_scheduler import _devices_of, _host, _ids
from tests.harness import Api


def _rank_tokens(api: Api, host: dict[str, Any]) -> dict[tuple[int, int], str]:
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": []},
        headers=api.headers(str(host["_token"])),
    )
    assert r.status_code == 200, r.text
    return {
        (a["job_id"], a["rank"]): a["worker_token"]
        for a in r.json()["assignments"]
        if a["worker_token"] is not None
    }


def test_a_job_is_never_placed_across_cpu_and_cuda_devices(api: Api) -> None:
    gpu = _host(api, "gpu", ["NVIDIA A100-SXM4-80GB"])
    cpu = _host(api, "cpu", ["CPU", "CPU"], kind="cpu")
    spec = {"name": "across", "workload": {"builtin": "mlp"}, "global_batch": 8, "iterations": 9}
    r = api.client.post("/api/v1/jobs", json={**spec, "workers": 3}, headers=api.headers())
    assert r.status_code == 422, r.text  # 3 devices, but only 2 of one kind: never placeable
    assert "cpu: 2 on cpu; cuda: 1 on gpu" in r.json()["detail"]
    two = api.submit(workers=2, max_workers=3, priority=5)  # takes one kind, never both
    assert _devices_of(api, two) == _ids(cpu, 0, 1)
    one = api.submit(workers=1)
    assert _devices_of(api, one) == _ids(gpu, 0)


def test_explicit_devices_of_both_kinds_are_refused_with_422(api: Api) -> None:
    gpu = _host(api, "gpu", ["NVIDIA A100-SXM4-80GB"])
    cpu = _host(api, "cpu", ["CPU"], kind="cpu")
    ids = [gpu["devices"][0]["id"], cpu["devices"][0]["id"]]
    spec = {
        "name": "mixed",
        "workload": {"builtin": "mlp"},
        "global_batch": 8,
        "iterations": 10,
        "devices": ids,
    }
    r = api.client.post("/api/v1/jobs", json=spec, headers=api.headers())
    assert r.status_code == 422, r.text
    body = r.json()
    assert "devices" in str(body) and "cpu" in body["detail"] and "cuda" in body["detail"]
    assert api.client.get("/api/v1/jobs", headers=api.headers()).json()["total"] == 0


def test_rank0_publishes_its_port_and_the_other_ranks_read_it(api: Api) -> None:
    host = api.register("host-a", devices=2)
    job = api.submit(workers=2)
    hb = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": []},
        headers=api.headers(str(host["_token"])),
    ).json()
    assert {a["master_port"] for a in hb["assignments"]} == {0}, "rank 0 chooses the port"
    tokens = _rank_tokens(api, host)
    url = f"/api/v1/jobs/{job['id']}/rendezvous"
    rank0, rank1 = (api.headers(tokens[(job["id"], r)]) for r in (0, 1))
    r = api.client.get(url, headers=rank1)
    assert r.status_code == 200 and r.json() == {
        "job_id": job["id"],
        "address": "127.0.0.1",
        "port": None,
    }
    for who in (rank1, api.headers(), api.headers(api.token(Role.OPERATOR))):
        r = api.client.put(url, json={"port": 4242}, headers=who)
        assert r.status_code == 403, r.text
        assert "rank 0 worker credential" in r.json()["detail"]
    for bad in ({"port": 0}, {"port": 70000}, {"port": "x"}, {}):
        assert api.client.put(url, json=bad, headers=rank0).status_code == 422
    assert api.client.put(url, json={"port": 4242}, headers=rank0).json()["port"] == 4242
    assert api.client.put(url, json={"port": 4242}, headers=rank0).status_code == 200
    r = api.client.put(url, json={"port": 4243}, headers=rank0)
    assert r.status_code == 409 and "already 4242" in r.json()["detail"]
    assert api.client.get(url, headers=rank1).json()["port"] == 4242
    other = api.submit(workers=1)  # pending: no device left
    r = api.client.get(f"/api/v1/jobs/{other['id']}/rendezvous", headers=rank1)
    assert r.status_code == 403
    api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=api.headers())
    r = api.client.get(url, headers=api.headers())
    assert r.status_code == 409 and "has ended" in r.json()["detail"]


DEVICES = st.lists(
    st.tuples(
        st.sampled_from(["cpu", "cuda"]),
        st.integers(0, 3),  # host
        st.sampled_from(["NVIDIA A100-SXM4-80GB", "Tesla T4", "CPU"]),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=40, deadline=None)
@given(devices=DEVICES, workers=st.integers(1, 6), extra=st.integers(0, 4))
def test_placement_never_mixes_kinds_and_finds_one_kind_that_fits(
    devices: list[tuple[str, int, str]], workers: int, extra: int
) -> None:
    by_id = {
        i + 1: Device(id=i + 1, host_id=h, index=i, kind=DeviceKind(k), model=m, memory_mb=1024)
        for i, (k, h, m) in enumerate(devices)
    }
    cands = [
        FreeDevice(id=d.id, host=str(d.host_id), model=d.model, samples_per_s=10.0 + d.id)
        for d in by_id.values()
    ]
    request = JobRequest(id="j", min_workers=workers, max_workers=workers + extra)
    placement = scheduler._best_of_kinds(request, cands, by_id)
    counts = {k: sum(1 for d in by_id.values() if d.kind == k) for k in DeviceKind}
    if placement is None:
        assert max(counts.values()) < workers
        return
    kinds = {by_id[int(d)].kind for d in placement.device_ids}
    assert len(kinds) == 1
    assert workers <= len(placement.device_ids) <= workers + extra
