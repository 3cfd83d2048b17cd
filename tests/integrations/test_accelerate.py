"""The Accelerate integration: the example as a job through the whole local stack (two gloo
ranks of unequal emulated speeds, so unequal shares and plan changes) ends with the model one
process trains with a plain ``Accelerator`` on the same global batches; a plain
``Accelerator().prepare`` in a job is refused; bad settings are refused at construction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from agent.runtime.guards import PLAIN_ACCELERATOR
from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec
from evenflow.integrations._common import IntegrationError, check_version
from evenflow.integrations.accelerate import EvenflowAccelerator
from evenflow.local_cluster import LocalCluster
from examples import accelerate_text, text
from tests.test_examples import ITERATIONS, SEED, B, _global_batch, assert_same, run

NO_EXCLUSION = {"policy": {"name": "minmax", "explore_iterations": 3, "exclude": False}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("accelerate"), workers=2, agents=1) as c:
        yield c


def one_process(args: dict[str, Any]) -> torch.nn.Module:
    """The same loop with a plain Accelerator in this process, on the job's global batches."""
    data = text.dataset(args)
    model, opt, sched = text.build(args, ITERATIONS)
    accelerator = Accelerator(cpu=True)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    sampler = GlobalBatchSampler(len(data), B, seed=SEED)
    for it in range(ITERATIONS):
        batch = text.pad_collate([data[i] for i in _global_batch(sampler, it)])
        loss, _ = accelerate_text.token_mean(model, batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return accelerator.unwrap_model(model)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "engine", [{"engine": "ddp"}, {"gradient_sync": "overlap"}, {"engine": "fsdp"}], ids=str
)
def test_the_accelerate_example_equals_one_process(
    cluster: LocalCluster, tmp_path: Path, engine: dict[str, str]
) -> None:
    args = {"sequences": 400, "dropout": 0.0, "workers": 1, "seed": 2}
    state = run(
        cluster,
        "examples.accelerate_text:train",
        args,
        tmp_path / "final.pt",
        **engine,
        **NO_EXCLUSION,
    )
    assert_same(state, one_process(args))


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("plain_accelerate:train", "EvenflowAccelerator(ctx)"),
        ("plain_trainer:train", "EvenflowTrainer(ctx"),
    ],
)
def test_a_plain_accelerator_in_a_job_is_refused_at_prepare(
    cluster: LocalCluster, function: str, says: str
) -> None:
    """Accelerate imported by the entrypoint's module (by transformers' Trainer, too)."""
    spec = JobSpec.model_validate(
        {
            "name": "plain-accelerator",
            "workload": {"entrypoint": f"tests.integrations.{function}"},
            "global_batch": B,
            "iterations": 5,
            "workers": 2,
            "max_restarts": 0,
        }
    )
    done = cluster.wait(cluster.submit(spec).id, timeout_s=120)
    assert done.status.value == "failed"
    assert PLAIN_ACCELERATOR[:60] in (done.error or "")
    assert says in (done.error or "")


def stand_in(**spec: Any) -> Any:
    """What EvenflowAccelerator reads before training: the job's spec (a real one)."""
    job = JobSpec.model_validate(
        {
            "name": "x",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "iterations": 4,
            "workers": 2,
            **spec,
        }
    )
    return SimpleNamespace(spec=job, device=torch.device("cpu"), rank=0, world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"gradient_accumulation_steps": 4}, "splits a share larger"),
        ({"mixed_precision": "fp16"}, "use mixed_precision='bf16'"),
        ({"fsdp_plugin": object()}, "set `engine: fsdp`"),
    ],
)
def test_settings_that_fight_the_plan_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(IntegrationError, match=says):
        EvenflowAccelerator(stand_in(policy={"exclude": False}), **kwargs)


def test_a_job_that_may_exclude_ranks_is_refused() -> None:
    with pytest.raises(IntegrationError, match=r"policy: \{exclude: false\}"):
        EvenflowAccelerator(stand_in())


def test_a_version_outside_the_range_is_refused_with_the_range() -> None:
    with pytest.raises(IntegrationError, match=r"accelerate>=1.0,<2"):
        check_version("accelerate", "2.1.0")
    with pytest.raises(IntegrationError, match=r"transformers>=4.50,<6"):
        check_version("transformers", "4.40.0")
    assert check_version("accelerate") >= "1"


def test_each_example_has_a_job_spec_that_forbids_exclusion() -> None:
    import yaml

    for name in ("accelerate_text",):
        path = Path(__file__).parents[2] / "examples" / f"{name}.yaml"
        spec = JobSpec.model_validate(yaml.safe_load(path.read_text()))
        assert spec.workload.entrypoint == f"examples.{name}:train"
        assert spec.policy.exclude is False


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_evaluation_loader_is_split_over_the_ranks_and_reduced(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A second DataLoader in prepare: every item on exactly one rank; reduce and gather
    combine over the ranks."""
    import json

    out = tmp_path / "eval.json"
    spec = JobSpec.model_validate(
        {
            "name": "accelerate-eval",
            "workload": {
                "entrypoint": "tests.integrations.accelerate_eval:train",
                "args": {"out": str(out)},
            },
            "global_batch": B,
            "iterations": 4,
            "workers": 2,
            "max_restarts": 0,
            **NO_EXCLUSION,
        }
    )
    done = cluster.wait(cluster.submit(spec).id, timeout_s=120)
    assert done.status.value == "succeeded", done.error
    seen = json.loads(out.read_text())
    assert seen["counts"] == [37.0, float(sum(range(37)))]
    assert seen["ranks"] == [0.0, 1.0]
