"""The Hugging Face Trainer integration: the example (a GPT-2 built from a config) as a job
through the whole local stack (two gloo ranks of unequal emulated speeds, so unequal shares and
plan changes) ends with the model a plain ``Trainer`` trains in one process on the same global
batches, to 1e-5 relative in fp32, with clipping and a warmup + cosine schedule on; its logs
arrive as job metrics; arguments that fight the plan are refused at start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from transformers import Trainer

from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec
from evenflow.integrations._common import IntegrationError
from evenflow.integrations.huggingface import EvenflowTrainer, metric_name
from evenflow.local_cluster import LocalCluster
from examples import hf_causal_lm
from tests.test_examples import ITERATIONS, SEED, B, _global_batch, assert_same, run

NO_EXCLUSION = {"policy": {"name": "minmax", "explore_iterations": 3, "exclude": False}}
ARGS = {"sequences": 400, "dropout": 0.0, "workers": 1, "seed": 2, "logging_steps": 4}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("huggingface"), workers=2, agents=1) as c:
        yield c


class InOrder(Dataset[torch.Tensor]):
    """The job's global batches one after another (a sequential sampler reads them in order)."""

    def __init__(self, args: dict[str, Any]) -> None:
        data = hf_causal_lm.dataset(args)
        sampler = GlobalBatchSampler(len(data), B, seed=SEED)
        self.items = [data[i] for it in range(ITERATIONS) for i in _global_batch(sampler, it)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def one_process(args: dict[str, Any], out: Path) -> Any:
    """A plain Trainer in this process on the same global batches (its own num_items_in_batch
    makes the loss the mean over the batch's real target tokens)."""
    model = hf_causal_lm.model_of(args)
    targs = hf_causal_lm.arguments(
        args,
        str(out),
        per_device_train_batch_size=B,
        max_steps=ITERATIONS,
        train_sampling_strategy="sequential",
    )
    Trainer(
        model=model, args=targs, train_dataset=InOrder(args), data_collator=hf_causal_lm.collate
    ).train()
    return model


PASSES = [  # rank 0 holds 12 samples a pass: its share comes as several passes
    {"per_sample_ms": 1.5, "memory_mb": 12, "memory_per_sample_mb": 1.0},
    {"per_sample_ms": 4.5},
]
VARIANTS = {
    "ddp-with-passes": {"emulation": PASSES},
    "overlap": {"gradient_sync": "overlap"},
    "fsdp": {"engine": "fsdp"},
}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_trainer_example_equals_one_process_and_logs_metrics(
    cluster: LocalCluster, tmp_path: Path, variant: str
) -> None:
    args = {**ARGS, "hf_dir": str(tmp_path / "hf")}
    extra = {**NO_EXCLUSION, **VARIANTS[variant]}
    state = run(cluster, "examples.hf_causal_lm:train", args, tmp_path / "final.pt", **extra)
    assert_same(state, one_process(ARGS, tmp_path / "reference"))
    job = max(j.id for j in cluster.client.jobs().items if j.name == "hf_causal_lm")
    names = set(cluster.client.metrics(job).names)
    # the Trainer's logs (its `loss` under `train_loss`), next to the runtime's own `loss`
    assert {"loss", "train_loss", "learning_rate", "grad_norm", "train_loss_mean"} <= names


def stand_in(**spec: Any) -> Any:
    job = JobSpec.model_validate(
        {
            "name": "x",
            "workload": {"builtin": "mlp"},
            "global_batch": 32,
            "iterations": 4,
            "workers": 2,
            "policy": {"exclude": False},
            **spec,
        }
    )
    return SimpleNamespace(
        spec=job,
        device=torch.device("cpu"),
        rank=0,
        world_size=2,
        total_iterations=lambda data: 4,
    )


@pytest.mark.parametrize(
    ("more", "says"),
    [
        ({"gradient_accumulation_steps": 2}, "leave it at 1"),
        (
            {"per_device_train_batch_size": 5},
            r"leave per_device_train_batch_size out \(or set it to 16\)",
        ),
        ({"max_steps": 9}, "the job runs 4 iterations"),
        ({"fp16": False, "fsdp": "full_shard"}, "set `engine: fsdp`"),
        ({"eval_strategy": "steps", "eval_steps": 2}, "evaluate after trainer.train"),
    ],
)
def test_arguments_that_fight_the_plan_are_refused(
    tmp_path: Path, more: dict[str, Any], says: str
) -> None:
    targs = hf_causal_lm.arguments({}, str(tmp_path), **more)
    with pytest.raises(IntegrationError, match=says):
        EvenflowTrainer(
            stand_in(),
            model=hf_causal_lm.model_of({}),
            args=targs,
            train_dataset=hf_causal_lm.dataset({"sequences": 8}),
            data_collator=hf_causal_lm.collate,
        )


def test_per_device_batch_at_its_default_or_the_even_split_is_accepted() -> None:
    from evenflow.integrations.huggingface import check_arguments

    for per_device in (8, 16):
        targs = hf_causal_lm.arguments({}, "/tmp/unused", per_device_train_batch_size=per_device)
        check_arguments(stand_in(), targs)


def test_a_job_that_may_exclude_ranks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IntegrationError, match=r"policy: \{exclude: false\}"):
        EvenflowTrainer(
            stand_in(policy={"exclude": True}),
            model=hf_causal_lm.model_of({}),
            args=hf_causal_lm.arguments({}, str(tmp_path)),
        )


def test_the_loss_metric_is_renamed() -> None:
    assert metric_name("loss", summary=False) == "train_loss"
    assert metric_name("train_loss", summary=True) == "train_loss_mean"
    assert metric_name("learning_rate", summary=False) == "learning_rate"


def test_the_example_has_a_job_spec_that_forbids_exclusion() -> None:
    import yaml

    path = Path(__file__).parents[2] / "examples" / "hf_causal_lm.yaml"
    spec = JobSpec.model_validate(yaml.safe_load(path.read_text()))
    assert spec.workload.entrypoint == "examples.hf_causal_lm:train"
    assert spec.policy.exclude is False


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_restarted_trainer_job_resumes_from_its_checkpoint_and_still_matches(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Each rank fails at step 6 of its first attempt; the restart resumes at the job's
    checkpoint of iteration 4 (model, optimizer, data position, the Trainer's step and
    scheduler) and ends with the single-process model all the same."""
    args = {
        **ARGS,
        "hf_dir": str(tmp_path / "hf"),
        "marker": str(tmp_path / "crashed"),
        "crash_at": 6,
    }
    extra = {**NO_EXCLUSION, "checkpoint": {"every_iterations": 4}, "max_restarts": 1}
    state = run(cluster, "tests.integrations.hf_crash:train", args, tmp_path / "final.pt", **extra)
    job = cluster.client.job(max(j.id for j in cluster.client.jobs().items))
    assert job.restarts == 1
    (restart,) = job.restart_history
    assert restart.resumed_from == 4
    assert_same(state, one_process(ARGS, tmp_path / "reference"))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bf16_trains_on_cpu_under_autocast(cluster: LocalCluster, tmp_path: Path) -> None:
    """bf16=True runs (CPU autocast): the model comes out near the fp32 one but not equal to it,
    so the forward really ran in bf16."""
    args = {**ARGS, "hf_dir": str(tmp_path / "hf"), "bf16": True}
    state = run(cluster, "examples.hf_causal_lm:train", args, tmp_path / "final.pt", **NO_EXCLUSION)
    fp32 = one_process(ARGS, tmp_path / "reference").state_dict()
    diffs = [(state[k] - p).abs().max().item() for k, p in fp32.items()]
    assert 1e-4 < max(diffs) < 5e-2, max(diffs)
