"""The Lightning integration: the example as a real job through the local stack (control plane,
agent, two gloo ranks at unequal emulated speeds, so unequal shares and plan changes) ends with
the model a single-process Lightning run makes on the same global batches; ``self.log`` reaches
the job's metrics; a restarted job resumes Lightning's state; bad launches are refused."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster
from examples import lightning_text
from examples.text import pad_collate

B, ITERATIONS, SEED = 32, 12, 5
EMULATION = [{"per_sample_ms": 1.5}, {"per_sample_ms": 4.5}]  # rank 0 three times as fast
ARGS = {"sequences": 400, "dropout": 0.0, "workers": 1, "seed": 2, "clip": 0.5}

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:lightning.*", "ignore::DeprecationWarning"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("lightning"), workers=2, agents=1) as c:
        yield c


def job_spec(args: dict[str, Any], **extra: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "lightning-text",
            "workload": {
                "entrypoint": "examples.lightning_text:train",
                "seed": SEED,
                "args": args,
            },
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": 2,
            "emulation": EMULATION,
            "policy": {"name": "minmax", "explore_iterations": 3, "exclude": False},
            **extra,
        }
    )


def run(cluster: LocalCluster, args: dict[str, Any], **extra: Any) -> tuple[int, dict[str, Any]]:
    job = cluster.submit(job_spec(args, **extra))
    done = cluster.wait(job.id, timeout_s=240)
    assert done.status.value == "succeeded", done.error
    plans = {tuple(p.batch_sizes) for p in cluster.client.plans(job.id).items}
    assert any(a != b for a, b in plans), plans  # the ranks had unequal shares
    state: dict[str, Any] = torch.load(args["out"], weights_only=True)
    return job.id, state


class _GlobalBatches(torch.utils.data.Sampler[list[int]]):
    """The job's global batches, in its order (its seed's permutation, epoch after epoch)."""

    def __init__(self, size: int, iterations: int) -> None:
        self.sampler = GlobalBatchSampler(size, B, seed=SEED)
        self.iterations = iterations

    def __len__(self) -> int:
        return self.iterations

    def __iter__(self) -> Iterator[list[int]]:
        for it in range(self.iterations):
            epoch, k = self.sampler.position(it)
            idx = self.sampler.permutation(epoch)[k * B : k * B + self.sampler.global_count(it)]
            yield [int(i) for i in idx]


def one_process(args: dict[str, Any], precision: str = "32-true") -> torch.nn.Module:
    """Plain Lightning in this process, fed the job's global batches."""
    model, data = lightning_text.parts(args)
    data.setup("fit")
    loader = DataLoader(
        data.train_set,
        batch_sampler=_GlobalBatches(len(data.train_set), ITERATIONS),
        collate_fn=pad_collate,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=ITERATIONS,
            gradient_clip_val=float(args["clip"]),
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        t.fit(model, train_dataloaders=loader)
    return model


def assert_same(state: dict[str, Any], model: torch.nn.Module, rtol: float = 1e-5) -> None:
    for name, p in model.state_dict().items():
        diff = (state[name] - p).abs().max().item()
        assert torch.allclose(state[name], p, rtol=rtol, atol=rtol / 10), (name, diff)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("per", ["token", "sequence"])
def test_the_lightning_example_equals_one_lightning_process(
    cluster: LocalCluster, tmp_path: Path, per: str
) -> None:
    """Clipping and a per-step OneCycle schedule on; per-token (the loss a mean over tokens with
    their count) and per-sequence (a plain mean) losses."""
    args = {**ARGS, "per": per, "out": str(tmp_path / "final.pt")}
    job, state = run(cluster, args)
    assert_same(state, one_process(args))
    if per == "token":  # self.log values arrive as the job's metrics, at their iterations
        metrics = cluster.client.metrics(job)
        assert {"loss", "train.loss", "lr", "epoch"} <= set(metrics.names), metrics.names
        series = {(s.name, s.rank): s for s in metrics.series}
        assert ("lr", 1) not in series  # from rank 0, as Lightning's loggers
        lr = series[("lr", 0)]
        assert lr.iteration == list(range(ITERATIONS))
        assert lr.value == pytest.approx(one_cycle_lrs(float(args.get("lr", 3e-3))), rel=1e-6)
        assert len(series[("train.loss", 0)].value) == ITERATIONS


def one_cycle_lrs(lr: float) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=ITERATIONS)
    out = []
    for _ in range(ITERATIONS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out
