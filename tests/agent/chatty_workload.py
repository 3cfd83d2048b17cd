"""A user entrypoint that prints a line every 0.1 s for a minute, for the live-log test."""

from __future__ import annotations

import time

from agent.runtime.context import EvenflowContext


def main(ctx: EvenflowContext) -> None:
    for i in range(600):
        print(f"rank {ctx.rank} says {i}", flush=True)
        time.sleep(0.1)
