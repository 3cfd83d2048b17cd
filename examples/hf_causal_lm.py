"""A small Llama causal language model trained by the Hugging Face ``Trainer`` under Evenflow.

The model is built from a tiny config (nothing is downloaded); the data are ``examples/text.py``'s
variable-length sequences, padded by a collator that gives ``input_ids``, ``attention_mask`` and
``labels`` (-100 on padding). ``EvenflowTrainer(ctx, ...)`` replaces ``Trainer(...)``: each rank
trains on its share from Evenflow's plan, and the per-token loss is normalised over every real
target token of the global batch, so the model is the one a single process trains on the same
batches. The lines that differ from the same script under ``torchrun`` are marked ``# evenflow``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from evenflow.integrations.huggingface import EvenflowTrainer
from examples.text import Sequences

PAD = 0


def collate(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sequence; padding is masked and is no target (-100)."""
    longest = max((len(s) for s in seqs), default=1)
    ids = torch.full((len(seqs), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = s
        mask[j, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def model_of(args: dict[str, Any]) -> LlamaForCausalLM:
    """A two-layer Llama from a config. (Llama rather than GPT-2: GPT-2's attention has a key
    bias, which gets no gradient at all, softmax being blind to a shift, so Adam turns float
    noise there into full-size steps and no two runs agree on it to 1e-5.)"""
    torch.manual_seed(int(args.get("seed", 0)))
    config = LlamaConfig(
        vocab_size=int(args.get("vocab", 64)),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=float(args.get("dropout", 0.0)),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config)


def dataset(args: dict[str, Any]) -> Sequences:
    return Sequences(
        int(args.get("sequences", 4096)), int(args.get("vocab", 64)), int(args.get("longest", 32))
    )


def arguments(args: dict[str, Any], output_dir: str, **more: Any) -> TrainingArguments:
    """The run's TrainingArguments (the single-process reference uses the same)."""
    return TrainingArguments(
        output_dir=output_dir,
        learning_rate=float(args.get("lr", 3e-3)),
        weight_decay=0.01,
        max_grad_norm=float(args.get("clip", 1.0)),
        lr_scheduler_type="cosine",
        warmup_steps=int(args.get("warmup", 2)),
        logging_steps=int(args.get("logging_steps", 5)),
        save_steps=int(args.get("save_steps", 500)),
        bf16=bool(args.get("bf16", False)),
        use_cpu=not torch.cuda.is_available(),  # (the Trainer's own rule for bf16 on a CPU)
        dataloader_num_workers=int(args.get("workers", 0)),
        report_to="none",
        disable_tqdm=True,
        seed=int(args.get("seed", 0)),
        **more,
    )


def train(ctx: Any) -> None:
    """The job's entrypoint (``workload.entrypoint: examples.hf_causal_lm:train``)."""
    args = ctx.args
    trainer = EvenflowTrainer(  # evenflow: was Trainer(
        ctx,  # evenflow
        model=model_of(args),
        args=arguments(args, str(args.get("hf_dir", ctx.output_dir))),
        train_dataset=dataset(args),
        data_collator=collate,
    )
    trainer.train()
    if args.get("out") or ctx.checkpointer is not None:
        ctx.save_final(str(args["out"]) if args.get("out") else None)  # evenflow
