"""Checkpoints: atomic, pruned, corrupt ones skipped, an unwritable path refused before training,
and a job stopped and resumed (on a different number of workers) ends exactly where an
uninterrupted run does (invariant 3: every sample once per epoch across the resume)."""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.runtime.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointPathError,
    CheckpointStore,
    capture_rng,
    file_name,
    restore_rng,
)
from agent.runtime.plan_sync import RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler, StreamSampler
from agent.runtime.trainer import RunResult, RuntimeOptions, run_training
from agent.runtime.worker import checkpoint_dir, worker_main
from contract.agent import WORKER_EXIT_FATAL
from contract.spec import JobSpec

from .spawn import run_ranks

B, SAMPLES, EVERY = 48, 600, 10  # 600 % 48 = 24: every epoch ends on a partial batch


MLP = {"builtin": "mlp", "seed": 7, "args": {"samples": SAMPLES}}
# The schedule's length is the whole job's, also in the run "killed" early.
LOADER = {
    "entrypoint": "tests.runtime.user_workload:train_loader",
    "seed": 7,
    "args": {"steps": 40},
}


def spec(
    iterations: int,
    path: str | None,
    workers: int = 2,
    max_workers: int = 3,
    workload: dict[str, object] = MLP,
    sync: str = "auto",
) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "ckpt",
            "workload": workload,
            "global_batch": B,
            "iterations": iterations,
            "workers": workers,
            "max_workers": max_workers,
            "checkpoint": None if path is None else {"every_iterations": EVERY, "path": path},
            "gradient_sync": sync,
        }
    )


def equal(world: int) -> RuntimePlan:
    sizes = [B // world + (r < B % world) for r in range(world)]
    return RuntimePlan(1, tuple(sizes))


def _train(
    rank: int,
    world: int,
    iterations: int,
    path: str | None,
    workload: dict[str, object] = MLP,
    sync: str = "auto",
) -> tuple[RunResult, dict]:
    result = run_training(
        spec(iterations, path, workload=workload, sync=sync),
        initial_plan=equal(world),
        options=RuntimeOptions(close_deadline_s=1),
    )
    final = {}
    if path is not None and rank == 0 and os.path.exists(f"{path}/final.pt"):
        loaded = torch.load(f"{path}/final.pt", weights_only=True)
        final = {k: v.numpy() for k, v in loaded.items()}  # tensors would travel as shared memory
    return result, final


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("workload", "sync"),
    [(MLP, "coalesced"), (LOADER, "coalesced"), (MLP, "overlap")],
    ids=["tensors", "dataloader", "tensors-ddp"],
)
def test_a_stopped_job_resumed_on_other_workers_ends_as_an_uninterrupted_one(
    tmp_path: Path, workload: dict[str, object], sync: str
) -> None:
    """A checkpoint is the unwrapped model's, so DDP's resume on 3 workers of a 2-worker job
    is the same as the coalesced synchroniser's."""
    total = 40
    reference = run_ranks(_train, 2, total, str(tmp_path / "ref"), workload, sync)
    ref_result, ref_model = reference[0]

    resumed_dir = str(tmp_path / "job")
    first = run_ranks(_train, 2, 23, resumed_dir, workload, sync)  # "killed" at 23: last at 20
    assert [c[0] for c in first[0][0].checkpoints] == [10, 20]
    os.remove(f"{resumed_dir}/final.pt")
    second = run_ranks(_train, 3, total, resumed_dir, workload, sync)  # back on three workers
    result, model = second[0]

    assert result.resumed_from == 20
    assert result.iterations == total - 20
    assert result.global_samples == ref_result.global_samples  # the same samples consumed
    assert result.plan_history[0] == (20, 1)
    assert model.keys() == ref_model.keys()
    for name, ref in ref_model.items():
        np.testing.assert_allclose(model[name], ref, rtol=1e-5, atol=1e-7)
    assert result.final_loss == pytest.approx(ref_result.final_loss, rel=1e-5)


def test_checkpoints_are_atomic_pruned_and_a_corrupt_one_is_skipped(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=3)
    for it in (10, 20, 30, 40):
        saved = store.save({"format": 1, "iteration": it, "payload": torch.arange(it)})
        assert saved.size_bytes == os.path.getsize(tmp_path / file_name(it))
    assert store.iterations() == [20, 30, 40]  # the oldest pruned
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]  # no temporary left behind

    (tmp_path / file_name(40)).write_bytes(b"half a file")  # truncated by someone
    (tmp_path / f".{file_name(50)}.tmp-x").write_bytes(b"an unfinished write")  # never listed
    latest = store.load_latest()
    assert latest is not None and latest["iteration"] == 30
    assert torch.equal(latest["payload"], torch.arange(30))

    (tmp_path / file_name(30)).write_bytes(b"")
    (tmp_path / file_name(20)).write_bytes(b"\x00" * 64)
    assert store.load_latest() is None


def test_a_checkpoint_of_another_dataset_is_refused_not_resumed(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cp = Checkpointer(store, every=5)
    cp.save(
        iteration=5,
        model=model,
        optimizer=opt,
        sampler=GlobalBatchSampler(100, 10),
        plan=RuntimePlan(1, (10,)),
        global_samples=50,
    )
    with pytest.raises(CheckpointError, match="dataset_size 100, this job has 90"):
        cp.resume(model, opt, GlobalBatchSampler(90, 10), rank=0, group=None, control=None)
    with pytest.raises(CheckpointError, match="drop_last False, this job has True"):
        sampler = GlobalBatchSampler(100, 10, drop_last=True)
        cp.resume(model, opt, sampler, rank=0, group=None, control=None)
    stream = StreamSampler(10)
    cp.save(
        iteration=10,
        model=model,
        optimizer=opt,
        sampler=stream,
        plan=RuntimePlan(1, (10,)),
        global_samples=100,
        data={"stream_piece": 10, "num_workers": 2},
    )
    with pytest.raises(CheckpointError, match="read its data with num_workers 2, this job with 4"):
        data = {"stream_piece": 10, "num_workers": 4}
        cp.resume(model, opt, stream, rank=0, group=None, control=None, data=data)
    resumed = cp.resume(
        model,
        opt,
        stream,
        rank=0,
        group=None,
        control=None,
        data={"stream_piece": 10, "num_workers": 2},
    )
    assert resumed is not None and resumed.iteration == 10


def test_a_checkpoint_written_before_samplers_described_themselves_still_resumes(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    old = {
        "format": 1,
        "iteration": 5,
        "dataset_size": 100,
        "global_batch": 10,
        "seed": 0,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": capture_rng(),
        "user": {},
        "global_samples": 50,
    }
    CheckpointStore(str(tmp_path)).save(old)
    cp = Checkpointer(CheckpointStore(str(tmp_path)), every=5)
    resumed = cp.resume(model, opt, GlobalBatchSampler(100, 10), rank=0, group=None, control=None)
    assert resumed is not None and resumed.iteration == 5


def test_user_state_and_rng_come_back(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    saver = Checkpointer(CheckpointStore(str(tmp_path)), every=1)
    ema = {"value": 3.5}
    saver.add("ema", lambda: dict(ema), ema.update)
    saver.add("sched", sched.state_dict, sched.load_state_dict)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    sampler = GlobalBatchSampler(10, 2)
    saver.save(
        iteration=3,
        model=model,
        optimizer=opt,
        sampler=sampler,
        plan=RuntimePlan(1, (2,)),
        global_samples=6,
    )
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    model2 = torch.nn.Linear(3, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    loader = Checkpointer(CheckpointStore(str(tmp_path)), every=1)
    ema2: dict[str, float] = {}
    loader.add("ema", lambda: dict(ema2), ema2.update)
    loader.add("sched", sched2.state_dict, sched2.load_state_dict)
    resumed = loader.resume(model2, opt2, sampler, rank=0, group=None, control=None)
    assert resumed is not None and (resumed.iteration, resumed.global_samples) == (3, 6)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    assert ema2 == {"value": 3.5}
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(
        opt2.state_dict()["state"][0]["momentum_buffer"],
        opt.state_dict()["state"][0]["momentum_buffer"],
    )


def test_rng_round_trip() -> None:
    state = capture_rng()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def test_an_unwritable_checkpoint_path_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointPathError, match="a-file/ckpt' cannot be written"):
        run_training(spec(5, str(blocker / "ckpt")), initial_plan=equal(2))


def test_the_worker_exits_fatal_on_an_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    error_file = tmp_path / "error"
    env = {
        "EVENFLOW_SERVER": "http://127.0.0.1:9",  # never reached: the path is checked first
        "EVENFLOW_TOKEN": "t",
        "EVENFLOW_JOB_ID": "4",
        "EVENFLOW_SPEC": spec(5, str(blocker)).model_dump_json(),
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "9",
        "EVENFLOW_ERROR_FILE": str(error_file),
    }
    assert worker_main(env) == WORKER_EXIT_FATAL
    assert "job-4' cannot be written" in error_file.read_text()
    # an entrypoint that cannot be imported fails the same way on every attempt: fatal too,
    # before the rendezvous
    broken = spec(5, None, workload={"entrypoint": "no_such_package.train:main"})
    assert worker_main({**env, "EVENFLOW_SPEC": broken.model_dump_json()}) == WORKER_EXIT_FATAL
    last = error_file.read_text().strip().splitlines()[-1]
    assert "cannot be imported: ModuleNotFoundError: No module named 'no_such_package'" in last


def test_checkpoint_directories() -> None:
    assert checkpoint_dir(spec(5, None), 3, "/w/job-3") is None  # no checkpoint asked for
    with_path = spec(5, "s3://bucket/ck/")
    assert checkpoint_dir(with_path, 3, "/w/job-3") == "s3://bucket/ck/job-3"
    default = with_path.model_copy(
        update={"checkpoint": with_path.checkpoint.model_copy(update={"path": None})}  # type: ignore[union-attr]
    )
    assert checkpoint_dir(default, 3, "/w/job-3/") == "/w/job-3/checkpoints"


@st.composite
def resume_case(draw: st.DrawFn) -> tuple[int, int, int, int, int, int]:
    n = draw(st.integers(1, 120))
    global_batch = draw(st.integers(1, 30))
    before, after = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    per_epoch = -(-n // global_batch)
    resume_at = draw(st.integers(0, 3 * per_epoch))  # the checkpoint resumed from
    return n, global_batch, before, after, resume_at, draw(st.integers(0, 10**6))


def _plan(rng: random.Random, world: int, total: int) -> list[int]:
    cuts = sorted(rng.randint(0, total) for _ in range(world - 1))
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(world)]


@settings(max_examples=200, deadline=None)
@given(resume_case())
def test_every_sample_once_per_epoch_across_a_resume_on_another_worker_count(
    case: tuple[int, int, int, int, int, int],
) -> None:
    """The first attempt ran on ``before`` workers and was killed some time after its
    checkpoint at ``resume_at``; the iterations it ran past that are lost with it. The job
    resumes there on ``after`` workers, in new processes (a fresh sampler), under other plans.
    What the model trained on, [0, resume_at) from the first attempt and [resume_at, end) from
    the second, uses every sample exactly once per epoch."""
    n, global_batch, before, after, resume_at, seed = case
    rng = random.Random(seed)
    first = GlobalBatchSampler(n, global_batch, seed=seed)
    second = GlobalBatchSampler(n, global_batch, seed=seed)
    per_epoch = first.batches_per_epoch
    end = (resume_at // per_epoch + 2) * per_epoch  # the resumed epoch and one more, whole
    used: dict[int, Counter[int]] = {}
    for it in range(end):
        sampler, world = (first, before) if it < resume_at else (second, after)
        plan = _plan(rng, world, global_batch)
        counter = used.setdefault(it // per_epoch, Counter())
        for r in range(world):
            counter.update(sampler.local_indices(it, plan, r).tolist())
    assert sorted(used) == list(range(end // per_epoch))
    for counter in used.values():
        assert sorted(counter) == list(range(n))
        assert set(counter.values()) == {1}


def test_every_rank_settles_its_reports_when_a_checkpoint_is_due(tmp_path: Path) -> None:
    """``due`` runs ``settle`` (the senders' delivery) before the checkpoint is written, and
    only then."""
    settled: list[int] = []
    cp = Checkpointer(CheckpointStore(str(tmp_path)), every=3, settle=lambda: settled.append(1))
    assert [cp.due(i) for i in range(7)] == [False, False, False, True, False, False, True]
    assert len(settled) == 2
