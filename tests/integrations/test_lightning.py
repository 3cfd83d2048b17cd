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
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from agent.runtime.checkpoint import Checkpointer, CheckpointStore
from agent.runtime.context import EvenflowContext
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from contract.agent import MetricPoint
from contract.spec import CheckpointSpec, JobSpec
from evenflow.integrations import lightning as ef
from evenflow.local_cluster import LocalCluster
from examples import lightning_text
from examples.text import pad_collate
from tests.runtime.spawn import run_ranks
from tests.runtime.test_loop import Script

B, ITERATIONS, SEED = 32, 12, 5
EMULATION = [{"per_sample_ms": 1.5}, {"per_sample_ms": 4.5}]  # rank 0 three times as fast
ARGS: dict[str, Any] = {"sequences": 400, "dropout": 0.0, "workers": 1, "seed": 2, "clip": 0.5}

# Lightning's advice (num_workers, log intervals) and its torch deprecations, in this process.
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
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


def one_process(args: dict[str, Any], precision: Any = "32-true") -> torch.nn.Module:
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
def test_the_lightning_example_equals_one_lightning_process(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Clipping and a per-step OneCycle schedule on, a per-token loss (a mean over tokens with
    their count); and ``self.log`` values arrive as the job's metrics, at their iterations."""
    args = {**ARGS, "out": str(tmp_path / "final.pt")}
    job, state = run(cluster, args)
    assert_same(state, one_process(args))
    metrics = cluster.client.metrics(job)
    assert {"loss", "train.loss", "lr", "epoch"} <= set(metrics.names), metrics.names
    series = {(s.name, s.rank): s for s in metrics.series}
    assert ("lr", 1) not in series  # from rank 0, as Lightning's loggers
    lr = series[("lr", 0)]
    assert lr.iteration == list(range(ITERATIONS))
    assert lr.value == pytest.approx(one_cycle_lrs(3e-3), rel=1e-6)
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


# ------------------------------------------------------------------ in one process (world 1)


_OUT: list[Path] = []
"""The running test's directory: a local context's output_dir (Lightning writes its own
checkpoints there), never the working directory."""


@pytest.fixture(autouse=True)
def _output_dir(tmp_path: Path) -> Iterator[None]:
    _OUT.append(tmp_path / "out")
    yield
    _OUT.pop()


def local_context(
    args: dict[str, Any],
    *,
    checkpoints: Path | None = None,
    every: int = 4,
    points: list[MetricPoint] | None = None,
    **extra: Any,
) -> EvenflowContext:
    """A real single-rank context (no process group): the integration's logic, in seconds."""
    spec = JobSpec.model_validate(
        {
            "name": "lightning-local",
            "workload": {"entrypoint": "examples.lightning_text:train", "seed": SEED, "args": args},
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": 1,
            "policy": {"exclude": False},
            **extra,
        }
    )
    agreement = PlanAgreement(
        RuntimePlan(1, (B,)), rank=0, world_size=1, global_batch=B, pipelined=False
    )
    checkpointer = None
    if checkpoints is not None:
        checkpointer = Checkpointer(CheckpointStore(str(checkpoints)), every)
    return EvenflowContext(
        spec,
        agreement,
        rank=0,
        world_size=1,
        checkpointer=checkpointer,
        submit_metric=None if points is None else points.append,
        output_dir=str(_OUT[-1]),
    )


def fit(ctx: EvenflowContext, args: dict[str, Any], **kwargs: Any) -> L.LightningModule:
    model, data = lightning_text.parts(args)
    settings = {
        "gradient_clip_val": float(args["clip"]),
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
        **kwargs,
    }
    t = ef.trainer(ctx, **settings)
    t.fit(model, datamodule=data)
    assert t.global_step == ITERATIONS
    return model


class _Crash(Exception):
    pass


class CrashAt(L.Callback):
    def __init__(self, ctx: EvenflowContext, iteration: int) -> None:
        self.ctx, self.iteration = ctx, iteration

    def on_train_batch_start(self, *args: Any) -> None:
        if self.ctx.iteration == self.iteration:
            raise _Crash


@pytest.mark.timeout(120)
@pytest.mark.parametrize("every", [4, 5])
def test_a_restarted_job_resumes_lightnings_state(tmp_path: Path, every: int) -> None:
    """100 sequences: 4 iterations an epoch, so 12 iterations are 3 of Lightning's epochs, and
    the checkpoint the job resumes from is at an epoch's end (every 4) or inside one (every 5).
    Loops, schedule and optimizer resume: the model equals one uninterrupted Lightning run."""
    args = {**ARGS, "sequences": 100}
    crash_at = 2 * every
    ctx = local_context(args, checkpoints=tmp_path, every=every)
    with pytest.raises(_Crash):
        fit(ctx, args, callbacks=[CrashAt(ctx, crash_at)])
    assert ctx.checkpointer is not None and max(ctx.checkpointer.store.iterations()) == crash_at
    ctx = local_context(args, checkpoints=tmp_path, every=every)
    model = fit(ctx, args)
    assert ctx.stats.resumed_from == crash_at
    assert ctx.ended
    assert_same(model.state_dict(), one_process(args), rtol=1e-6)


@pytest.mark.timeout(60)
def test_logged_names_become_job_metric_names() -> None:
    assert [ef.metric_name(k) for k in ("loss", "train/loss", "val acc", "_x")] == [
        "lightning.loss",
        "train.loss",
        "val_acc",
        "m_x",
    ]
    points: list[MetricPoint] = []
    args = {**ARGS, "sequences": 100}
    fit(local_context(args, points=points), args)
    lr = [p for p in points if p.name == "lr"]
    assert [p.iteration for p in lr] == list(range(ITERATIONS))
    assert [p.value for p in lr] == pytest.approx(one_cycle_lrs(3e-3), rel=1e-6)
    assert {"train.loss", "epoch"} <= {p.name for p in points}


@pytest.mark.timeout(60)
def test_bf16_mixed_precision_trains_on_cpu() -> None:
    """bf16 autocast on CPU: the same run as one Lightning process (one rank: the same batches
    and shapes), to bf16's precision (Evenflow back-propagates the mean times its count, which
    bf16 rounds differently: about 1e-3 after 12 AdamW steps)."""
    args = {**ARGS, "sequences": 100}
    model = fit(local_context(args), args, precision="bf16-mixed")
    reference = one_process(args, precision="bf16-mixed")
    for name, p in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], p, rtol=1e-2, atol=3e-3), name
    start = lightning_text.parts(args)[0].state_dict()
    assert not torch.allclose(
        start["model.positions"], p := reference.state_dict()["model.positions"]
    )


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("found", ["2.4.3", "2.7.0", "3.0.0", "1.9.5"])
def test_a_lightning_outside_the_supported_range_is_refused(found: str) -> None:
    with pytest.raises(RuntimeError, match=r"supports lightning >=2\.5,<2\.7.*has lightning"):
        ef.check_version(found)
    ef.check_version("2.5.0")
    ef.check_version("2.6.6")


def test_the_extra_and_the_check_name_the_same_range() -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"lightning{ef.SUPPORTED}"' in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulate_grad_batches": 4}, r"global_batch \(32\).*instead"),
        ({"strategy": "deepspeed_stage_2"}, r"engine: fsdp"),
        ({"strategy": "fsdp"}, r"engine: fsdp"),
        ({"devices": 4}, r"ask for 4 processes, but this job runs on 1 workers"),
        ({"num_nodes": 2, "devices": 2}, r"ask for 4 processes"),
        ({"accelerator": "gpu"}, r"this rank's device is cpu"),
        ({"max_steps": 300}, r"the job's length is its spec's iterations: 12"),
        ({"max_epochs": 3}, r"the job's length is its spec's iterations"),
        ({"sync_batchnorm": True}, r"sync_batchnorm is not supported"),
    ],
)
def test_a_launch_that_conflicts_with_the_plan_is_refused(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ef.IntegrationError, match=match):
        ef.trainer(local_context(ARGS), **kwargs)


def test_a_plain_ddp_launch_that_agrees_with_the_job_is_taken() -> None:
    t = ef.trainer(local_context(ARGS), strategy="ddp", devices=1, max_steps=ITERATIONS)
    assert isinstance(t.strategy, ef.EvenflowStrategy)
    assert t.max_steps == ITERATIONS


def test_a_job_that_may_exclude_ranks_is_refused() -> None:
    ctx = local_context(ARGS, policy={"exclude": True})
    with pytest.raises(ef.IntegrationError, match=r"policy: \{exclude: false\}"):
        ef.trainer(ctx)
    with pytest.raises(ef.IntegrationError, match=r"policy: \{exclude: false\}"):
        ef.EvenflowStrategy(ctx)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2"),
        ({"max_steps": 5}, r"disagree with the job spec's iterations: 12"),
        ({"limit_train_batches": 0.5}, r"limit_train_batches"),
        ({"reload_dataloaders_every_n_epochs": 1}, r"reload_dataloaders_every_n_epochs"),
    ],
)
def test_the_strategy_on_a_trainer_of_ones_own_refuses_what_conflicts(
    kwargs: dict[str, Any], match: str
) -> None:
    """``L.Trainer(strategy=EvenflowStrategy(ctx), ...)`` directly: refused at fit's start."""
    ctx = local_context(ARGS)
    t = L.Trainer(strategy=ef.EvenflowStrategy(ctx), **{"max_steps": ITERATIONS, **kwargs})
    model, data = lightning_text.parts(ARGS)
    with pytest.raises(ef.IntegrationError, match=match):
        t.fit(model, datamodule=data)


class _Manual(lightning_text.LitCausalLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.timeout(60)
def test_manual_optimization_is_refused() -> None:
    t = ef.trainer(local_context(ARGS))
    with pytest.raises(ef.IntegrationError, match="manual optimization"):
        t.fit(_Manual(), datamodule=lightning_text.parts(ARGS)[1])


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("engine", "per"), [({"gradient_sync": "overlap"}, "sequence"), ({"engine": "fsdp"}, "token")]
)
def test_the_lightning_example_under_each_engine(
    cluster: LocalCluster, tmp_path: Path, engine: dict[str, str], per: str
) -> None:
    """DDP's bucketed all-reduce during backward (Lightning's forward through the wrapper
    ``ctx.prepare`` returns), with the loss a plain mean over the batch's sequences; and FSDP2
    sharding the module's transformer layers."""
    args = {**ARGS, "per": per, "out": str(tmp_path / "final.pt")}
    _, state = run(cluster, args, **engine)
    assert_same(state, one_process(args))


# ------------------------------------------------ two ranks under scripted plans (spawned)

# (iteration from which the leader proposes it, plan): unequal shares, rank 1 given nothing for
# a while (an empty batch: its training step still runs), then rank 0 capped at 5 samples a pass
# (its share of 18 comes as 4 passes in one Lightning step).
SCRIPT = [
    (2, RuntimePlan(2, (22, 10), B)),
    (5, RuntimePlan(3, (32, 0), B)),
    (8, RuntimePlan(4, (18, 14), B, memory_caps=(5, 0))),
]


def _scripted_rank(
    rank: int, world: int, args: dict[str, Any], sync: str, root: str
) -> dict[str, Any]:
    proposer = Script(SCRIPT)
    agreement = PlanAgreement(
        RuntimePlan(1, (16, 16), B),
        rank=rank,
        world_size=world,
        global_batch=B,
        propose=proposer,
        pipelined=False,
    )
    spec = JobSpec.model_validate(
        {
            "name": "lightning-scripted",
            "workload": {"entrypoint": "examples.lightning_text:train", "seed": SEED},
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": world,
            "policy": {"exclude": False},
        }
    )
    ctx = EvenflowContext(spec, agreement, rank=rank, world_size=world, gradient_sync=sync)
    proposer.ctx = ctx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # validation every epoch (4 iterations) with sync_dist logging, and Lightning's own
        # ModelCheckpoint: the strategy's reduce, broadcast and barrier over the two ranks
        model = fit(
            ctx,
            args,
            limit_val_batches=1.0,
            enable_checkpointing=True,
            default_root_dir=root,
        )
    state = {k: v.tolist() for k, v in model.state_dict().items()}  # (tensors die with the rank)
    val = model.trainer.callback_metrics["val_loss"].item()
    return {"state": state, "history": ctx.agreement.history, "val_loss": val}


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sync", ["coalesced", "overlap"])
def test_empty_shares_and_passes_train_exactly(sync: str, tmp_path: Path) -> None:
    args = {**ARGS, "sequences": 100, "validation": 64}
    runs = run_ranks(_scripted_rank, 2, args, sync, str(tmp_path), timeout=150)
    assert [v for _, v in runs[0]["history"]] == [1, 2, 3, 4]
    reference = one_process(args)
    for run_ in runs:
        assert_same({k: torch.tensor(v) for k, v in run_["state"].items()}, reference)
    assert runs[0]["val_loss"] == runs[1]["val_loss"]  # (sync_dist: reduced over both ranks)
    saved = sorted(p.name for p in tmp_path.rglob("*.ckpt"))  # rank 0 wrote Lightning's own
    assert saved == ["epoch=2-step=12.ckpt"], saved


class StopAt(L.Callback):
    """Stops the fit after ``iteration``'s step: Lightning's way or Evenflow's."""

    def __init__(self, ctx: EvenflowContext, iteration: int, how: str) -> None:
        self.ctx, self.iteration, self.how = ctx, iteration, how

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.ctx.iteration == self.iteration:
            if self.how == "lightning":
                trainer.should_stop = True
            else:
                self.ctx.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["lightning", "evenflow"])
def test_stopping_early_ends_the_jobs_loop(how: str) -> None:
    args = {**ARGS, "sequences": 100}
    ctx = local_context(args)
    model, data = lightning_text.parts(args)
    t = ef.trainer(ctx, limit_val_batches=0, callbacks=[StopAt(ctx, 5, how)])
    t.fit(model, datamodule=data)
    # Lightning stops after iteration 5's step; ctx.stop()'s request travels in iteration 6's
    # all-reduce, which ends the loop after that one
    steps = 6 if how == "lightning" else 7
    assert t.global_step == ctx.stats.iterations == ctx.stats.stopped_at == steps
    assert ctx.ended


def test_the_example_has_a_job_spec_naming_it() -> None:
    import yaml

    path = Path(__file__).parents[2] / "examples" / "lightning_text.yaml"
    spec = JobSpec.model_validate(yaml.safe_load(path.read_text()))
    assert spec.workload.entrypoint == "examples.lightning_text:train"
    assert spec.policy.exclude is False


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_job_restarted_after_a_crash_resumes_lightning_exactly(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Rank 1 is killed in iteration 9; the control plane restarts the job, which resumes from
    the checkpoint after iteration 8 (Evenflow's, with Lightning's state in it: 100 sequences,
    so 4 iterations an epoch, the resume at an epoch's end) and ends with the model of one
    uninterrupted Lightning process."""
    args = {
        **ARGS,
        "sequences": 100,
        "crash_at": 9,
        "marker": str(tmp_path / "died"),
        "out": str(tmp_path / "final.pt"),
    }
    spec = job_spec(args).model_copy(
        update={
            "workload": job_spec(args).workload.model_copy(
                update={"entrypoint": "tests.integrations.lightning_workload:train_dying_once"}
            ),
            "checkpoint": CheckpointSpec(every_iterations=4, path=str(tmp_path / "ckpt")),
            "max_restarts": 2,
        }
    )
    job = cluster.submit(spec)
    done = cluster.wait(job.id, timeout_s=240)
    assert done.status.value == "succeeded", done.error
    assert done.restarts == 1
    assert done.restart_history[0].resumed_from == 8
    state = torch.load(args["out"], weights_only=True)
    assert_same(state, one_process(args))


@pytest.mark.timeout(60)
def test_fp16_with_a_gradient_scaler_is_refused_at_fit() -> None:
    """(A GPU's 16-mixed; on CPUs Lightning makes none. Several optimizers need manual
    optimization in Lightning 2, refused above.)"""
    scaler = torch.amp.GradScaler("cpu")
    t = ef.trainer(local_context(ARGS), plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    with pytest.raises(ef.IntegrationError, match=r"use precision='bf16-mixed'"):
        t.fit(*lightning_text.parts(ARGS))
