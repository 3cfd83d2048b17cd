"""What a job left: ranks report their files and upload copies of those on their hosts' disks;
people list them and download the copies; the server keeps a bounded amount per job."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from contract.enums import Role
from server.app import create_app
from tests.harness import Api, driven, make_settings

LIMIT = 64 * 1024


@pytest.fixture
def small(db_url: str) -> Iterator[Api]:
    """An API whose jobs keep at most ``LIMIT`` bytes of artifacts on the server."""
    with TestClient(create_app(make_settings(db_url, artifact_max_bytes=LIMIT))) as client:
        yield driven(client)


def report(api: Api, job_id: int, token: str | None = None, **body: Any) -> Any:
    fields = {"rank": 0, "name": "final.pt", "size_bytes": 10, "url": "/w/job/final.pt", **body}
    return api.client.post(
        f"/api/v1/jobs/{job_id}/artifacts",
        json=fields,
        headers=api.headers(token) if token else api.headers(),
    )


def put(api: Api, job_id: int, artifact_id: int, data: bytes, token: str | None = None) -> Any:
    return api.client.put(
        f"/api/v1/jobs/{job_id}/artifacts/{artifact_id}/content",
        content=data,
        headers={**(api.headers(token) if token else api.headers()), "Content-Type": "x/y"},
    )


def test_a_rank_reports_its_files_uploads_copies_and_people_download_them(small: Api) -> None:
    api = small
    host = api.register("h1", devices=2)
    job = api.submit(workers=2, global_batch=8)
    model = os.urandom(20_000)
    r = report(api, job["id"], host["_token"], size_bytes=len(model))
    assert r.status_code == 201, r.text
    final = r.json()
    assert (final["host"], final["stored"], final["attempt"]) == ("h1", False, 0)
    got = api.client.get(
        f"/api/v1/jobs/{job['id']}/artifacts/{final['id']}/content", headers=api.headers()
    )
    assert got.status_code == 404 and "on host h1 at /w/job/final.pt" in got.json()["detail"]
    r = put(api, job["id"], final["id"], model, host["_token"])
    assert r.status_code == 200 and r.json()["stored"] is True
    got = api.client.get(
        f"/api/v1/jobs/{job['id']}/artifacts/{final['id']}/content", headers=api.headers()
    )
    assert got.status_code == 200 and got.content == model
    assert 'filename="final.pt"' in got.headers["content-disposition"]
    shared = report(
        api, job["id"], rank=1, name="out/m.json", url="s3://b/job-1/out/m.json", shared=True
    )
    assert shared.status_code == 201 and shared.json()["host"] is None
    r = put(api, job["id"], shared.json()["id"], b"{}")
    assert r.status_code == 422 and "shared storage" in r.json()["detail"]
    listed = api.client.get(f"/api/v1/jobs/{job['id']}/artifacts", headers=api.headers()).json()
    assert [(a["rank"], a["name"], a["stored"]) for a in listed["items"]] == [
        (0, "final.pt", True),
        (1, "out/m.json", False),
    ]


def test_a_job_keeps_a_bounded_amount_and_bad_reports_are_refused(small: Api) -> None:
    api = small
    host = api.register("h1", devices=1)
    other = api.register("h2", devices=1)
    job = api.submit(workers=1, global_batch=8)
    one = report(api, job["id"], host["_token"], name="a.bin", size_bytes=LIMIT - 100).json()
    assert put(api, job["id"], one["id"], bytes(LIMIT - 100)).status_code == 200
    two = report(api, job["id"], host["_token"], name="b.bin", size_bytes=1000).json()
    r = put(api, job["id"], two["id"], bytes(1000))
    assert r.status_code == 413 and f"at most {LIMIT} bytes" in r.json()["detail"]
    r = put(api, job["id"], one["id"], bytes(LIMIT + 1))  # past the limit at the gate too
    assert r.status_code == 413
    r = put(api, job["id"], two["id"], bytes(10))  # not the size it was reported at
    assert r.status_code == 422 and "was reported as 1000 bytes, 10 came" in r.json()["detail"]
    for name in ("../up.bin", "/abs.bin", "a/../../b"):
        r = report(api, job["id"], name=name)
        assert r.status_code == 422 and r.json()["field"] == "name", name
    r = report(api, job["id"], other["_token"])  # another host's agent: not its rank
    assert r.status_code == 403
    viewer = api.token(Role.VIEWER)
    assert report(api, job["id"], viewer).status_code == 403
    r = api.client.get(f"/api/v1/jobs/{job['id']}/artifacts", headers=api.headers(viewer))
    assert r.status_code == 200 and r.json()["total"] == 2  # reading is a viewer's
