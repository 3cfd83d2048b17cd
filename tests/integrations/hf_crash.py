"""The Trainer example, failing once (each rank, at the Trainer's step ``crash_at``) on its first
attempt: the job's restart must resume from its checkpoint, Trainer state included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from examples import hf_causal_lm


class CrashOnce(TrainerCallback):  # type: ignore[misc]
    def __init__(self, marker: Path, at: int) -> None:
        self.marker, self.at = marker, at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at and not self.marker.exists():
            self.marker.touch()
            raise RuntimeError(f"crashing once at step {self.at} (test)")


def train(ctx: Any) -> None:
    marker = Path(ctx.args["marker"] + f".{ctx.rank}")
    original = hf_causal_lm.EvenflowTrainer

    def with_crash(*a: Any, **k: Any) -> Any:
        trainer = original(*a, **k)
        trainer.add_callback(CrashOnce(marker, int(ctx.args["crash_at"])))
        return trainer

    hf_causal_lm.EvenflowTrainer = with_crash  # type: ignore[misc,assignment]
    try:
        hf_causal_lm.train(ctx)
    finally:
        hf_causal_lm.EvenflowTrainer = original  # type: ignore[misc]
