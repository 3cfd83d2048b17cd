"""Refuse framework set-ups that would fight the runtime, at the first call that makes them.

A job's entrypoint that builds a plain ``accelerate.Accelerator`` and calls its ``prepare``
would wrap the model in a second DistributedDataParallel (gradients reduced twice, once by
Accelerate and once by the runtime) and shard the data a second way (a rank whose share is 0
would wait in an all-reduce the others never join). After the entrypoint's module is imported,
:func:`guard_frameworks` makes ``Accelerator.prepare`` raise, with what to do instead, unless the
accelerator says it is Evenflow's (the class attribute ``evenflow_aware``, set by
``evenflow.integrations.accelerate.EvenflowAccelerator``; the runtime does not import it).
Accelerate imported only inside the entrypoint function is not seen here.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["PLAIN_ACCELERATOR", "guard_frameworks"]

PLAIN_ACCELERATOR = (
    "a plain accelerate.Accelerator cannot prepare a model or DataLoader inside an Evenflow job: "
    "it would wrap the model in a second DistributedDataParallel (every gradient reduced twice) "
    "and shard the data its own way (a rank with a 0-sample share would hang the all-reduce). "
    "Use `from evenflow.integrations.accelerate import EvenflowAccelerator` and "
    "`accelerator = EvenflowAccelerator(ctx)` instead of `Accelerator()`: its prepare() gives "
    "each rank its share from the plan and reduces gradients once, exactly. A Hugging Face "
    "Trainer (which prepares through Accelerate): use `from evenflow.integrations.huggingface "
    "import EvenflowTrainer` and `EvenflowTrainer(ctx, model=..., args=...)` in place of "
    "`Trainer(...)` (docs/guide/huggingface.md)"
)


def guard_frameworks() -> None:
    """Make a plain ``Accelerator.prepare`` raise in this process (idempotent; nothing to do when
    Accelerate is not imported)."""
    module = sys.modules.get("accelerate.accelerator")
    if module is None:
        return
    cls: Any = module.Accelerator
    if getattr(cls.prepare, "_evenflow_guard", False):
        return
    original = cls.prepare

    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "evenflow_aware", False):
            raise RuntimeError(PLAIN_ACCELERATOR)
        return original(self, *args, **kwargs)

    prepare._evenflow_guard = True  # type: ignore[attr-defined]
    cls.prepare = prepare
