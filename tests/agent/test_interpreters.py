"""A job's own interpreter: checked on each host before its ranks start, with a reason when it
cannot run them; a job naming one that cannot fails at once."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from agent.interpreters import InterpreterError, Interpreters
from evenflow.local_cluster import LocalCluster


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_an_environment_is_checked_once_against_the_jobs_backend(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    wrapper = _script(tmp_path / "python", f'echo x >> {calls}\nexec {sys.executable} "$@"')
    checked = Interpreters()
    found = checked.check(wrapper, "gloo", os.environ)
    assert found.gloo and found.torch.startswith("2.")
    assert checked.check(wrapper, "gloo", os.environ) == found
    assert calls.read_text().count("x") == 1  # asked once; kept until the file changes
    if not found.cuda:  # this CPU build cannot run NCCL ranks: said, not found at the rendezvous
        with pytest.raises(InterpreterError, match="cannot run NCCL ranks"):
            checked.check(wrapper, "nccl", os.environ)


def test_an_environment_that_cannot_run_the_ranks_is_refused_with_why(tmp_path: Path) -> None:
    checked = Interpreters()
    with pytest.raises(InterpreterError, match="/nowhere/python cannot be used here: No such"):
        checked.check("/nowhere/python", "gloo", os.environ)
    bare = _script(
        tmp_path / "bare", "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1"
    )
    with pytest.raises(InterpreterError) as exc:
        checked.check(bare, "gloo", os.environ)
    assert "cannot run Evenflow's ranks: ModuleNotFoundError: No module named 'torch'" in str(
        exc.value
    )
    assert "\n" not in str(exc.value)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_job_whose_environment_cannot_run_it_fails_at_once(tmp_path: Path) -> None:
    from contract.spec import JobSpec

    bare = _script(tmp_path / "bare", "echo 'ImportError: no torch here' >&2; exit 1")
    spec = {
        "name": "env",
        "workload": {"builtin": "mlp"},
        "global_batch": 16,
        "iterations": 5,
        "workers": 2,
        "environment": {"python": bare},
    }
    wrapper = _script(tmp_path / "python", f'exec {sys.executable} "$@"')
    with LocalCluster(tmp_path / "cluster", workers=2, agents=1) as cluster:
        failed = cluster.wait(cluster.submit(JobSpec.model_validate(spec)).id, timeout_s=60)
        assert failed.status.value == "failed" and failed.restarts == 0
        assert "ImportError: no torch here" in (failed.error or "")
        spec["environment"] = {"python": wrapper}  # a prepared environment that can
        done = cluster.wait(cluster.submit(JobSpec.model_validate(spec)).id, timeout_s=200)
        assert done.status.value == "succeeded", done.error
