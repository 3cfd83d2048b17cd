"""Run a function on N real torch.distributed ranks (gloo, 127.0.0.1) in spawned processes.

The parent owns the rendezvous ``TCPStore`` (bound to port 0, so there is no race for a free
port); children connect to it. A child's exception comes back as its traceback text; a hang is
killed at the deadline and fails the test instead of blocking it. Children are not daemonic, so a
rank may start DataLoader worker processes of its own.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _child(
    fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, store.port, args, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results))} hung"
                ) from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        del store
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
