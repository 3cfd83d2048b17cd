"""A stream (an ``IterableDataset``) split among the ranks in proportion to their shares.

A stream has no length and no index, so the ranks cannot each read only their own samples: every
rank reads the same stream, in the same order, and keeps the samples of its slice of each global
batch (global batch ``i`` is the stream's samples ``[i*B, (i+1)*B)``; rank ``r`` takes the
contiguous part the plan in force gives it, :class:`~agent.runtime.sampler.StreamSampler`). So no
sample is used twice and none is skipped, whatever the plans, and a plan change needs nothing
loaded again. The cost is that every rank reads (and decodes) the whole stream: worth it where
reading is cheap against training; a stream that is expensive to read is better cut into a
map-style dataset.

The same order on every rank: the stream is read through a DataLoader like the user's (same
``num_workers``, ``worker_init_fn``, and a generator seeded the same on every rank: the user's,
else the job's seed), in pieces of the user's batch size. With workers, a DataLoader hands out
each worker's pieces in turn, so with the user's batch size the stream is exactly the sequence of
samples their own single-process DataLoader would produce, and with ``batch_size == global_batch``
each global batch is exactly one of their batches.

Workers send their pieces packed (:mod:`agent.runtime.packing`) and the rank collates its slice
with the user's ``collate_fn`` here. Pieces behind the current global batch are dropped, so memory
stays at the DataLoader's prefetch plus one global batch.

The position is the iteration (``i*B`` samples have gone by): a resumed job reads the stream from
its start and drops what it had trained on, which costs reading it again. A stream that ends
before the job's last iteration ends the job with :class:`StreamEnded` on every rank at the same
iteration, never a hang.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from agent.runtime.datasets import LoaderSettings, Source, empty_like
from agent.runtime.packing import Packed, pack

PIECE = 64
"""Samples per piece when the user gave no batch size (a bare IterableDataset)."""


class StreamEnded(RuntimeError):
    """The stream ran out before the job's last iteration."""


def _as_list(samples: list[Any]) -> list[Any]:
    return samples


class _Piece:
    """A run of consecutive samples of the stream, unpacked on first use."""

    __slots__ = ("_packed", "_samples", "start")

    def __init__(self, start: int, data: Packed | list[Any]) -> None:
        self.start = start
        self._packed = data if isinstance(data, Packed) else None
        self._samples = None if isinstance(data, Packed) else data

    def __len__(self) -> int:
        return len(self._packed if self._packed is not None else self._samples or ())

    def samples(self) -> list[Any]:
        if self._samples is None:
            assert self._packed is not None
            self._samples, self._packed = self._packed.samples(), None
        return self._samples


class StreamLoader(Source):
    """Every rank reads the stream and keeps its slice of each global batch (module docstring)."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
        settings: LoaderSettings,
        *,
        global_batch: int,
        seed: int,
    ) -> None:
        self.size = None
        self.dataset, self.settings = dataset, settings
        self.global_batch = global_batch
        self.piece = settings.batch_size or PIECE
        generator = settings.generator
        if generator is None:  # the same on every rank: the stream must be
            generator = torch.Generator().manual_seed(seed)
        self._loader = DataLoader(
            dataset,
            batch_size=self.piece,
            collate_fn=pack if settings.num_workers > 0 else _as_list,
            generator=generator,
            **settings.loader_kwargs(),
        )
        self._iter: Iterator[Packed | list[Any]] | None = None
        self._pieces: deque[_Piece] = deque()
        self._read = 0
        """Samples of the stream read so far."""
        self._empty: Any = None
        self.pin = settings.pin_memory and torch.cuda.is_available()

    def take(self, iteration: int, indices: torch.Tensor) -> Any:
        if not len(indices):
            return self.empty()
        first, end = int(indices[0]), int(indices[-1]) + 1
        if iteration >= 0:
            self._drop_before(iteration * self.global_batch)
        while self._read < end:
            self._pull(iteration, end)
        return self._collate(self._slice(first, end))

    def load(self, indices: torch.Tensor) -> Any:
        """Samples for a speed probe: the first ones buffered (a probe trains on nothing)."""
        if not self._pieces:
            self._pull(-1, self._read + 1)
        samples = [s for p in self._pieces for s in p.samples()][: len(indices)]
        return self._collate(samples)

    def empty(self) -> Any:
        if self._empty is None:
            self._empty = empty_like(self.load(torch.zeros(1, dtype=torch.long)))
        return self._empty

    def state(self) -> dict[str, Any]:
        return {"stream_piece": self.piece, "num_workers": self.settings.num_workers}

    def close(self) -> None:
        it, self._iter = self._iter, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _pull(self, iteration: int, end: int) -> None:
        if self._iter is None:
            self._iter = iter(self._loader)
        try:
            data = next(self._iter)
        except StopIteration:
            raise StreamEnded(
                f"the IterableDataset ended after {self._read} samples, but iteration "
                f"{iteration} needs samples up to {end} (global batch {self.global_batch}): "
                "give the job fewer iterations, or a stream that does not end"
            ) from None
        piece = _Piece(self._read, data)
        self._pieces.append(piece)
        self._read += len(piece)
        if iteration >= 0:
            self._drop_before(iteration * self.global_batch)

    def _drop_before(self, position: int) -> None:
        while self._pieces and self._pieces[0].start + len(self._pieces[0]) <= position:
            self._pieces.popleft()

    def _slice(self, first: int, end: int) -> list[Any]:
        out: list[Any] = []
        for p in self._pieces:
            lo, hi = max(first, p.start), min(end, p.start + len(p))
            if lo < hi:
                out.extend(p.samples()[lo - p.start : hi - p.start])
        return out

    def _collate(self, samples: list[Any]) -> Any:
        from torch.utils.data._utils.pin_memory import pin_memory

        batch = self.settings.collate_fn(samples)
        if self._empty is None:
            self._empty = empty_like(batch)
        return pin_memory(batch) if self.pin else batch
