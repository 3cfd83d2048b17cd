"""What ``ctx.batches`` accepts as a dataset, and how a rank takes its samples from it."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

DatasetLike = torch.Tensor | tuple[torch.Tensor, ...] | Dataset[Any]
"""A tensor or tuple of tensors indexed on dim 0, or a map-style ``Dataset`` (collated)."""


def dataset_size(dataset: DatasetLike) -> int:
    """Samples in a dataset: dim 0 of its tensors (which must agree), or ``len``."""
    if isinstance(dataset, tuple):
        sizes = {t.shape[0] for t in dataset}
        if len(sizes) != 1:
            raise ValueError(f"dataset tensors disagree on their length: {sorted(sizes)}")
        return sizes.pop()
    return len(dataset)  # type: ignore[arg-type]


def take(dataset: DatasetLike, idx: torch.Tensor, device: torch.device) -> Any:
    """The samples at ``idx`` as one batch on ``device`` (tensors indexed, a Dataset collated)."""
    if isinstance(dataset, torch.Tensor):
        return dataset.index_select(0, idx.to(dataset.device)).to(device, non_blocking=True)
    if isinstance(dataset, tuple):
        return tuple(
            t.index_select(0, idx.to(t.device)).to(device, non_blocking=True) for t in dataset
        )
    batch = default_collate([dataset[i] for i in idx.tolist()])
    return _to_device(batch, device)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list | tuple):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch
