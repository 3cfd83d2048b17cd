"""Every list endpoint answers ``{items, total}`` and pages by the same ``limit`` and ``offset``.

Found from the OpenAPI document, so a list endpoint added later is checked without being named
here; a GET answering a bare array fails unless it is one of the chart endpoints below."""

from __future__ import annotations

from typing import Any

from contract.base import MAX_PAGE
from tests.harness import Api

NOT_LISTS = {"/api/v1/dashboard/throughput"}
"""Answers exactly one figure per job id the request names (at most 100), in their order:
a batch lookup, not a collection to page through."""


def _ok_schema(operation: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of an operation's 200 answer ({} for bytes: an archive, an artifact)."""
    content = operation["responses"]["200"].get("content", {})
    schema: dict[str, Any] = content.get("application/json", {}).get("schema", {})
    return schema


def _list_endpoints(api: Api) -> dict[str, dict[str, Any]]:
    """The GET operations answering a ``Page`` (``Page_JobOut_`` and so on: items and total)."""
    document = api.client.app.openapi()  # type: ignore[attr-defined]
    schemas = document["components"]["schemas"]

    def is_page(schema: dict[str, Any]) -> bool:
        ref = schema.get("$ref", "").removeprefix("#/components/schemas/")
        return set(schemas.get(ref, {}).get("properties", {})) == {"items", "total"}

    return {
        path: ops["get"]
        for path, ops in document["paths"].items()
        if "get" in ops and "200" in ops["get"]["responses"] and is_page(_ok_schema(ops["get"]))
    }


def _concrete(path: str, job: int, host: int) -> str:
    return path.replace("{job_id}", str(job)).replace("{host_id}", str(host))


def test_no_get_answers_a_bare_list(api: Api) -> None:
    paths = api.client.app.openapi()["paths"]  # type: ignore[attr-defined]
    bare = [
        path
        for path, ops in paths.items()
        if "get" in ops and "200" in ops["get"]["responses"]
        if _ok_schema(ops["get"]).get("type") == "array"
    ]
    assert sorted(bare) == sorted(NOT_LISTS)


def test_every_list_endpoint_pages_alike(api: Api) -> None:
    api.register("h", devices=2)
    job = int(api.submit(workers=2)["id"])
    api.place()
    lists = _list_endpoints(api)
    assert len(lists) >= 11, sorted(lists)  # hosts, jobs, tokens, audit and a job's seven
    for path, operation in lists.items():
        params = {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "query"}
        assert params["limit"]["schema"]["maximum"] == MAX_PAGE, path
        assert params["limit"]["schema"]["default"] == 100, path
        assert params["offset"]["schema"]["minimum"] == 0, path
        url = _concrete(path, job, 1)
        over = api.client.get(url, params={"limit": MAX_PAGE + 1}, headers=api.headers())
        assert over.status_code == 422 and over.json()["field"] == "limit", (path, over.text)
        assert str(MAX_PAGE) in over.json()["detail"], over.text
        every = api.client.get(url, headers=api.headers())
        assert every.status_code == 200, (path, every.text)
        body = every.json()
        assert set(body) == {"items", "total"} and body["total"] == len(body["items"]), path
        if body["total"] >= 2:
            second = api.client.get(url, params={"limit": 1, "offset": 1}, headers=api.headers())
            assert second.json() == {"items": body["items"][1:2], "total": body["total"]}, path


def test_total_counts_past_the_page(api: Api) -> None:
    for i in range(5):
        api.register(f"h{i}", devices=1)
    r = api.client.get("/api/v1/hosts", params={"limit": 2, "offset": 3}, headers=api.headers())
    assert r.status_code == 200
    page = r.json()
    assert page["total"] == 5 and [h["name"] for h in page["items"]] == ["h3", "h4"]
    past = api.client.get("/api/v1/hosts", params={"offset": 9}, headers=api.headers()).json()
    assert past == {"items": [], "total": 5}
