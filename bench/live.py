"""Dashboard latency: from a telemetry POST to the point being drawn in the browser's chart.

    python bench/live.py [--json] [--workers 4,64] [--seconds 20] [--history 2000]

Starts `evenflow server` in a subprocess on a fresh SQLite database and, for each job size,
registers a host, submits a job, stores `--history` iterations of telemetry, opens the job page
in Debian's Chromium (Playwright), then posts one iteration of every rank each 100 ms (10
iterations/s) for `--seconds`. The page reports when each iteration is first in its charts
(after Plotly.extendTraces returned); latency is that moment minus the moment before the POST.

Also reported: how long the page took to draw the downsampled history, the frames the page
managed per second while following the stream, and the main thread's long tasks (> 50 ms).
Target (issue 5, 2-core machine): p99 <= 1 s at 64 workers and 10 iterations/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack import TOKEN, server  # noqa: E402  (bench/ is the script's directory)

from tests.ui.simulated import Cluster, Workers, emulated_iteration  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PERIOD_S = 0.1
WARMUP_S = 2.0

# Installed before the page's scripts run: when each iteration is first drawn, frames per
# second, and long tasks on the main thread.
PROBE = """
window.__drawn = {}; window.__last = -1; window.__frames = 0; window.__long = [];
addEventListener('evenflow:drawn', (e) => {
  const now = Date.now();
  for (let i = window.__last + 1; i <= e.detail.iteration; i++) window.__drawn[i] = now;
  window.__last = Math.max(window.__last, e.detail.iteration);
});
const tick = () => { window.__frames++; requestAnimationFrame(tick); };
requestAnimationFrame(tick);
new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) window.__long.push(entry.duration);
}).observe({ entryTypes: ['longtask'] });
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_one(
    browser: Any, cluster: Cluster, workers: int, seconds: float, history: int
) -> dict[str, Any]:
    host = cluster.register(f"bench-{workers}", workers)
    per_sample = [0.05 + 0.1 * (r % 4) for r in range(workers)]
    job = cluster.submit(workers, 64 * workers, name=f"bench-{workers}")
    cluster.mark_running(host, job)
    plan = cluster.plan(job["id"])
    t0 = time.time() - history * PERIOD_S
    chunk: list[dict[str, Any]] = []
    for it in range(history):
        chunk += emulated_iteration(
            it, plan["version"], plan["batch_sizes"], per_sample, ts=t0 + it * PERIOD_S
        )
        if len(chunk) + workers > 5000:
            cluster.post_telemetry(job["id"], chunk)
            chunk = []
    if chunk:
        cluster.post_telemetry(job["id"], chunk)

    context = browser.new_context(viewport={"width": 1440, "height": 1000}, bypass_csp=True)
    page = context.new_page()
    page.add_init_script(PROBE)
    page.goto(f"{cluster.url}/login?next=/jobs/{job['id']}")
    page.fill("input[name=token]", TOKEN)
    started = time.monotonic()
    page.click("button[type=submit]")
    page.wait_for_function(
        "document.querySelector('#live-state')?.dataset.state === 'live'", timeout=60_000
    )
    load_s = time.monotonic() - started
    history_points = page.evaluate(
        "document.querySelector('[data-chart=\"iteration-time\"]').data[0].x.length"
    )

    sent: dict[int, float] = {}
    feeder = Workers(
        cluster,
        job["id"],
        per_sample,
        period_s=PERIOD_S,
        start_iteration=history,
        on_post=lambda it, at: sent.__setitem__(it, at),
    )
    page.evaluate("window.__frames = 0; window.__long = [];")
    feeder.start()
    time.sleep(seconds)
    feeder.stop()
    time.sleep(1.5)  # let the last points arrive
    drawn = page.evaluate("window.__drawn")
    frames = page.evaluate("window.__frames")
    long_tasks = page.evaluate("window.__long")
    points = page.evaluate(
        "document.querySelector('[data-chart=\"iteration-time\"]').data.map(t => t.x.length)"
    )
    context.close()

    warm = min(sent) + int(WARMUP_S / PERIOD_S)
    latencies = [
        drawn[str(it)] / 1000 - at for it, at in sent.items() if it >= warm and str(it) in drawn
    ]
    missing = [it for it in sent if str(it) not in drawn]
    return {
        "workers": workers,
        "iterations_per_s": round(1 / PERIOD_S),
        "history_iterations": history,
        "history_points_per_worker": history_points,
        "page_load_s": round(load_s, 2),
        "samples": len(latencies),
        "missing": len(missing),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * pct(latencies, 0.99), 1),
        "max_ms": round(1000 * max(latencies), 1),
        "fps": round(frames / (seconds + 1.5), 1),
        "long_tasks": len(long_tasks),
        "long_task_ms_total": round(sum(long_tasks)),
        "points_per_rank_trace_at_end": max(points[:workers]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workers", default="4,64")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--history", type=int, default=2000)
    args = parser.parse_args()
    if not os.path.exists(CHROMIUM):
        sys.exit(f"{CHROMIUM} is missing: install Debian's chromium (make browser-deps)")
    from playwright.sync_api import sync_playwright

    results = []
    with tempfile.TemporaryDirectory() as d, server(f"sqlite:///{d}/bench.db") as base:
        cluster = Cluster(base, TOKEN)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
            for n in (int(x) for x in args.workers.split(",")):
                results.append(run_one(browser, cluster, n, args.seconds, args.history))
                if not args.json:
                    print(json.dumps(results[-1]), flush=True)
            browser.close()
        cluster.close()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{'workers':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'fps':>6} {'load s':>7}")
        for r in results:
            print(
                f"{r['workers']:>8} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['max_ms']:>8} "
                f"{r['fps']:>6} {r['page_load_s']:>7}"
            )


if __name__ == "__main__":
    main()
