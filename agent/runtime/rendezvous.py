"""How a rank finds its device and its job's other ranks: the process group, bounded in time.

**Device and backend come from the assignment, never from what torch can see.** The control
plane places each rank on one device (``cpu`` or ``cuda``) and the agent passes it on as
``EVENFLOW_BACKEND`` (``gloo`` or ``nccl``) and ``EVENFLOW_DEVICE`` (``cpu`` or ``cuda:0``: a
CUDA rank sees only its own GPU through ``CUDA_VISIBLE_DEVICES``). A CPU rank on a CUDA host
therefore trains with gloo on the CPU. Without those variables a rank is a gloo CPU rank.

**Rendezvous.** Rank 0 serves a ``TCPStore``; the other ranks connect to it at
``MASTER_ADDR:MASTER_PORT``. ``MASTER_PORT=0`` means rank 0 chooses: it binds a port the OS
gives as free (so no stale process or other job on its host can hold it), publishes it through
the control plane (``publish_port``), and the other ranks look it up there (``lookup_port``).
Every rank then marks itself joined in the store and waits for all ``world_size`` ranks. Each
step is bounded by the rendezvous timeout (the spec's ``rendezvous_timeout_s``, default 120 s);
past it the rank raises :class:`RendezvousError` naming the address and port it could not
reach or the ranks that never came, and the worker fails the job with that reason. Collectives
afterwards get the (longer) collective timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from agent.runtime.telemetry import TelemetryClosed

log = logging.getLogger("evenflow.runtime.rendezvous")

Backend = Literal["gloo", "nccl"]
PublishPort = Callable[[int], None]
"""Rank 0 tells the control plane the port it bound (raises on failure; it is retried)."""
LookupPort = Callable[[], "int | None"]
"""Another rank asks the control plane for rank 0's port (``None``: not published yet)."""

CPU = torch.device("cpu")
JOINED_KEY = "evenflow/rendezvous/joined"
POLL_S = 0.05


class RendezvousError(RuntimeError):
    """The ranks of a job could not meet within the rendezvous timeout."""


@dataclass(frozen=True)
class DeviceAssignment:
    """The device and backend the control plane placed this rank on."""

    backend: Backend = "gloo"
    device: torch.device = CPU

    def __post_init__(self) -> None:
        expected = "cuda" if self.backend == "nccl" else "cpu"
        if self.device.type != expected:
            raise ValueError(
                f"backend {self.backend} needs a {expected} device, not {self.device} "
                "(EVENFLOW_BACKEND and EVENFLOW_DEVICE disagree)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DeviceAssignment:
        """From ``EVENFLOW_BACKEND`` and ``EVENFLOW_DEVICE``; raises ValueError when malformed."""
        backend = env.get("EVENFLOW_BACKEND", "gloo")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"EVENFLOW_BACKEND must be gloo or nccl, not {backend!r}")
        default = "cuda:0" if backend == "nccl" else "cpu"
        try:
            device = torch.device(env.get("EVENFLOW_DEVICE", default))
        except RuntimeError as exc:
            raise ValueError(f"EVENFLOW_DEVICE: {exc}") from None
        return cls("nccl" if backend == "nccl" else "gloo", device)

    def activate(self) -> torch.device:
        """Make the device current (CUDA) and return it."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        return self.device


@dataclass(frozen=True)
class Rendezvous:
    """Where and how long this rank meets the others."""

    address: str
    port: int
    """Rank 0's store port; 0: rank 0 binds a free one and publishes it."""
    rank: int
    world_size: int
    timeout_s: float = 120.0
    publish_port: PublishPort | None = None
    lookup_port: LookupPort | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], timeout_s: float = 120.0) -> Rendezvous:
        """From ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``."""
        return cls(
            address=env["MASTER_ADDR"],
            port=int(env["MASTER_PORT"]),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            timeout_s=timeout_s,
        )


def init_process_group(
    rdzv: Rendezvous, assignment: DeviceAssignment, timeout: timedelta
) -> dist.Store:
    """Meet the other ranks (bounded by ``rdzv.timeout_s``), then initialise the default
    process group on the assigned backend with ``timeout`` for its collectives."""
    store = connect(rdzv)
    store.set_timeout(timeout)
    try:
        dist.init_process_group(
            assignment.backend,
            store=store,
            rank=rdzv.rank,
            world_size=rdzv.world_size,
            timeout=timeout,
        )
    except RuntimeError as exc:
        raise RendezvousError(
            f"rank {rdzv.rank} met the others at {rdzv.address}:{store.port} but its "
            f"{assignment.backend} process group on {assignment.device} failed to form "
            f"({_first_line(exc)})"
        ) from exc
    log.info(
        "rank %d of %d: %s process group on %s",
        rdzv.rank,
        rdzv.world_size,
        assignment.backend,
        assignment.device,
    )
    return store


def connect(rdzv: Rendezvous) -> dist.TCPStore:
    """The job's store, once all ``world_size`` ranks have joined it."""
    deadline = time.monotonic() + rdzv.timeout_s
    if rdzv.rank == 0:
        store = _serve(rdzv)
        port = int(store.port)
        if rdzv.port == 0:
            _publish(rdzv, port, deadline)
    else:
        port = rdzv.port or _lookup(rdzv, deadline)
        store = _reach(rdzv, port, deadline)
    _join(store, rdzv, port, deadline)
    return store


def _serve(rdzv: Rendezvous) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            rdzv.address,
            rdzv.port,
            rdzv.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=rdzv.timeout_s),
        )
    except RuntimeError as exc:
        where = f"{rdzv.address}:{rdzv.port}" if rdzv.port else f"a free port of {rdzv.address}"
        raise RendezvousError(
            f"rank 0 could not serve the rendezvous on {where} within {rdzv.timeout_s:g} s "
            f"({_first_line(exc)})"
        ) from None


def _reach(rdzv: Rendezvous, port: int, deadline: float) -> dist.TCPStore:
    left = max(0.5, deadline - time.monotonic())
    try:
        return dist.TCPStore(
            rdzv.address,
            port,
            rdzv.world_size,
            is_master=False,
            timeout=timedelta(seconds=left),
        )
    except RuntimeError as exc:
        raise RendezvousError(
            f"rank {rdzv.rank} could not reach rank 0's rendezvous at {rdzv.address}:{port} "
            f"within {rdzv.timeout_s:g} s ({_first_line(exc)})"
        ) from None


def _publish(rdzv: Rendezvous, port: int, deadline: float) -> None:
    if rdzv.publish_port is None:
        raise RendezvousError("MASTER_PORT=0 needs the control plane to publish rank 0's port")
    while True:
        try:
            rdzv.publish_port(port)
            log.info("rendezvous served on %s:%d", rdzv.address, port)
            return
        except TelemetryClosed:
            raise  # the job ended: not a rendezvous problem
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rank 0 could not publish its rendezvous port {port} within "
                    f"{rdzv.timeout_s:g} s ({exc!r})"
                ) from None
            log.warning("publishing the rendezvous port failed (%r); retrying", exc)
            time.sleep(0.5)


def _lookup(rdzv: Rendezvous, deadline: float) -> int:
    if rdzv.lookup_port is None:
        raise RendezvousError("MASTER_PORT=0 needs the control plane to look up rank 0's port")
    delay = POLL_S
    while True:
        error: Exception | None = None
        try:
            port = rdzv.lookup_port()
            if port:
                return port
        except TelemetryClosed:
            raise  # the job ended: not a rendezvous problem
        except Exception as exc:
            error = exc
        if time.monotonic() > deadline:
            why = f" (last error {error!r})" if error is not None else ""
            raise RendezvousError(
                f"rank 0 did not publish its rendezvous port on {rdzv.address} within "
                f"{rdzv.timeout_s:g} s{why}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def _join(store: dist.TCPStore, rdzv: Rendezvous, port: int, deadline: float) -> None:
    joined = store.add(JOINED_KEY, 1)
    while joined < rdzv.world_size:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"only {joined} of {rdzv.world_size} ranks reached the rendezvous at "
                f"{rdzv.address}:{port} within {rdzv.timeout_s:g} s"
            )
        time.sleep(POLL_S)
        joined = store.add(JOINED_KEY, 0)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
