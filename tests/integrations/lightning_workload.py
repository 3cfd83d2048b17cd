"""A job entrypoint for the Lightning tests: the example, whose rank 1 dies (SIGKILL, as a crash
would) once, at the start of iteration ``crash_at`` of the job's first attempt."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as L

from evenflow.integrations.lightning import trainer
from examples import lightning_text


class DieOnce(L.Callback):
    def __init__(self, ctx: Any, iteration: int, marker: Path) -> None:
        self.ctx, self.iteration, self.marker = ctx, iteration, marker

    def on_train_batch_start(self, *args: Any) -> None:
        it, first = self.ctx.iteration, not self.marker.exists()
        if self.ctx.rank == 1 and it == self.iteration and first:
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def train_dying_once(ctx: Any) -> None:
    args = ctx.args
    model, data = lightning_text.parts(args)
    fit = trainer(
        ctx,
        gradient_clip_val=float(args["clip"]),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        callbacks=[DieOnce(ctx, int(args["crash_at"]), Path(args["marker"]))],
    )
    fit.fit(model, datamodule=data)
    assert fit.global_step == ctx.spec.iterations
    ctx.save_final(str(args["out"]))
