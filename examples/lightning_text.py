"""The causal language model of ``examples/text.py`` as a PyTorch Lightning project, trained
under Evenflow by ``evenflow.integrations.lightning``.

``LitCausalLM`` and ``TextData`` are plain Lightning: they train as they are with
``L.Trainer(accelerator="gpu", devices=4, strategy="ddp", ...)``. Under Evenflow only the launch
changes (``train`` below; ``docs/guide/lightning.md`` counts the lines). The per-token loss is
returned as ``{"loss": mean over the batch's real tokens, "count": those tokens}``: plain
Lightning back-propagates the mean, and Evenflow weights each rank's mean by its tokens, so the
update is that of the mean over every token of the global batch whatever the shares.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader

from examples.text import Sequences, TinyCausalLM, pad_collate, token_loss


class LitCausalLM(L.LightningModule):
    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        layers: int = 2,
        longest: int = 32,
        dropout: float = 0.1,
        lr: float = 3e-3,
        seed: int = 0,
        per: str = "token",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.model = TinyCausalLM(vocab, width, layers, longest, dropout)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mask)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if len(batch["input_ids"]) == 0:  # a worker given no samples this step (Evenflow)
            return self._nothing()
        loss, tokens = token_loss(self, batch)
        if self.hparams["per"] == "sequence":  # a mean over the batch's sequences
            mean = loss / max(len(batch["input_ids"]), 1)
            self.log("train/loss", mean.detach(), on_step=True)
            return mean
        mean = loss / tokens  # a mean over the batch's real tokens, and their number
        self.log("train/loss", mean.detach(), on_step=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True)
        return {"loss": mean, "count": tokens}

    def _nothing(self) -> Any:
        """An empty share's step: it takes part (a forward through every layer, as a sharded
        model's collectives need) and adds nothing (its loss is 0, over 0 samples)."""
        one = pad_collate([torch.ones(2, dtype=torch.long)])
        loss, _ = token_loss(self, {k: v.to(self.device) for k, v in one.items()})
        return {"loss": loss * 0, "count": 0}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, tokens = token_loss(self, batch)
        self.log("val_loss", loss / tokens, sync_dist=True)

    def configure_optimizers(self) -> Any:
        lr = self.hparams["lr"]
        opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=lr, total_steps=int(self.trainer.estimated_stepping_batches)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TextData(L.LightningDataModule):
    def __init__(
        self,
        sequences: int = 4096,
        vocab: int = 64,
        longest: int = 32,
        batch_size: int = 64,
        workers: int = 1,
        validation: int = 0,
    ) -> None:
        super().__init__()
        self.sequences, self.vocab, self.longest = sequences, vocab, longest
        self.batch_size, self.workers, self.validation = batch_size, workers, validation

    def setup(self, stage: str) -> None:
        self.train_set = Sequences(self.sequences, self.vocab, self.longest)
        self.val_set = Sequences(self.validation, self.vocab, self.longest, seed=1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,  # under Evenflow the spec's global_batch rules
            shuffle=True,
            collate_fn=pad_collate,
            num_workers=self.workers,
        )

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=64, collate_fn=pad_collate)


def parts(args: dict[str, Any]) -> tuple[LitCausalLM, TextData]:
    """The module and the datamodule a job's ``workload.args`` describe."""
    model = LitCausalLM(
        vocab=int(args.get("vocab", 64)),
        width=int(args.get("width", 32)),
        layers=int(args.get("layers", 2)),
        longest=int(args.get("longest", 32)),
        dropout=float(args.get("dropout", 0.1)),
        lr=float(args.get("lr", 3e-3)),
        seed=int(args.get("seed", 0)),
        per=str(args.get("per", "token")),
    )
    data = TextData(
        sequences=int(args.get("sequences", 4096)),
        vocab=int(args.get("vocab", 64)),
        longest=int(args.get("longest", 32)),
        workers=int(args.get("workers", 1)),
        validation=int(args.get("validation", 0)),
    )
    return model, data


def train(ctx: Any) -> None:
    """The job's entrypoint (``workload.entrypoint: examples.lightning_text:train``)."""
    from evenflow.integrations.lightning import trainer

    args = ctx.args
    model, data = parts(args)
    fit = trainer(
        ctx,
        gradient_clip_val=float(args.get("clip", 1.0)),
        precision=str(args.get("precision", "32-true")),
        limit_val_batches=1.0 if int(args.get("validation", 0)) else 0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    fit.fit(model, datamodule=data)
    if args.get("out") or ctx.checkpointer is not None:
        ctx.save_final(str(args["out"]) if args.get("out") else None)


def own_loop(ctx: Any) -> None:
    """The same training through Evenflow's own loop (``ctx.batches``/``ctx.backward``), no
    Lightning: the baseline of ``bench/lightning_overhead.py``."""
    args = ctx.args
    lit, data = parts(args)
    data.setup("fit")
    loader = data.train_dataloader()
    model = lit.model
    lr = float(args.get("lr", 3e-3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = ctx.total_iterations(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    model, opt = ctx.prepare(model, opt)
    ctx.register_state("sched", sched)
    for batch in ctx.batches(loader):
        if len(batch["input_ids"]) == 0:  # a worker given no samples: a forward, times 0
            one = pad_collate([torch.ones(2, dtype=torch.long)])
            loss, tokens = token_loss(model, one)
            loss, tokens = loss * 0, 0
        else:
            loss, tokens = token_loss(model, batch)
        ctx.backward(loss, count=tokens)
        if ctx.sync_gradients:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(args.get("clip", 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
