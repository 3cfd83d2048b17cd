"""A job entrypoint that keeps a plain Hugging Face ``Trainer``: its module imports transformers
only (the Trainer brings Accelerate, which the runtime's guard then sees)."""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainingArguments

from examples import hf_causal_lm


def train(ctx: Any) -> None:
    args = TrainingArguments(output_dir=ctx.output_dir, max_steps=5, report_to="none")
    trainer = Trainer(
        model=hf_causal_lm.model_of({}),
        args=args,
        train_dataset=hf_causal_lm.dataset({"sequences": 64}),
        data_collator=hf_causal_lm.collate,
    )
    trainer.train()
