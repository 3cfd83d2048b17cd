"""Checkpoints a failed job resumes from exactly: where they live, what they hold, how they are
written and read back.

A checkpoint is one file ``ckpt-<iteration>.pt`` (``torch.save`` of a dict) in the job's
checkpoint directory, any fsspec URL (a local directory, ``file://``, ``memory://``, an object
store). It holds everything an exact resume needs (:func:`snapshot`): the model's and the
optimizer's state, the iteration to run next and its place in the epoch (the sampler derives
every later batch from it, whatever the number of workers), the RNG states (torch, Python's
``random``, numpy, CUDA when present), the plan in force, the job's sample count, and what the
user's loop registered with ``ctx.on_checkpoint``.

Written atomically: the bytes go to a hidden temporary name in the same directory, which is then
renamed; a reader lists only finished names, so it never sees half a file. After each write the
oldest are deleted until ``keep`` remain. Reading (:meth:`CheckpointStore.load_latest`) tries
the newest first and falls back to the one before when a file is unreadable or not a
checkpoint (corrupted, truncated by hand, another program's file).

A directory that cannot be written is found before training starts
(:meth:`CheckpointStore.check_writable`, :class:`CheckpointPathError`): the job fails at once with
the reason, not at its first checkpoint.

The files are the job's own, written by its own code, so they are loaded with
``weights_only=False`` (user state may be any picklable object): whoever can write the
directory can already run code as the job.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from agent.runtime.errors import FatalJobError
from agent.runtime.plan_sync import RuntimePlan
from agent.runtime.resync import resync
from agent.runtime.sampler import Sampler

log = logging.getLogger("evenflow.runtime.checkpoint")

FORMAT = 1
"""Version of the checkpoint dict's layout."""
NAME = re.compile(r"^ckpt-(\d{12})\.pt$")
FINAL_NAME = "final.pt"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or cannot resume this job."""


class CheckpointPathError(CheckpointError, FatalJobError):
    """The checkpoint directory cannot be written: the job cannot run as specified."""


class CheckpointEngineError(CheckpointError, FatalJobError):
    """The newest checkpoint was written by a job of another engine (ddp / fsdp)."""


@dataclass(frozen=True)
class Saved:
    """One checkpoint written."""

    iteration: int
    """The iteration a resume runs next (iterations before it are in the checkpoint)."""
    size_bytes: int
    url: str
    write_ms: float
    """Host time to serialise and write it (the training loop waits this long)."""


def file_name(iteration: int) -> str:
    return f"ckpt-{iteration:012d}.pt"


def shards_name(iteration: int) -> str:
    """The directory of a sharded checkpoint's model and optimizer (torch.distributed.checkpoint
    format: every rank's shards and one metadata file); its ``.pt`` is written after it, so a
    reader that finds the ``.pt`` finds the shards complete."""
    return f"ckpt-{iteration:012d}.shards"


class CheckpointStore:
    """A job's checkpoint directory at ``url``, keeping the newest ``keep`` checkpoints."""

    def __init__(self, url: str, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.url = url.rstrip("/")
        self.keep = keep
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def check_writable(self) -> None:
        """Create the directory and write, read and delete a probe file in it; raise
        :class:`CheckpointPathError` naming the path and the cause if any step fails."""
        probe = self._path(f".probe-{uuid.uuid4().hex}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"evenflow")
            with self.fs.open(probe, "rb") as f:
                if f.read() != b"evenflow":
                    raise OSError("a probe file read back differently")
            self.fs.rm(probe)
        except Exception as exc:
            raise CheckpointPathError(
                f"checkpoint.path {self.url!r} cannot be written: {type(exc).__name__}: {exc}"
            ) from exc

    def iterations(self) -> list[int]:
        """Iterations of the finished checkpoints present, oldest first."""
        try:
            names = [str(p).rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        found = (NAME.match(n) for n in names)
        return sorted(int(m.group(1)) for m in found if m)

    def write_bytes(self, name: str, data: bytes) -> str:
        """Write ``data`` as ``name`` atomically (temporary name, then rename); its URL."""
        write_atomic(self.fs, self._path(name), data)
        return self.url_of(name)

    def save(self, state: dict[str, Any]) -> Saved:
        """Write one checkpoint (``state["iteration"]`` names it) and prune old ones."""
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        iteration = int(state["iteration"])
        url = self.write_bytes(file_name(iteration), data)
        for old in self.iterations()[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._path(file_name(old)))
            with contextlib.suppress(FileNotFoundError):
                if self.fs.exists(self._path(shards_name(old))):
                    self.fs.rm(self._path(shards_name(old)), recursive=True)
        return Saved(iteration, len(data), url, (time.perf_counter() - t0) * 1000.0)

    def load(self, iteration: int) -> dict[str, Any]:
        """One checkpoint, read back; raises on an unreadable file or one of another format."""
        with self.fs.open(self._path(file_name(iteration)), "rb") as f:
            data = f.read()
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{file_name(iteration)} is not an Evenflow checkpoint")
        if int(state.get("iteration", -1)) != iteration:
            raise CheckpointError(f"{file_name(iteration)} holds iteration {state['iteration']}")
        return state

    def load_latest(self) -> dict[str, Any] | None:
        """The newest readable checkpoint, skipping unreadable ones; None when there is none."""
        for iteration in reversed(self.iterations()):
            try:
                return self.load(iteration)
            except Exception as exc:
                log.warning(
                    "checkpoint %s is unreadable (%s: %s); trying the one before",
                    self.url_of(file_name(iteration)),
                    type(exc).__name__,
                    exc,
                )
        return None


def write_atomic(fs: Any, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` on ``fs`` so that no reader ever sees part of it: a hidden
    temporary name in the same directory, then a rename (atomic on a POSIX file system; on an
    object store, where a rename is a copy, the object appears whole once it is written)."""
    parent, _, name = path.rpartition("/")
    tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, path)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise


def save_model(
    model: nn.Module | dict[str, Any], path: str | None, checkpointer: Checkpointer | None
) -> str:
    """Write ``model.state_dict()`` (or a state dict) atomically to ``path`` (a file or fsspec
    URL), or as ``final.pt`` in the checkpoint directory; return where it went."""
    buf = io.BytesIO()
    torch.save(model if isinstance(model, dict) else model.state_dict(), buf)
    if path is None:
        if checkpointer is None:
            raise ValueError("no path and no checkpoint directory to save the model in")
        return checkpointer.store.write_bytes(FINAL_NAME, buf.getvalue())
    fs, target = fsspec.core.url_to_fs(path)
    parent = target.rpartition("/")[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    write_atomic(fs, target, buf.getvalue())
    return path


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training loop may draw from."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` took."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


SaveState = Callable[[], Any]
"""Returns the user's state to keep (any picklable object); called on the writing rank."""
LoadState = Callable[[Any], None]
"""Puts back what a ``SaveState`` returned; called on every rank when the job resumes."""


@dataclass(frozen=True)
class Resumed:
    """Where a resumed job picks up."""

    iteration: int
    global_samples: int
    url: str
    positions: dict[int, int]
    """Shard -> samples trained on, for a sharded stream (empty otherwise)."""


class Checkpointer:
    """A job's checkpoints as its training loop sees them: when one is due, what goes in it,
    and how every rank resumes from the newest (one rank reads, all receive)."""

    def __init__(
        self, store: CheckpointStore, every: int, settle: Callable[[], object] | None = None
    ) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self.store = store
        self.every = every
        self.hooks: dict[str, tuple[SaveState, LoadState]] = {}
        self.settle = settle
        """Run on every rank in the loop when a checkpoint is due, before it is written: waits
        (bounded) until what the ranks reported of the iterations done (telemetry, metrics) is
        delivered (to the agent's relay, which keeps it on disk), so a resume from the
        checkpoint never skips iterations whose records died with a rank. It may be a
        collective: every rank in the loop asks ``due`` at the same iterations."""

    def add(self, name: str, save: SaveState, load: LoadState) -> None:
        if name in self.hooks:
            raise ValueError(f"checkpoint state {name!r} is registered already")
        self.hooks[name] = (save, load)

    def due(self, iteration: int) -> bool:
        """Whether a checkpoint is written once ``iteration`` iterations are done. Every rank
        asks after each iteration; when one is, this rank's reports are settled first
        (``settle``)."""
        due = iteration > 0 and iteration % self.every == 0
        if due and self.settle is not None:
            self.settle()
        return due

    def save(
        self,
        *,
        iteration: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: Sampler,
        plan: RuntimePlan,
        global_samples: int,
        data: dict[str, Any] | None = None,
        positions: dict[int, int] | None = None,
        shards: str | None = None,
    ) -> Saved:
        """Write the checkpoint after ``iteration`` iterations (on one rank only). ``data`` is
        what the data source needs to agree with on resume (a stream's layout), ``positions``
        how far every rank read its shards of a sharded stream. ``shards``: the model and
        optimizer were written sharded by every rank (:meth:`save_shards`) there."""
        epoch, k = sampler.position(iteration)
        state = {
            "format": FORMAT,
            "iteration": iteration,
            "epoch": epoch,
            "batch_in_epoch": k,
            "dataset_size": sampler.dataset_size,
            "global_batch": sampler.global_batch,
            "seed": sampler.seed,
            "sampler": sampler.describe(),
            "data": data or {},
            "positions": positions or {},
            "plan": {
                "version": plan.version,
                "batch_sizes": list(plan.batch_sizes),
                "excluded": list(plan.excluded),
            },
            "engine": "fsdp" if shards else "ddp",
            **(
                {"shards": shards}
                if shards
                else {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            ),
            "rng": capture_rng(),
            "user": {name: save() for name, (save, _) in self.hooks.items()},
            "global_samples": global_samples,
            "saved_at": time.time(),
        }
        return self.store.save(state)

    def save_shards(
        self, iteration: int, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> str:
        """Every rank of a sharded job: its shards of the model and the optimizer state, with
        torch.distributed.checkpoint (which a job of another world size loads, resharded)."""
        name = shards_name(iteration)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optim_state}, checkpoint_id=self.store.url_of(name)
        )
        return name

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: Sampler,
        *,
        rank: int,
        group: dist.ProcessGroup | None,
        control: dist.ProcessGroup | None,
        data: dict[str, Any] | None = None,
        sharded: bool = False,
    ) -> Resumed | None:
        """Every rank calls it before the first iteration. Rank 0 reads the newest readable
        checkpoint and every rank gets its model, optimizer, RNG and user state (a collective
        when the process group is initialised). None when there is no checkpoint yet."""
        header: list[Any] = [None]
        if rank == 0:
            header[0] = self._read(model, optimizer, sampler, data or {}, sharded)
        if dist.is_initialized():
            dist.broadcast_object_list(header, src=0, group=control)
        meta = header[0]
        if meta is None:
            return None
        if "error" in meta:
            if dist.is_initialized():  # every rank has the reason before any leaves with it
                dist.barrier(group=control)
            raise (CheckpointEngineError if meta.get("engine") else CheckpointError)(meta["error"])
        if sharded:
            self._load_shards(model, optimizer, meta["shards"])
        elif dist.is_initialized():
            resync(
                model, optimizer, rank=rank, root=0, apply=rank != 0, group=group, control=control
            )
        restore_rng(meta["rng"])
        for name, (_, load) in self.hooks.items():
            if name in meta["user"]:
                load(meta["user"][name])
        return Resumed(
            meta["iteration"], meta["global_samples"], meta["url"], meta.get("positions", {})
        )

    def _load_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer, name: str) -> None:
        """Every rank: its shards, resharded from whatever world size wrote them."""
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load(
            {"model": model_state, "optimizer": optim_state}, checkpoint_id=self.store.url_of(name)
        )  # in place, into these dicts
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

    def _read(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: Sampler,
        data: dict[str, Any],
        sharded: bool,
    ) -> dict[str, Any] | None:
        state = self.store.load_latest()
        if state is None:
            return None
        url = self.store.url_of(file_name(state["iteration"]))
        written = state.get("engine", "ddp")
        if written != ("fsdp" if sharded else "ddp"):
            return {
                "error": f"checkpoint {url} was written by a job of engine {written}; this job's "
                f"engine is {'fsdp' if sharded else 'ddp'}, so it cannot resume from it (give "
                "the job another checkpoint.path, or the engine that wrote it)",
                "engine": written,
            }
        problem = _mismatch(state, sampler.describe(), data)
        if problem is not None:
            return {"error": f"checkpoint {url} {problem}: it cannot resume exactly"}
        if not sharded:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        return {
            "shards": state.get("shards"),
            "iteration": int(state["iteration"]),
            "rng": state["rng"],
            "user": state["user"],
            "global_samples": int(state["global_samples"]),
            "url": url,
            "positions": state.get("positions", {}),
        }


def _mismatch(state: dict[str, Any], sampler: dict[str, Any], data: dict[str, Any]) -> str | None:
    """How the checkpoint's order of samples differs from this job's, or None."""
    saved = state.get("sampler") or {
        "dataset_size": state["dataset_size"],
        "global_batch": state["global_batch"],
        "seed": state["seed"],
        "drop_last": False,
    }
    for key in sorted(set(saved) | set(sampler)):
        if saved.get(key) != sampler.get(key):
            return f"is for {key} {saved.get(key)}, this job has {sampler.get(key)}"
    for key, value in sorted(state.get("data", {}).items()):
        if data.get(key) != value:
            return f"read its data with {key} {value}, this job with {data.get(key)}"
    return None
