"""What one rebalancer decision (``server.planner.rebalance.decide``) costs for an exploring job.

    python bench/rebalance_decide.py [--sizes 64,256,1024] [--seconds 2]

Every rank of the job has been seen at one batch size only (the initial equal split), so the
decision plans on guesses and nudges each rank whose planned size equals the one it was seen at
(``_nudge``). Two fleets per size: *one model* (every rank on the same GPU: the solver's plan is
the equal split again, so every rank is nudged) and *two models* (half the ranks twice as slow:
few are nudged). The controller makes such a decision for every job it places, every
``explore_iterations``, until the models are identified. Prints the median time per decision and
checks that the plan sums to the global batch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.planner import Observation, fit_model
from server.planner.rebalance import RebalanceInput, decide

PER_RANK = 64
"""Samples per rank in the global batch."""


def exploring(n: int, speeds: list[float], seed: int) -> RebalanceInput:
    rng = random.Random(seed)
    fits = tuple(
        fit_model(
            [
                Observation(
                    PER_RANK,
                    (2.0 + speeds[r % len(speeds)] * PER_RANK) * rng.uniform(0.98, 1.02),
                    i,
                )
                for i in range(3)
            ]
        )
        for r in range(n)
    )
    return RebalanceInput(global_batch=PER_RANK * n, current=(PER_RANK,) * n, fits=fits)


def median_ms(inp: RebalanceInput, seconds: float) -> float:
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        out = decide(inp)
        times.append(1000 * (time.perf_counter() - start))
        assert out.batch_sizes is None or sum(out.batch_sizes) == inp.global_batch
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per case")
    args = ap.parse_args()
    print("| ranks | one model: ms per decision | two models: ms per decision |")
    print("| --- | --- | --- |")
    for n in (int(s) for s in args.sizes.split(",")):
        one = median_ms(exploring(n, [0.2], seed=n), args.seconds)
        two = median_ms(exploring(n, [0.2, 0.4], seed=n), args.seconds)
        print(f"| {n} | {one:.2f} | {two:.2f} |", flush=True)


if __name__ == "__main__":
    main()
