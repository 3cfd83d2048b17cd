"""A user entrypoint that fails on one rank, for the agent's root-cause test."""

from __future__ import annotations

from agent.runtime.context import EvenflowContext


def main(ctx: EvenflowContext) -> None:
    if ctx.rank == 1:
        raise RuntimeError("boom: the data shard of rank 1 is corrupt")
    raise SystemExit(ctx.rank * 0)  # rank 0 ends cleanly; rank 1's failure is the root cause
