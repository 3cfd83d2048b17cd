"""Code shipped with a job: a package installed nowhere runs on two agents from its context, and
what it printed is on the server once it succeeded; code that cannot run fails at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from evenflow.cli import main
from evenflow.local_cluster import LocalCluster

TRAIN = """
from pathlib import Path

import torch
from torch import nn


def main(ctx):
    from mytrain_shipped.helpers import greeting  # the package's own modules import

    print(greeting(ctx.rank), flush=True)
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x.sum(1, keepdim=True)
    model, _ = ctx.prepare(nn.Linear(4, 1))
    for xb, yb in ctx.batches((x, y)):
        ctx.step(nn.functional.mse_loss(model(xb), yb, reduction="sum"))
    out = Path(ctx.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"notes-{ctx.rank}.txt").write_text(f"rank {ctx.rank} was here")
    ctx.save_final()  # rank 0: final.pt in its output directory
"""


def _package(root: Path, train: str = TRAIN) -> Path:
    pkg = root / "mytrain_shipped"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(train)
    (pkg / "helpers.py").write_text("def greeting(rank):\n    return f'hello from rank {rank}'\n")
    return root


def _spec(path: Path, workers: int = 2) -> Path:
    path.write_text(
        "name: shipped\nworkload: {entrypoint: 'mytrain_shipped.train:main'}\n"
        f"global_batch: 32\niterations: 12\nworkers: {workers}\nmax_restarts: 2\n"
    )
    return path


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_package_installed_nowhere_runs_from_its_context_on_two_agents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code = _package(tmp_path / "code")
    with LocalCluster(tmp_path / "cluster", workers=2, agents=2) as cluster:
        monkeypatch.setenv("EVENFLOW_SERVER", cluster.url)
        monkeypatch.setenv("EVENFLOW_TOKEN", cluster.admin_token)
        assert (
            main(["jobs", "submit", str(_spec(tmp_path / "job.yaml")), "--context", str(code)]) == 0
        )
        (job,) = cluster.client.jobs().items
        done = cluster.wait(job.id, timeout_s=240)
        assert done.status.value == "succeeded", done.error
        assert {w.host_id for w in done.workers} == {h.id for h in cluster.client.hosts().items}
        for host in ("local-a", "local-b"):  # each agent unpacked it in its own job directory
            unpacked = tmp_path / "cluster" / host / f"job-{job.id}" / "context"
            assert (unpacked / "mytrain_shipped" / "train.py").is_file()
        capsys.readouterr()
        assert main(["jobs", "logs", str(job.id)]) == 0
        out = capsys.readouterr().out
        assert "hello from rank 0" in out and "hello from rank 1" in out
        # what the ranks left on their hosts' disks, downloaded through the server
        got = tmp_path / "got"
        assert main(["jobs", "artifacts", str(job.id), "--download", str(got)]) == 0
        assert (got / "rank-0" / "notes-0.txt").read_text() == "rank 0 was here"
        assert (got / "rank-1" / "notes-1.txt").read_text() == "rank 1 was here"
        final = torch.load(got / "rank-0" / "final.pt", weights_only=True)
        assert set(final) == {"weight", "bias"}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_context_whose_import_fails_fails_the_job_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = _package(tmp_path / "code", train="import numpy_does_not_exist\n")
    with LocalCluster(tmp_path / "cluster", workers=2, agents=1) as cluster:
        monkeypatch.setenv("EVENFLOW_SERVER", cluster.url)
        monkeypatch.setenv("EVENFLOW_TOKEN", cluster.admin_token)
        assert (
            main(["jobs", "submit", str(_spec(tmp_path / "job.yaml")), "--context", str(code)]) == 0
        )
        (job,) = cluster.client.jobs().items
        done = cluster.wait(job.id, timeout_s=30)
        assert done.status.value == "failed" and done.restarts == 0
        assert re.search(r"No module named 'numpy_does_not_exist'", done.error or "")
