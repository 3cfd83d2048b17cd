"""How the runtime sums gradient buffers on gloo: ring ``all_reduce`` against the direct exchange.

    PYTHONPATH=. python bench/collectives.py [--world 4] [--sizes 2200,65536,262144,1048576]

``world`` spawned ranks (one torch thread each) time :class:`GradientSync`'s sum of one buffer,
each way, after a short sleep standing in for compute (so every rank arrives idle, as after an
emulated compute phase). Rounds alternate between the two ways so drift in machine load hits
both. The reported figure per size is the median over rounds of the *last arriving* rank's time
(the smallest time over ranks: the others' include waiting for it), which is the collective's own
latency. ``auto`` is what the runtime picks for that size (``DIRECT_MAX_ELEMENTS``).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.gradients import DIRECT_MAX_ELEMENTS, GradientSync


def _rank(rank: int, world: int, port: int, sizes: list[int], rounds: int, q: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, dict[str, float]] = {}
    for n in sizes:
        param = nn.Parameter(torch.zeros(n - 1))  # + the loss slot = n elements
        syncs = {m: GradientSync([param], exchange=m) for m in ("all_reduce", "direct")}
        times: dict[str, list[float]] = {m: [] for m in syncs}
        for _ in range(rounds):
            for m, sync in syncs.items():
                time.sleep(0.02)
                t0 = time.perf_counter()
                sync.all_reduce(1)
                times[m].append((time.perf_counter() - t0) * 1000)
        row = {}
        for m, ts in times.items():
            mine = torch.tensor(ts[3:])  # the first rounds set up connections
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            row[m] = round(statistics.median(torch.stack(every).min(0).values.tolist()), 2)
        row["auto"] = "direct" if n * world <= DIRECT_MAX_ELEMENTS else "all_reduce"
        out[str(n)] = row
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sizes", default="2200,65536,262144,1048576")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    from evenflow.local_cluster import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sizes = [int(s) for s in args.sizes.split(",")]
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, sizes, args.rounds, q))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join()
    ms = {n: {k: v for k, v in row.items()} for n, row in result.items()}
    print(json.dumps({"world": args.world, "median_ms_by_elements": ms}, indent=2))


if __name__ == "__main__":
    main()
