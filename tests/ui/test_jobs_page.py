"""The jobs page: the list with speeds, and submitting through the form with the API's own
validation shown beside the right input."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from tests.ui.harness import LiveApp, Page, sign_in
from tests.ui.simulated import Cluster, emulated_iteration

pytestmark = pytest.mark.browser


def test_submit_a_job_through_the_form(page: Page, live_app: LiveApp, cluster: Cluster) -> None:
    pg = page.page
    cluster.register("gpu-a", 4)
    operator = cluster.token("operator", name="olga")
    sign_in(pg, live_app.url, operator)
    pg.fill("input[name=name]", "vit-small")
    pg.select_option("select[name='workload.builtin']", "cnn-digits")
    pg.fill("input[name=global_batch]", "0")  # refused by the API: global_batch >= 1
    pg.fill("input[name=workers]", "4")
    pg.fill("input[name=iterations]", "500")
    pg.fill("input[name=emulation]", "0.5, 0.5, 1.2, 2")
    pg.click("#submit-button")
    error = pg.locator('[data-field="global_batch"] .field-error')
    error.wait_for()
    assert "greater than or equal to 1" in error.inner_text()
    assert pg.locator('[data-field="workers"] .field-error').is_hidden()
    assert cluster.client.get("/api/v1/jobs").json()["total"] == 0

    pg.fill("input[name=global_batch]", "256")
    pg.fill("input[name=emulation]", "0.5, 0.5, 1.2")  # three entries for four workers
    pg.click("#submit-button")
    pg.locator("#submit-error").wait_for()
    assert "emulation has 3 entries for 4 workers" in pg.locator("#submit-error").inner_text()

    pg.fill("input[name=emulation]", "0.5, 0.5, 1.2, 2")
    pg.click("#submit-button")
    pg.locator("#submitted-link").wait_for()
    assert error.is_hidden()
    jobs = cluster.client.get("/api/v1/jobs").json()["items"]
    assert [(j["name"], j["owner"], j["emulated"]) for j in jobs] == [("vit-small", "olga", True)]
    assert jobs[0]["spec"]["workload"]["builtin"] == "cnn-digits"
    row = pg.locator(f'tr[data-job-id="{jobs[0]["id"]}"]')
    row.wait_for()
    assert "emulated" in row.inner_text()
    # Submission answers before placement; the list shows it placed at its next refresh.
    row.filter(has_text="starting").wait_for(timeout=15_000)


def test_submit_a_job_with_its_code_through_the_form(
    page: Page, live_app: LiveApp, cluster: Cluster, tmp_path: Path
) -> None:
    pg = page.page
    cluster.register("cpu-a", 2)
    operator = cluster.token("operator", name="olga")
    sign_in(pg, live_app.url, operator)
    archive = tmp_path / "code.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"def main(ctx):\n    pass\n"
        info = tarfile.TarInfo("mytrain/train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    pg.fill("input[name=name]", "shipped")
    pg.select_option("select[name='workload.builtin']", "")  # your entrypoint
    pg.fill("input[name='workload.entrypoint']", "mytrain.train:main")
    pg.set_input_files("input[name='workload.context']", str(archive))
    pg.fill("input[name=global_batch]", "64")
    pg.fill("input[name=workers]", "2")
    pg.fill("input[name=iterations]", "10")
    pg.click("#submit-button")
    pg.locator("#submitted-link").wait_for()
    (job,) = cluster.client.get("/api/v1/jobs").json()["items"]
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    workload = job["spec"]["workload"]
    assert (workload["entrypoint"], workload["context"]) == ("mytrain.train:main", sha)
    stored = cluster.client.get(f"/api/v1/contexts/{sha}")
    assert stored.status_code == 200 and stored.content == archive.read_bytes()


def test_job_list_shows_speed_from_recent_telemetry(
    page: Page, live_app: LiveApp, cluster: Cluster
) -> None:
    pg = page.page
    cluster.register("gpu-a", 2)
    job = cluster.submit(2, 128)
    records = []
    for it in range(30):  # 128 samples every 0.25 s
        records += emulated_iteration(it, 1, [64, 64], [0.2, 0.4], ts=1000 + it * 0.25)
    cluster.post_telemetry(job["id"], records)
    viewer = cluster.token("viewer")
    sign_in(pg, live_app.url, viewer)
    speed = pg.locator(f'tr[data-job-id="{job["id"]}"] .speed')
    speed.wait_for()
    pg.wait_for_function(
        f"document.querySelector('tr[data-job-id=\"{job['id']}\"] .speed').textContent.includes('samples/s')"
    )
    assert speed.inner_text() == "512 samples/s"
    # Viewers see the form but cannot submit.
    assert pg.locator("#submit-button").is_disabled()
