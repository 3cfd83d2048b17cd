"""Per-token caps and what the server gives out: live streams per token, and the API docs
without any other host."""

from __future__ import annotations

import re
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
from hypothesis import given
from hypothesis import strategies as st

from contract.enums import Role
from server.app import create_app
from server.context import context_of
from server.live import StreamSlots
from tests.harness import ADMIN_TOKEN, Api, make_settings, register_host, serving

# --------------------------------------------------------------------------- live streams


def test_live_streams_per_token_are_capped_and_given_back(tmp_path: Path) -> None:
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'e.db'}", max_streams_per_token=2))
    slots = context_of(app).stream_slots
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        api_headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        register_host(url, ADMIN_TOKEN)
        job = client.post(
            "/api/v1/jobs",
            json={
                "name": "j",
                "workload": {"builtin": "mlp"},
                "global_batch": 8,
                "iterations": 1,
                "workers": 1,
            },
            headers=api_headers,
        ).json()["id"]
        other = client.post(
            "/api/v1/tokens", json={"name": "v", "role": Role.VIEWER.value}, headers=api_headers
        ).json()["token"]
        path = f"/api/v1/jobs/{job}/stream?max_s=60"
        with ExitStack() as open_streams:
            for _ in range(2):
                r = open_streams.enter_context(client.stream("GET", path, headers=api_headers))
                assert r.status_code == 200
            refused = client.get(path, headers=api_headers)
            assert refused.status_code == 429
            detail = refused.json()["detail"]
            assert "already holds 2 live streams" in detail and "MAX_STREAMS_PER_TOKEN" in detail
            # Another token has slots of its own.
            with client.stream("GET", path, headers={"Authorization": f"Bearer {other}"}) as r:
                assert r.status_code == 200
        # The client went away: the server notices and gives both slots back.
        deadline = time.monotonic() + 20
        while slots.held():
            assert time.monotonic() < deadline, "the slots were not given back"
            time.sleep(0.1)
        with client.stream("GET", path.replace("60", "0.2"), headers=api_headers) as r:
            assert r.status_code == 200


def test_a_stream_that_ends_gives_its_slot_back(sqlite_api: Api) -> None:
    api = sqlite_api
    api.register("h", devices=1)
    job = api.submit(workers=1, global_batch=8)["id"]
    slots = context_of(api.client.app).stream_slots  # type: ignore[arg-type]
    for _ in range(slots.cap + 2):
        with api.client.stream(
            "GET", f"/api/v1/jobs/{job}/stream?max_s=0.05", headers=api.headers()
        ) as r:
            assert r.status_code == 200
    r = api.client.get("/api/v1/jobs/999/stream?max_s=0.05", headers=api.headers())
    assert r.status_code == 404  # a stream refused on opening holds no slot either
    assert slots.held() == 0


# --------------------------------------------------------------------------- API docs


_URL = re.compile(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|url\s*:\s*["']([^"']+)["']""")


def test_the_api_docs_load_nothing_from_another_host(sqlite_api: Api) -> None:
    client = sqlite_api.client
    for page in ("/docs", "/redoc"):
        r = client.get(page)
        assert r.status_code == 200
        html = r.text
        assert not re.search(r"(https?:)?//[\w.-]+\.[a-z]{2,}", html, re.I), html
        urls = [a or b for a, b in _URL.findall(html)]
        assert len(urls) >= 3, html
        for url in urls:
            assert url.startswith("/"), url
            assert client.get(url).status_code == 200, url
    assert '"validatorUrl": null' in client.get("/docs").text  # no badge from swagger.io


@given(st.lists(st.tuples(st.sampled_from([1, 2, -7]), st.booleans()), max_size=60))
def test_stream_slots_never_exceed_the_cap(steps: list[tuple[int, bool]]) -> None:
    slots, held = StreamSlots(3), Counter[int]()
    for token, opening in steps:
        if opening:
            took = slots.take(token)
            assert took == (held[token] < 3)
            held[token] += took
        elif held[token]:
            slots.give_back(token)
            held[token] -= 1
        assert slots.held(token) == held[token] <= 3
    assert slots.held() == sum(held.values())
