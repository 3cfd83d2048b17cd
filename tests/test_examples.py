"""The examples as jobs through the whole local stack (control plane, agent, two gloo ranks of
unequal emulated speeds, so unequal shares and plan changes): each ends with the model one
process trains on the same global batches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster
from examples import image, stream, text

B, ITERATIONS, SEED = 32, 12, 5
EMULATION = [{"per_sample_ms": 1.5}, {"per_sample_ms": 4.5}]  # rank 0 three times as fast


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("examples"), workers=2, agents=1) as c:
        yield c


def run(
    cluster: LocalCluster, entrypoint: str, args: dict[str, Any], out: Path, **extra: Any
) -> dict[str, Any]:
    """Run an example as a job (``extra``: more of the job spec); its final model's state."""
    spec = JobSpec.model_validate(
        {
            "name": entrypoint.split(":")[0].split(".")[-1],
            "workload": {"entrypoint": entrypoint, "seed": SEED, "args": {**args, "out": str(out)}},
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": 2,
            "emulation": EMULATION,
            "policy": {"name": "minmax", "explore_iterations": 3},
            **extra,
        }
    )
    job = cluster.submit(spec)
    done = cluster.wait(job.id, timeout_s=240)
    assert done.status.value == "succeeded", done.error
    plans = {tuple(p.batch_sizes) for p in cluster.client.plans(job.id).items}
    assert any(a != b for a, b in plans), plans  # the ranks had unequal shares
    state: dict[str, Any] = torch.load(out, weights_only=True)
    return state


def assert_same(state: dict[str, Any], model: nn.Module) -> None:
    """Every tensor equal to one process's to 1e-5 relative, by its norm. Not element by
    element: the ranks sum a gradient in another order than one process, and AdamW divides a
    near-zero gradient's step by its own tiny scale, so a lone weight moves by up to a few 1e-6
    depending on the shares the plans gave (a wrong weighting moves whole tensors by 1e-3 and
    more)."""
    for name, p in model.state_dict().items():
        a, b = state[name].double(), p.double()
        gap = (a - b).norm().item()
        assert gap <= 1e-5 * b.norm().item() + 1e-6, (name, gap, (a - b).abs().max().item())


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_image_example_equals_one_process(cluster: LocalCluster, tmp_path: Path) -> None:
    args = {
        "data_dir": str(tmp_path / "data"),
        "images": 512,
        "batch": 64,
        "augment": False,  # random crops differ between processes; the rest is exact
        "dropout": 0.0,
        "eval_every": 5,
        "seed": 1,
    }
    state = run(cluster, "examples.image:train", args, tmp_path / "final.pt")
    train_set, _ = image.datasets(args)
    model, opt, sched, ema = image.build(args, ITERATIONS)
    sampler = GlobalBatchSampler(len(train_set), B, seed=SEED, drop_last=True)
    for it in range(ITERATIONS):
        x, y = default_collate([train_set[i] for i in _global_batch(sampler, it)])
        (nn.functional.cross_entropy(model(x), y, reduction="sum") / len(y)).backward()
        image.after_sync(model, opt, sched, ema, 1.0)
    assert_same(state, model)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_the_text_example_equals_one_process(
    cluster: LocalCluster, tmp_path: Path, engine: str
) -> None:
    """The same script under either engine: sharded by its spec alone (its transformer's
    layers, its optimizer and schedule built before ctx.prepare)."""
    args = {"sequences": 400, "dropout": 0.0, "workers": 1, "seed": 2}
    state = run(cluster, "examples.text:train", args, tmp_path / "final.pt", engine=engine)
    data = text.dataset(args)
    model, opt, sched = text.build(args, ITERATIONS)
    sampler = GlobalBatchSampler(len(data), B, seed=SEED)
    for it in range(ITERATIONS):
        batch = text.pad_collate([data[i] for i in _global_batch(sampler, it)])
        loss, tokens = text.token_loss(model, batch)
        (loss / tokens).backward()  # the mean over every real token of the global batch
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    assert_same(state, model)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_stream_example_equals_one_process(cluster: LocalCluster, tmp_path: Path) -> None:
    args = {"dropout": 0.0, "workers": 2, "seed": 3}
    state = run(cluster, "examples.stream:train", args, tmp_path / "final.pt")
    model, opt = stream.build(args)
    batches = iter(stream.loader_of(args, B))  # the user's own DataLoader, in one process
    for _ in range(ITERATIONS):
        batch = next(batches)
        (stream.loss_sum(model, batch) / B).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert_same(state, model)


def _global_batch(sampler: GlobalBatchSampler, it: int) -> list[int]:
    epoch, k = sampler.position(it)
    idx = sampler.permutation(epoch)[k * B : k * B + sampler.global_count(it)]
    return [int(i) for i in idx]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_job_stopped_early_by_one_rank_succeeds_at_that_iteration(cluster: LocalCluster) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "early",
            "workload": {
                "entrypoint": "tests.runtime.user_workload:train_until_good_enough",
                "args": {"stop_at": 6},
            },
            "global_batch": B,
            "iterations": 500,
            "workers": 2,
        }
    )
    job = cluster.submit(spec)
    done = cluster.wait(job.id, timeout_s=240)
    assert done.status.value == "succeeded", done.error
    # rank 1 asked after iteration 6's step: the flag rode iteration 7's all-reduce, the last
    assert cluster.last_iteration(job.id) == 7


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_entrypoint_that_cannot_be_imported_fails_the_job_at_once(
    cluster: LocalCluster,
) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "broken",
            "workload": {"entrypoint": "mytrain_not_installed.train:main"},
            "global_batch": B,
            "iterations": 10,
            "workers": 2,
            "max_restarts": 3,
        }
    )
    job = cluster.submit(spec)
    done = cluster.wait(job.id, timeout_s=60)
    assert done.status.value == "failed"
    assert done.restarts == 0  # the same on every attempt: not retried
    assert "No module named 'mytrain_not_installed'" in (done.error or "")


@pytest.mark.parametrize("name", ["image", "text", "stream"])
def test_each_example_has_a_job_spec_naming_it(name: str) -> None:
    import yaml

    path = Path(__file__).parents[1] / "examples" / f"{name}.yaml"
    spec = JobSpec.model_validate(yaml.safe_load(path.read_text()))
    assert spec.workload.entrypoint == f"examples.{name}:train"


def test_the_text_model_takes_a_ranks_empty_share() -> None:
    """A rank whose share is 0 samples runs the body on an empty batch: the loss is 0, comes
    from the model (a sharded job back-propagates it through every layer) and moves nothing."""
    model = text.TinyCausalLM(vocab=64, width=32, layers=2, longest=32, dropout=0.0)
    loss, tokens = text.token_loss(model, text.pad_collate([]))
    assert loss.item() == 0.0 and int(tokens) == 0 and loss.requires_grad
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)
