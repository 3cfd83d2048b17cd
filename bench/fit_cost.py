"""What one performance-model fit costs (``server.planner.fit.fit_arrays``), by the shape of
a rank's window, and whether another checkout's fit costs more or less on the same windows.

    python bench/fit_cost.py [--windows 50] [--repeats 4] [--rounds 4] [--against DIR]

The control loop refits every rank of a job from its fit window (``rebalancer.FitWindow``:
the last 200 iterations) whenever the straggler watch refreshes its normal models: every
100 iterations of a steady job, every 25 otherwise. A 256-rank job's refresh is 256 fits, and
``bench/controller_cost.py`` puts the refreshes at a third of a steady job's sweep.

Windows of 200 iterations, ``t = (5 + 0.5 b)`` ms with 5% noise, at the batch sizes of each
shape: one size (a rank under one plan: not identifiable, the quick case), two and three
sizes (a plan change or two within the window), and the ladder's probes beside two sizes.
Reported: microseconds per fit, for each shape, the median of ``--rounds`` timings of
``--windows`` windows fitted ``--repeats`` times.

``--against DIR``: the same windows fitted by the fit of the checkout at ``DIR`` too (say a
``git worktree`` of main), in a process of its own, the two taking turns round by round, and
a check that both fits give the same models to the last bit. This machine is shared and
noisy: only figures of one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SHAPES: dict[str, list[int]] = {
    "one size": [32],
    "two sizes": [32, 40],
    "three sizes": [24, 32, 40],
    "probes beside two": [32, 34, 64],
}


def windows(shape: list[int], count: int, seed: int) -> list[tuple[Any, Any, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        its = np.arange(200, dtype=np.float64)
        b = rng.choice(np.array(shape, dtype=np.float64), 200)
        y = (5.0 + 0.5 * b) * rng.uniform(0.95, 1.05, 200)
        out.append((b, y, its))
    return out


def time_fits(count: int, repeats: int) -> dict[str, Any]:
    """Microseconds per fit by shape, and the fitted models (to compare two checkouts)."""
    from server.planner.fit import fit_arrays

    us: dict[str, float] = {}
    models: dict[str, list[Any]] = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        data = windows(shape, count, seed=i)
        fitted = [fit_arrays(b, y, its, half_life_iterations=50.0) for b, y, its in data]
        models[name] = [
            None
            if f.model is None
            else [f.model.per_sample_ms, f.model.intercept_ms, f.model.floor_ms]
            for f in fitted
        ]
        start = time.perf_counter()
        for _ in range(repeats):
            for b, y, its in data:
                fit_arrays(b, y, its, half_life_iterations=50.0)
        us[name] = 1e6 * (time.perf_counter() - start) / (repeats * count)
    return {"us_per_fit": us, "models": models}


def in_process(root: Path, count: int, repeats: int) -> dict[str, Any]:
    """``time_fits`` in a process of its own with ``root``'s code first on the path."""
    argv = [sys.executable, __file__, "--child", str(root), str(count), str(repeats)]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=root)
    return dict(json.loads(done.stdout))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # in_process: this file's timing of root's fit
        root, count, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        sys.path.insert(0, root)
        print(json.dumps(time_fits(count, repeats)))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--windows", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--against", type=Path, default=None, help="another checkout to compare")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = {"this": here} | ({"against": args.against.resolve()} if args.against else {})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for name, root in order:
            runs[name].append(in_process(root, args.windows, args.repeats))
    out: dict[str, Any] = {}
    for name, done in runs.items():
        out[name] = {
            shape: round(statistics.median(d["us_per_fit"][shape] for d in done), 1)
            for shape in SHAPES
        }
    if args.against:
        out["same_models"] = runs["this"][0]["models"] == runs["against"][0]["models"]
        out["this_over_against"] = {
            shape: round(out["this"][shape] / out["against"][shape], 3) for shape in SHAPES
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
