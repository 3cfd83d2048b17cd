"""What to train: built-in workloads, and how a user's own code plugs in.

Built-ins need no download and are seeded (same on every rank):

- ``mlp``: a two-layer MLP regressing a fixed random linear teacher plus noise. ``args``:
  ``samples`` (4096), ``features`` (32), ``hidden`` (64), ``noise`` (0.1).
- ``cnn-digits``: a small CNN on scikit-learn's bundled 8x8 digits (1,797 images). ``args``:
  ``channels`` (8).

Every loss is ``reduction="sum"``: the runtime scales by ``1/B_global`` itself, which is what
makes unequal local batches exact.

User entrypoints
----------------
A job's ``workload.entrypoint`` is ``"package.module:function"``. The function receives the
:class:`~agent.runtime.context.EvenflowContext` and has two ways to work.

1. Return a :class:`Workload`; the runtime runs the loop::

       def make(ctx):
           model = MyNet()
           x, y = load_my_tensors()
           return Workload(model, (x, y), lambda out, y: F.cross_entropy(out, y, reduction="sum"))

2. Keep your own loop (``docs/guide/porting.md`` goes through a port line by line)::

       def train(ctx):
           model, opt = ctx.prepare(model, opt)             # device, rank 0's weights
           for x, y in ctx.batches(loader):                  # this rank's share, plan-aware
               loss = F.cross_entropy(model(x), y, reduction="sum")   # SUM, not mean
               ctx.backward(loss)                            # count= for a per-token loss
               if ctx.sync_gradients:                        # gradients all-reduced
                   clip_grad_norm_(model.parameters(), 1.0)
                   opt.step(); sched.step(); opt.zero_grad()

   ``ctx.batches`` takes a DataLoader (its workers, ``collate_fn`` and prefetch are kept; the
   plan replaces its batch size and sampler), a Dataset, an IterableDataset or tensors
   (:mod:`agent.runtime.datasets`). ``ctx.step(loss)`` is the shorthand for backward, then step
   and zero when synchronised. A share above this rank's memory cap comes as several batches
   (passes) of one iteration: ``ctx.backward`` each, and step and zero only under
   ``ctx.sync_gradients`` (a step or a zeroing between the passes raises). Wrap the body in
   ``with ctx.recoverable():`` and a pass that runs out of device memory is redone in smaller
   passes instead of failing the job (a returned ``Workload`` does this).

   Every rank in the loop runs the body every iteration: a rank whose share is 0 samples gets
   an empty batch (same structure, 0 rows), so schedulers and EMAs stepped in the body stay the
   same everywhere; the ranks compare parameter checksums now and then and fail the job if they
   differ (:class:`~agent.runtime.context.ReplicaDivergence`). ``ctx.all_reduce(value, op)`` is a
   global metric over the ranks in the loop and ``ctx.shard(data)`` this rank's part of an
   evaluation set; ``ctx.stop()`` on one rank ends the job on all.

   While a plan *excludes* this rank (partial all-reduce, :mod:`agent.runtime.membership`),
   ``ctx.batches()`` yields nothing: the body is skipped for every iteration the rank sits out,
   and the next batch it yields is that of the iteration it is readmitted at (``ctx.iteration``
   jumps there), with the model's parameters and buffers, the optimizer's state and what was
   registered with ``ctx.register_state`` already replaced by the group's. Meanwhile it times
   probes on its own: a forward + backward of a small batch through ``ctx.probe_loss(batch)``
   if set (a returned ``Workload`` sets it from its ``loss_fn``), else the model's output
   summed, gradients discarded. When the loop ends every rank holds the trained model,
   including one still excluded at the end, so saving on rank 0 stays right.

Checkpoints
-----------
With ``checkpoint`` in the spec the context writes checkpoints itself (model, optimizer, position
in the data, RNG states) and, when the job is restarted after a failure, ``ctx.batches()``
resumes from the newest one: ``ctx.iteration`` starts there and the model and optimizer are
already restored. State of the loop's own goes in with ``ctx.on_checkpoint(name, save, load)``
(``save()`` returns any picklable object; ``load(obj)`` puts it back on every rank) or
``ctx.register_state(name, obj)`` for anything with ``state_dict``/``load_state_dict`` (an LR
scheduler); register before the loop. After the loop, ``ctx.save_final()`` writes the trained
model to the checkpoint directory (or ``ctx.save_final(path)`` anywhere fsspec can write).

``ctx.args`` is the job's ``workload.args``, ``ctx.seed`` its seed, ``ctx.device`` the device.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent.runtime.errors import EntrypointError
from agent.runtime.guards import guard_frameworks
from contract.spec import WorkloadSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(model_output, targets)`` -> the SUM of per-sample losses (a scalar)."""

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Workload:
    """A model, its dataset as ``(inputs, targets)`` tensors, and a summed loss."""

    model: nn.Module
    dataset: tuple[torch.Tensor, torch.Tensor]
    loss_fn: LossFn
    optimizer: OptimizerFactory | None = None
    """Builds the optimizer; default plain SGD at the job's learning rate."""


def _arg(spec: WorkloadSpec, name: str, default: Any) -> Any:
    value = spec.args.get(name, default)
    if type(value) is not type(default):
        raise ValueError(f"workload.args.{name} must be {type(default).__name__}")
    return value


def mlp(spec: WorkloadSpec) -> Workload:
    """Regress a fixed random linear teacher with a tanh MLP (synthetic, seeded)."""
    n = _arg(spec, "samples", 4096)
    d = _arg(spec, "features", 32)
    h = _arg(spec, "hidden", 64)
    noise = float(_arg(spec, "noise", 0.1))
    g = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(n, d, generator=g)
    teacher = torch.randn(d, 1, generator=g) / d**0.5
    y = x @ teacher + noise * torch.randn(n, 1, generator=g)
    torch.manual_seed(spec.seed)
    model = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, 1))
    return Workload(model, (x, y), _mse_sum)


def cnn_digits(spec: WorkloadSpec) -> Workload:
    """A two-conv CNN on scikit-learn's bundled 8x8 digits (no download)."""
    from sklearn.datasets import load_digits

    c = _arg(spec, "channels", 8)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    torch.manual_seed(spec.seed)
    model = nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(2 * c * 4 * 4, 10),
    )
    return Workload(model, (x, y), _cross_entropy_sum)


def _mse_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y, reduction="sum")


def _cross_entropy_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="sum")


BUILTINS: dict[str, Callable[[WorkloadSpec], Workload]] = {"mlp": mlp, "cnn-digits": cnn_digits}


def builtin(spec: WorkloadSpec) -> Workload:
    """The built-in workload the spec names."""
    if spec.builtin is None:
        raise ValueError("workload names no builtin")
    return BUILTINS[spec.builtin](spec)


def load_entrypoint(ref: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` and return the function; ``EntrypointError`` (the
    job cannot run: no restart helps) when it cannot."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise EntrypointError(f"entrypoint {ref!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as exc:  # the same on every rank, every attempt
        raise EntrypointError(
            f"entrypoint {ref!r} cannot be imported: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        fn: Callable[..., Any] = getattr(module, attr)
    except AttributeError:
        raise EntrypointError(f"entrypoint {ref!r}: module has no attribute {attr!r}") from None
    if not callable(fn):
        raise EntrypointError(f"entrypoint {ref!r} is not callable")
    guard_frameworks()  # a plain Accelerator the module imported: refused at its prepare()
    return fn
