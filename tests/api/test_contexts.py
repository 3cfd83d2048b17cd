"""Code archives: uploaded once per content by operators, stored in the database a piece at a
time, named by jobs, fetched by the agents that run those jobs and by nobody else."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import zipfile
from typing import Any

import pytest

from contract.enums import Role
from server.context import context_of
from server.services import archives
from server.services.blobs import CHUNK_BYTES
from tests.harness import Api


def archive(*members: tuple[str, bytes | str | int], gz: bool = True) -> bytes:
    """A tar(.gz) of ``(name, content)``: bytes a file, a str a symlink's target, an int a
    special type (``tarfile.LNKTYPE``, ``tarfile.CHRTYPE``...)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz" if gz else "w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if isinstance(content, bytes):
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
                continue
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
            else:
                info.type, info.linkname = bytes([content]), "code/train.py"
            tar.addfile(info)
    return out.getvalue()


def upload(api: Api, body: bytes, token: str | None = None, **headers: str) -> Any:
    return api.client.post(
        "/api/v1/contexts",
        content=body,
        headers={**(api.headers(token) if token else api.headers()), **headers},
    )


def test_an_archive_is_stored_once_under_its_digest_and_read_back_whole(api: Api) -> None:
    body = archive(("code/train.py", b"def main(ctx): pass\n"), ("w.bin", os.urandom(CHUNK_BYTES)))
    assert len(body) > CHUNK_BYTES  # two pieces in the database at least
    sha = hashlib.sha256(body).hexdigest()
    r = upload(api, body, **{"X-Evenflow-Sha256": sha})
    assert r.status_code == 201, r.text
    assert (r.json()["sha256"], r.json()["size_bytes"], r.json()["new"]) == (sha, len(body), True)
    again = upload(api, body)
    assert again.status_code == 201 and again.json()["new"] is False  # stored once
    got = api.client.get(f"/api/v1/contexts/{sha}", headers=api.headers())
    assert got.status_code == 200 and got.content == body
    assert got.headers["x-evenflow-sha256"] == sha
    info = api.client.get(f"/api/v1/contexts/{sha}/info", headers=api.headers())
    assert info.json()["size_bytes"] == len(body)


def test_bad_uploads_are_refused_and_store_nothing(api: Api) -> None:
    body = archive(("code/train.py", b"def main(ctx): pass\n"))
    r = upload(api, body, **{"X-Evenflow-Sha256": "0" * 64})
    assert r.status_code == 422
    assert "corrupt" in r.json()["detail"] and r.json()["field"] == "sha256"
    assert upload(api, b"").status_code == 422
    r = upload(api, body, **{"X-Evenflow-Sha256": "XYZ"})
    assert r.status_code == 422 and "64 lowercase hex" in r.json()["detail"]
    limit = context_of(api.client.app).settings.context_max_bytes  # type: ignore[arg-type]
    r = upload(api, b"\x1f\x8b" + b"x" * limit)
    assert r.status_code == 413 and str(limit) in r.json()["detail"]
    viewer = api.token(Role.VIEWER)
    assert upload(api, body, viewer).status_code == 403  # uploading is an operator's
    sha = hashlib.sha256(body).hexdigest()
    assert api.client.get(f"/api/v1/contexts/{sha}", headers=api.headers()).status_code == 404
    r = api.client.get(f"/api/v1/contexts/{'z' * 64}", headers=api.headers())
    assert r.status_code == 422


def test_archives_an_agent_could_not_unpack_safely_are_refused_naming_the_entry(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = ("code/train.py", b"def main(ctx): pass\n")
    monkeypatch.setattr(archives, "CONTEXT_UNPACKED_MIN_BYTES", 2**20)  # 512 MiB in service
    bomb = io.BytesIO()
    with gzip.GzipFile(fileobj=bomb, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 3 * 2**20  # a few KiB compressed: past the limit unpacked
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("../evil.py", "x")
    cases = [
        (b"just some bytes, not an archive", "not a tar, tar.gz or zip"),
        (archive(ok, ("/etc/cron.d/x", b"x")), "'/etc/cron.d/x' would land outside"),
        (archive(ok, ("code/../../x", b"x")), "would land outside"),
        (archive(ok, ("code/link", "../../etc/passwd")), "symlink 'code/link' points outside"),
        (archive(ok, ("code/abs", "/etc/passwd")), "points outside"),
        (archive(ok, ("code/hard", tarfile.LNKTYPE[0])), "is a hard link"),
        (archive(ok, ("code/dev", tarfile.CHRTYPE[0])), "special file"),
        (archive(ok, ("code/fifo", tarfile.FIFOTYPE[0]), gz=False), "special file"),
        (bomb.getvalue(), "unpacks past 1048576 bytes at 'zeros.bin': a bomb?"),
        (zipped.getvalue(), "'../evil.py' would land outside"),
    ]
    for body, why in cases:
        r = upload(api, body)
        assert r.status_code == 422, why
        assert why in r.json()["detail"] and r.json()["field"] == "body"
        sha = hashlib.sha256(body).hexdigest()
        assert (
            api.client.get(f"/api/v1/contexts/{sha}/info", headers=api.headers()).status_code == 404
        )
    linked = archive(ok, ("code/alias.py", "train.py"))  # a link inside the archive is fine
    assert upload(api, linked).status_code == 201


def test_a_job_names_an_uploaded_archive_and_only_its_agents_may_fetch_it(api: Api) -> None:
    body = archive(("mytrain/main.py", os.urandom(5000)))
    sha = hashlib.sha256(body).hexdigest()
    ours = api.register("ours", devices=1)
    theirs = api.register("theirs", devices=1)
    spec = {"workload": {"entrypoint": "mytrain.main:train", "context": "a" * 64}}
    r = api.client.post(
        "/api/v1/jobs",
        json={"name": "j", "global_batch": 8, "iterations": 5, "workers": 1, **spec},
        headers=api.headers(),
    )
    assert r.status_code == 422 and r.json()["field"] == "workload.context"
    assert "was uploaded" in r.json()["detail"]
    assert upload(api, body).status_code == 201
    job = api.submit(
        workers=1, global_batch=8, workload={"entrypoint": "mytrain.main:train", "context": sha}
    )
    assert job["spec"]["workload"]["context"] == sha
    placed_on = job["workers"][0]["host_id"]
    runner, other = (ours, theirs) if placed_on == ours["id"] else (theirs, ours)
    r = api.client.get(f"/api/v1/contexts/{sha}", headers=api.headers(runner["_token"]))
    assert r.status_code == 200 and r.content == body
    r = api.client.get(f"/api/v1/contexts/{sha}", headers=api.headers(other["_token"]))
    assert r.status_code == 403 and "runs no job" in r.json()["detail"]
    viewer = api.token(Role.VIEWER)
    assert api.client.get(f"/api/v1/contexts/{sha}", headers=api.headers(viewer)).status_code == 403
    bad = {"workload": {"builtin": "mlp", "context": sha}}
    r = api.client.post(
        "/api/v1/jobs",
        json={"name": "j", "global_batch": 8, "iterations": 5, "workers": 1, **bad},
        headers=api.headers(),
    )
    assert r.status_code == 422 and "entrypoint" in r.json()["detail"]
