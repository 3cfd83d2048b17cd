"""`evenflow compare` and `evenflow demo` on the whole local stack, and the measurements they print."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contract.api import TelemetryOut
from contract.enums import JobStatus, PolicyName
from evenflow.cli import main
from evenflow.experiment import Profile, measure, optimum_ms, report, run_policy


def _row(
    rank: int, it: int, b: int, ts: float, sync: float = 1.0, version: int = 1
) -> TelemetryOut:
    return TelemetryOut(
        rank=rank,
        iteration=it,
        plan_version=version,
        batch_size=b,
        data_ms=0.0,
        compute_ms=9.0,
        sync_ms=sync,
        ts=ts,
    )


def test_measure_counts_real_samples_and_steady_state() -> None:
    # 8 iterations of 10 samples each over 2 ranks; the first half slow (1 s), the second fast (0.1 s);
    # the last iteration is an epoch's partial batch of 4 samples.
    rows, t = [], 0.0
    for it in range(8):
        t += 1.0 if it < 4 else 0.1
        b = 2 if it == 7 else 5
        rows += [_row(0, it, b, t, version=1 if it < 4 else 2), _row(1, it, b, t - 0.01, sync=3.0)]
    m = measure(rows)
    assert m.iterations == 8 and m.plan_changes == 1
    assert m.samples_per_s == pytest.approx(
        (3 * 10 + 4) / 0.4
    )  # iterations 4..7 after iteration 3's end
    assert m.total_s == pytest.approx(t - 1.0 + 0.012)  # + iteration 0: its slowest rank took 12 ms
    assert m.idle_fraction == pytest.approx((1 + 3) / (10 + 12))


def test_ideal_is_the_continuous_optimum() -> None:
    p = Profile.model_validate(
        {
            "global_batch": 256,
            "iterations": 10,
            "workers": [
                {"name": n, "per_sample_ms": s, "intercept_ms": 5}
                for n, s in (("a", 1), ("b", 1), ("c", 2), ("d", 4))
            ],
        }
    )
    integer, continuous = optimum_ms(p.models(), 256)
    assert continuous == pytest.approx(5 + 256 / 2.75)
    assert continuous <= integer <= continuous + 4


def test_bad_profile_names_the_field(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("global_batch: 8\niterations: 10\nworkers: [{name: a, per_sample_ms: -1}]\n")
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--profile", str(f)])
    assert "workers.0.per_sample_ms" in str(exc.value)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_compare_json_on_the_whole_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "global_batch: 64\niterations: 60\npolicies: [equal, minmax]\nexplore_iterations: 4\nrebalance_every: 10\n"
        "workers:\n  - {name: fast, per_sample_ms: 0.5, intercept_ms: 2}\n"
        "  - {name: slow, per_sample_ms: 2.0, intercept_ms: 2}\n"
    )
    assert main(["compare", "--profile", str(f), "--json", "--workdir", str(tmp_path / "w")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"ideal_samples_per_s", "policies", "speedup_vs_equal", "failed"}
    assert set(out["policies"]) == {"equal", "minmax"} and out["failed"] == []
    for r in out["policies"].values():
        assert set(r) == {
            "samples_per_s",
            "total_s",
            "mean_iteration_ms",
            "idle_fraction",
            "plan_changes",
            "ooms",
            "peak_memory_fraction",
        }
        assert r["ooms"] == 0 and r["peak_memory_fraction"] is None  # no emulated memory
    assert out["policies"]["equal"]["plan_changes"] == 0
    assert out["policies"]["minmax"]["plan_changes"] >= 1
    # equal: slowest 2 + 2 * 32 = 66 ms; minmax optimum: (T - 2) * (2 + 0.5) = 64 -> 27.6 ms
    assert out["speedup_vs_equal"]["minmax"] > 1.5
    assert out["policies"]["minmax"]["samples_per_s"] < out["ideal_samples_per_s"] * 1.02


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_runs_both_policies_and_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--workers", "2", "--seconds", "3", "--exit", "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert "EMULATED" in out and "token" in out
    table = out[out.index("measured") :]
    assert "equal" in table and "minmax" in table and "speedup" in table


MEMORY_PROFILE = (
    "global_batch: 64\niterations: 40\npolicies: [equal, minmax]\nexplore_iterations: 4\n"
    "rebalance_every: 10\nworkers:\n"
    # mem(b) = 100 + 10 b: the fast card fits 26 per pass with 10% headroom (30 without), the
    # speed-only optimum gives it 51; equal's 32 does not fit it either.
    "  - {name: fast, per_sample_ms: 0.5, intercept_ms: 2, memory_mb: 400,"
    " memory_base_mb: 100, memory_per_sample_mb: 10}\n"
    "  - {name: slow, per_sample_ms: 2.0, intercept_ms: 2, memory_mb: 8000,"
    " memory_base_mb: 100, memory_per_sample_mb: 10}\n"
)


def test_memory_caps_and_the_capped_ideal() -> None:
    import yaml

    p = Profile.model_validate(yaml.safe_load(MEMORY_PROFILE))
    assert p.memory_caps() == [26, 710]
    assert p.job_spec(p.policies[0]).emulation[0].memory_cap == 30  # type: ignore[index]


def test_measure_refuses_too_few_iterations_and_says_what_it_found() -> None:
    rows = [_row(rank, it, 32, float(it)) for it in (0, 1, 5) for rank in (0, 1)]
    with pytest.raises(
        ValueError, match=r"3 stored \(6 rows, iterations \[0, 1, 5\], ranks \[0, 1\]\)"
    ):
        measure(rows)
    assert measure([*rows, _row(0, 6, 32, 6.0)]).iterations == 4


def test_a_policy_whose_job_left_too_few_iterations_fails_alone() -> None:
    """A job that succeeded with most of its telemetry missing is that policy's failure, said
    in its row of the report; the other policies' figures still come, and no traceback."""
    stored = {
        1: [_row(rank, it, 32, float(it)) for it in range(8) for rank in (0, 1)],
        2: [_row(rank, 0, 32, 0.0) for rank in (0, 1)],
    }
    submitted = iter(stored)

    class Cluster:  # the part of LocalCluster run_policy uses; its jobs all succeed
        class client:
            @staticmethod
            def telemetry(job_id: int) -> SimpleNamespace:
                return SimpleNamespace(items=stored[job_id])

        def submit(self, spec: object) -> SimpleNamespace:
            return SimpleNamespace(id=next(submitted))

        def wait(self, job_id: int, on_progress: object) -> SimpleNamespace:
            return SimpleNamespace(status=JobStatus.SUCCEEDED, error=None)

    profile = Profile.model_validate(
        {"global_batch": 64, "iterations": 8, "workers": [{"name": "a", "per_sample_ms": 1.0}] * 2}
    )
    cluster: Any = Cluster()
    results = {p: run_policy(cluster, profile, p) for p in (PolicyName.EQUAL, PolicyName.MINMAX)}
    out = report(profile, results)
    assert out["failed"] == ["minmax"]
    assert out["policies"]["equal"]["samples_per_s"] > 0
    error = out["policies"]["minmax"]["error"]
    assert error.startswith("job 2 (minmax) succeeded, but too few iterations to measure: 1 stored")
    assert results[PolicyName.MINMAX].job_id == 2


def test_measure_counts_ooms_and_the_peak_memory_fraction() -> None:
    rows = [
        _row(0, it, 5, float(it)).model_copy(
            update={"peak_memory_mb": 100.0 + it, "oom_batch": 10 if it == 2 else None}
        )
        for it in range(6)
    ]
    m = measure(rows, [200])
    assert m.ooms == 1 and m.peak_memory_fraction == pytest.approx(105 / 200)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_compare_with_emulated_memory_completes_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Equal's first split (32 each) does not fit the fast card: the pass runs out of memory,
    is redone smaller, and both policies finish within the device's memory."""
    f = tmp_path / "p.yaml"
    f.write_text(MEMORY_PROFILE)
    assert main(["compare", "--profile", str(f), "--json", "--workdir", str(tmp_path / "w")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == []
    for r in out["policies"].values():
        assert r["ooms"] >= 1  # the initial equal split, under both policies
        assert r["peak_memory_fraction"] <= 1.0
    assert out["ideal_under_caps_samples_per_s"] < out["ideal_samples_per_s"]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_compare_exits_non_zero_when_a_policy_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(
        "global_batch: 8\niterations: 10\npolicies: [equal]\nworkers:\n"
        "  - {name: tiny, per_sample_ms: 0.5, memory_mb: 50, memory_base_mb: 100}\n"
        "  - {name: ok, per_sample_ms: 0.5}\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--profile", str(f), "--json", "--workdir", str(tmp_path / "w")])
    assert "policies failed: equal" in str(exc.value)
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == ["equal"]
    assert "single sample per pass" in out["policies"]["equal"]["error"]
