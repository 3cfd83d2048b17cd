"""What ``ctx.batches`` accepts, and the one interface the context draws batches through.

``ctx.batches(data)`` takes:

- tensors: a tensor or a tuple of tensors indexed on dim 0 (batches are slices, no collation);
- a map-style ``Dataset``: its samples collated by ``default_collate``, loaded in the training
  process;
- a ``torch.utils.data.DataLoader``: its dataset, ``collate_fn``, ``num_workers``,
  ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``,
  ``generator``, ``multiprocessing_context``, ``timeout`` and ``drop_last`` are kept; its batch
  size and sampler are replaced by the plan (a custom ``batch_sampler`` is refused);
- an ``IterableDataset`` (bare or in a DataLoader): a stream, split among the ranks
  (:mod:`agent.runtime.streams`).

Each becomes a :class:`Source`: ``take(iteration, indices)`` returns the collated batch of those
samples (dataset indices, or positions in a stream), ``expect(passes)`` tells it what this rank
takes at each iteration under the plan in force, so that it can load the coming ones ahead, and ``empty()`` is a batch of the same
structure with no samples (what a rank whose share is 0 trains on).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler

from agent.runtime.packing import map_containers

log = logging.getLogger("evenflow.runtime.datasets")

DatasetLike = torch.Tensor | tuple[torch.Tensor, ...] | Dataset[Any] | DataLoader[Any]
"""What ``ctx.batches`` accepts (see the module docstring)."""

Collate = Callable[[list[Any]], Any]

Passes = Callable[[int], list[torch.Tensor]]
"""This rank's passes (the indices of each) at an iteration, under the plan in force."""

REPLACEABLE_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler)
"""Samplers a DataLoader may carry without a warning: what they decide, the plan decides."""


class Source(ABC):
    """This rank's batches, drawn by index."""

    size: int | None
    """Samples in one epoch; None for a stream."""

    def expect(self, passes: Passes) -> None:
        """What this rank takes at each iteration under the plan in force (its passes), so
        that the coming ones can be loaded ahead. Nothing to do for a source that loads on
        demand."""
        return None

    @abstractmethod
    def take(self, iteration: int, indices: torch.Tensor) -> Any:
        """The collated batch of these samples (``iteration`` -1: load it now)."""

    def load(self, indices: torch.Tensor) -> Any:
        """A batch of these samples, loaded now (speed probes while excluded)."""
        return self.take(-1, indices)

    @abstractmethod
    def empty(self) -> Any:
        """A batch of the usual structure with no samples."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the source beyond the iteration (a stream's layout)."""
        return {}

    def rank_state(self) -> dict[int, int] | None:
        """A position this rank alone knows (how far it read its shards), gathered from every
        rank into checkpoints; None when the iteration says where every rank stands."""
        return None

    def restore(self, positions: dict[int, int]) -> None:
        """Start where a checkpoint's gathered positions say."""
        return None

    def close(self) -> None:
        """Stop loading (worker processes end)."""
        return None


class TensorSource(Source):
    """Slices of tensors (or of a tuple of tensors of one length)."""

    def __init__(self, data: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        if isinstance(data, tuple):
            sizes = {t.shape[0] for t in data}
            if len(sizes) != 1:
                raise ValueError(f"dataset tensors disagree on their length: {sorted(sizes)}")
            self.size = sizes.pop()
        else:
            self.size = data.shape[0]
        self.data = data

    def take(self, iteration: int, indices: torch.Tensor) -> Any:
        if isinstance(self.data, torch.Tensor):
            return self.data.index_select(0, indices.to(self.data.device))
        return tuple(t.index_select(0, indices.to(t.device)) for t in self.data)

    def empty(self) -> Any:
        return self.take(-1, torch.empty(0, dtype=torch.long))


@dataclass(frozen=True)
class LoaderSettings:
    """What is kept of a user's DataLoader (everything but its batch size and sampler)."""

    num_workers: int = 0
    collate_fn: Collate = default_collate
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    worker_init_fn: Callable[[int], None] | None = None
    generator: torch.Generator | None = None
    multiprocessing_context: Any = None
    timeout: float = 0.0
    drop_last: bool = False
    batch_size: int | None = None
    """The user's batch size: a stream is read in pieces of it (see ``streams``)."""

    @classmethod
    def of(cls, loader: DataLoader[Any]) -> LoaderSettings:
        """The settings of ``loader``; raises ``ValueError`` for one whose batches cannot be
        replaced by the plan's."""
        streaming = isinstance(loader.dataset, IterableDataset)
        if loader.batch_size is None:  # a batch_sampler of the user's, or items that are batches
            custom = loader.batch_sampler is not None
            what = "a custom batch_sampler" if custom else "batch_size=None (each item a batch)"
            raise ValueError(
                f"this DataLoader has {what}: Evenflow's plan decides every rank's batch. "
                "Pass DataLoader(dataset, batch_size=..., collate_fn=..., num_workers=...) "
                "and let ctx.batches split each global batch of the job's global_batch samples"
            )
        if not streaming and not isinstance(loader.sampler, REPLACEABLE_SAMPLERS):
            log.warning(
                "the DataLoader's %s is replaced: every epoch is one seeded permutation of the "
                "dataset, split among the ranks by the plan",
                type(loader.sampler).__name__,
            )
        return cls(
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn or default_collate,
            pin_memory=loader.pin_memory,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            worker_init_fn=loader.worker_init_fn,
            generator=loader.generator,
            multiprocessing_context=loader.multiprocessing_context,
            timeout=loader.timeout,
            drop_last=loader.drop_last,
            batch_size=loader.batch_size,
        )

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a DataLoader that loads like the user's."""
        kwargs: dict[str, Any] = {
            "num_workers": self.num_workers,
            "worker_init_fn": self.worker_init_fn,
            "multiprocessing_context": self.multiprocessing_context,
            "timeout": self.timeout,
        }
        if self.num_workers > 0:
            kwargs["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
        return kwargs


def fetch(dataset: Any, indices: list[int]) -> list[Any]:
    """The samples at ``indices``, in order, read in this process (a dataset's batched
    ``__getitems__`` when it has one, as DataLoader workers do)."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems:
        return list(getitems(indices))
    return [dataset[i] for i in indices]


def empty_like(batch: Any) -> Any:
    """A batch of the same structure with no samples: tensors and arrays cut to 0 rows along
    dim 0, lists of plain values (one per sample) emptied, other containers recursed."""
    if isinstance(batch, torch.Tensor):
        return batch[:0] if batch.dim() else batch
    if hasattr(batch, "shape") and hasattr(batch, "__getitem__") and len(batch.shape):
        return batch[:0]  # a numpy array
    if isinstance(batch, list) and all(isinstance(x, str | bytes | int | float) for x in batch):
        return []
    return map_containers(batch, empty_like)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (copies are non-blocking)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return map_containers(batch, lambda b: to_device(b, device))


def as_source(
    data: Any, *, rank: int, seed: int, global_batch: int, world_size: int
) -> tuple[Source, LoaderSettings]:
    """The :class:`Source` that serves ``data`` to this rank (see the module docstring)."""
    from agent.runtime.loading import SerialLoader, WorkerLoader
    from agent.runtime.streams import StreamLoader

    if isinstance(data, torch.Tensor | tuple):
        return TensorSource(data), LoaderSettings()
    if isinstance(data, DataLoader):
        settings, dataset = LoaderSettings.of(data), data.dataset
    elif isinstance(data, Dataset):
        settings, dataset = LoaderSettings(), data
    else:
        raise TypeError(
            "ctx.batches() takes a DataLoader, a Dataset, an IterableDataset, a tensor or a "
            f"tuple of tensors, not {type(data).__name__}"
        )
    if isinstance(dataset, IterableDataset):
        stream = StreamLoader(
            dataset,
            settings,
            global_batch=global_batch,
            seed=seed,
            rank=rank,
            world_size=world_size,
        )
        return stream, settings
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"{type(dataset).__name__} has no len(): a map-style Dataset needs one")
    if settings.num_workers == 0:
        return SerialLoader(dataset, settings), settings
    return WorkerLoader(dataset, settings, rank=rank, seed=seed, retain=world_size > 1), settings
