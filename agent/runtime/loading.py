"""This rank's batches from a map-style dataset: in the training process, or loaded ahead by
DataLoader worker processes under the plan in force.

:class:`WorkerLoader` hands PyTorch's own ``DataLoader`` (the user's dataset, ``collate_fn``,
workers, prefetch, seeds) a ``batch_sampler`` that never ends and asks the runtime what to load
next: the coming iterations' passes of this rank's share under the plan in force (one request per
pass, ``prefetch_factor * num_workers`` ahead, as the DataLoader keeps them). A worker returns each
request collated by the user's ``collate_fn`` (as a plain DataLoader would) and, when plans can
change (more than one rank), the same samples packed uncollated (:mod:`agent.runtime.packing`).

A plan agreed at a boundary may give this rank another slice of a global batch that is already
loaded. Then the batch is assembled in the training process: the samples the stale requests of
that iteration hold are kept, only the ones they miss are read here, and the user's ``collate_fn``
runs on the result. The stall is the time to read the difference (a plan usually moves a few
samples between neighbours), never a whole share again; for the later iterations loaded ahead
under the old plan, the samples they miss are read at once by a background thread, so by their
turn they are usually there. The same happens when running out of memory splits a pass into
smaller ones. (So a dataset must also be readable in the training process, from a thread.) Every sample of a global batch is taken by exactly one
rank whatever happened, because which samples a rank takes is decided by the sampler, not by
what was loaded (:mod:`agent.runtime.sampler`).

Requests are served in the order they were made, so the pipeline is a queue of (iteration,
indices) matched one for one with the DataLoader's results. A rank whose share is 0 still sends
one empty request per iteration, so the queue moves on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory

from agent.runtime.datasets import Collate, LoaderSettings, Passes, Source, empty_like, fetch
from agent.runtime.packing import Packed, pack

_NOTHING = torch.empty(0, dtype=torch.long)


class SerialLoader(Source):
    """Every batch read and collated in the training process, when it is needed."""

    def __init__(self, dataset: Any, settings: LoaderSettings) -> None:
        self.dataset, self.settings = dataset, settings
        self.size = len(dataset)
        self._empty: Any = None

    def take(self, iteration: int, indices: torch.Tensor) -> Any:
        batch = self.settings.collate_fn(fetch(self.dataset, indices.tolist()))
        if self._empty is None:
            self._empty = empty_like(batch)
        return batch

    def empty(self) -> Any:
        if self._empty is None:
            self._empty = empty_like(self.take(-1, torch.zeros(1, dtype=torch.long)))
        return self._empty


@dataclass
class Loaded:
    """One request as a worker returns it: the collated batch, and the samples packed when
    they may have to be collated again."""

    batch: Any
    raw: Packed | None

    def pin_memory(self) -> Loaded:
        """What a DataLoader's pin-memory thread calls: pin the batch, not the raw samples."""
        return Loaded(pin_memory(self.batch), self.raw)


class _WorkerCollate:
    """The collate function a worker runs: the user's, plus the packed samples."""

    def __init__(self, collate: Collate, retain: bool) -> None:
        self.collate, self.retain = collate, retain

    def __call__(self, samples: list[Any]) -> Loaded:
        if not samples:  # the placeholder of an iteration where this rank takes nothing
            return Loaded(None, None)
        return Loaded(self.collate(samples), pack(samples) if self.retain else None)


class _Requests:
    """The never-ending ``batch_sampler``: each ``next`` is the loader's next request."""

    def __init__(self, next_request: Callable[[], list[int]]) -> None:
        self._next = next_request

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return self._next()


class WorkerLoader(Source):
    """Batches loaded ahead by DataLoader workers under the plan in force (module docstring)."""

    def __init__(
        self, dataset: Any, settings: LoaderSettings, *, rank: int, seed: int, retain: bool
    ) -> None:
        self.dataset, self.settings = dataset, settings
        self.size = len(dataset)
        self.reloaded = 0
        """Samples read again in this process because the plan or the passes changed."""
        self._passes: Passes = lambda _: []
        self._consumer = 0
        """The iteration the training loop takes batches of."""
        self._cursor = -1
        self._queue: deque[torch.Tensor] = deque()
        """The cursor iteration's passes not requested yet."""
        self._pending: deque[tuple[int, torch.Tensor]] = deque()
        """Requests made and not yet received, in order."""
        self._ready: dict[int, list[tuple[torch.Tensor, Loaded]]] = {}
        self._iter: Iterator[Loaded] | None = None
        self._moved: dict[int, Future[dict[int, Any]]] = {}
        """Iteration -> the samples its stale requests miss, being read in the background."""
        self._reader: ThreadPoolExecutor | None = None
        self._empty: Any = None
        self.pin = settings.pin_memory and torch.cuda.is_available()
        # Augmentations differ between ranks as between workers (the user's generator, if any,
        # is the same on every rank: mixing the rank in keeps the ranks' draws apart).
        generator = torch.Generator()
        base = settings.generator.initial_seed() if settings.generator is not None else seed
        generator.manual_seed((base * 1_000_003 + 7919 * (rank + 1)) % (2**63 - 1))
        self._loader = DataLoader(
            dataset,
            batch_sampler=_Requests(self._next_request),
            collate_fn=_WorkerCollate(settings.collate_fn, retain),
            generator=generator,
            pin_memory=self.pin,
            **settings.loader_kwargs(),
        )

    def expect(self, passes: Passes) -> None:
        self._passes = passes

    def take(self, iteration: int, indices: torch.Tensor) -> Any:
        if iteration < 0:
            return self._assemble(iteration, indices)
        self._consumer = iteration
        for it in [k for k in self._ready if k < iteration]:
            del self._ready[it]
        for it in [k for k in self._moved if k < iteration]:
            del self._moved[it]
        if self._iter is None:
            self._iter = iter(self._loader)
        while self._pending and self._pending[0][0] <= iteration:
            loaded = next(self._iter)
            it, idx = self._pending.popleft()
            if it >= iteration and loaded.batch is not None:
                self._ready.setdefault(it, []).append((idx, loaded))
        for idx, loaded in self._ready.get(iteration, ()):
            if torch.equal(idx, indices):
                if self._empty is None:
                    self._empty = empty_like(loaded.batch)
                return loaded.batch
        self._read_moved(after=iteration)
        return self._assemble(iteration, indices)

    def empty(self) -> Any:
        if self._empty is None:
            self._empty = empty_like(self._assemble(-1, torch.zeros(1, dtype=torch.long)))
        return self._empty

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None
        it, self._iter = self._iter, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _next_request(self) -> list[int]:
        if self._cursor < self._consumer:  # the loop moved past what was requested
            self._cursor, self._queue = self._consumer, deque(self._passes_at(self._consumer))
        while not self._queue:
            self._cursor += 1
            self._queue = deque(self._passes_at(self._cursor))
        idx = self._queue.popleft()
        self._pending.append((self._cursor, idx))
        return idx.tolist()

    def _passes_at(self, iteration: int) -> list[torch.Tensor]:
        return [p for p in self._passes(iteration) if len(p)] or [_NOTHING]

    def _read_moved(self, after: int) -> None:
        """The plan changed under requests already made: start reading, in the background,
        the samples the coming iterations' stale requests miss."""
        held: dict[int, set[int]] = {}
        for it, idx in self._pending:
            held.setdefault(it, set()).update(idx.tolist())
        for it, entries in self._ready.items():
            for idx, _ in entries:
                held.setdefault(it, set()).update(idx.tolist())
        for it, have in held.items():
            if it <= after or it in self._moved:
                continue
            missing = [i for p in self._passes(it) for i in p.tolist() if i not in have]
            if missing:
                if self._reader is None:
                    workers = max(1, self.settings.num_workers)
                    self._reader = ThreadPoolExecutor(workers, "evenflow-moved-samples")
                self._moved[it] = self._reader.submit(self._read, missing)
                self.reloaded += len(missing)

    def _read(self, indices: list[int]) -> dict[int, Any]:
        return dict(zip(indices, fetch(self.dataset, indices), strict=True))

    def _assemble(self, iteration: int, indices: torch.Tensor) -> Any:
        """The batch of ``indices`` from the samples this iteration's requests hold (and the
        ones read for it in the background), reading only what is still missing here."""
        have: dict[int, Any] = {}
        for idx, loaded in self._ready.get(iteration, ()):
            if loaded.raw is not None:
                have.update(zip(idx.tolist(), loaded.raw.samples(), strict=True))
        moved = self._moved.pop(iteration, None)
        if moved is not None:
            have.update(moved.result())
        want = indices.tolist()
        missing = [i for i in want if i not in have]
        if missing:
            have.update(zip(missing, fetch(self.dataset, missing), strict=True))
            if iteration >= 0:
                self.reloaded += len(missing)
        batch = self.settings.collate_fn([have[i] for i in want])
        return pin_memory(batch) if self.pin else batch
