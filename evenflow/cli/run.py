"""The commands that run something: the control plane (``server``, ``migrate``), a host's
``agent``, and the local emulated cluster (``demo``, ``compare``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.text import Text

from agent.client import ApiError
from evenflow.cli.output import (
    DEFAULT_SERVER,
    console,
    new_table,
    server_url,
    validated,
)


def cmd_agent(args: argparse.Namespace) -> None:
    import logging
    import socket

    from agent.daemon import discover_devices, run_agent
    from agent.network import AddressError

    if args.token_file:
        try:
            args.token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise SystemExit(f"error: cannot read --token-file {args.token_file}: {exc}") from exc
    if not args.token:
        raise SystemExit("error: the agent needs a token (--token, EVENFLOW_TOKEN or --token-file)")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    name = args.name or socket.gethostname()
    try:
        replaced = run_agent(
            args.server,
            args.token,
            name,
            args.address or name,
            discover_devices(args.cpu_workers),
            Path(args.workdir),
            interval_s=args.heartbeat,
            secret_env=frozenset(args.secret_env),
            replace=args.replace,
        )
    except ApiError as exc:
        raise SystemExit(f"error: {exc.detail}") from exc
    except AddressError as exc:
        raise SystemExit(f"error: {exc}") from exc
    if replaced:
        raise SystemExit(f"error: another agent took host {name} over (--replace); stopped")


def _progress(stream: Any = None) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("iterations"),
        TimeElapsedColumn(),
        console=Console(stderr=stream is sys.stderr),
    )


def _run_policies(
    cluster: Any, profile: Any, iterations: dict[Any, int], stream: Any = None
) -> dict[Any, Any]:
    from evenflow.experiment import run_policy

    results = {}
    with _progress(stream) as progress:
        for policy, n in iterations.items():
            task = progress.add_task(f"{policy.value:<12}", total=n)

            def advance(done: int, task: Any = task) -> None:
                progress.update(task, completed=done)

            results[policy] = run_policy(cluster, profile, policy, n, advance)
    return results


def cmd_compare(args: argparse.Namespace) -> None:

    from evenflow.experiment import Profile, report
    from evenflow.local_cluster import LocalCluster

    try:
        raw = yaml.safe_load(Path(args.profile).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read {args.profile}: {exc}") from exc
    profile = validated(Profile, raw, args.profile)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="evenflow-compare-"))
    agents = min(2, len(profile.workers))
    with LocalCluster(workdir, workers=len(profile.workers), agents=agents) as cluster:
        results = _run_policies(
            cluster, profile, dict.fromkeys(profile.policies, profile.iterations), sys.stderr
        )
    out = report(profile, results)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_results(out)
    if out["failed"]:
        raise SystemExit(f"error: policies failed: {', '.join(out['failed'])}")


def _print_results(out: dict[str, Any]) -> None:
    table = new_table(
        ["policy", "samples/s", "mean iteration", "idle", "plan changes", "speedup"],
        title=f"measured (emulated speeds); ideal {out['ideal_samples_per_s']:.0f} samples/s",
    )
    for name, r in out["policies"].items():
        if "error" in r:
            table.add_row(name, "failed", r["error"][:60], "", "", "")
            continue
        speedup = out["speedup_vs_equal"].get(name)
        table.add_row(
            name,
            f"{r['samples_per_s']:.0f}",
            f"{r['mean_iteration_ms']:.1f} ms",
            f"{100 * r['idle_fraction']:.0f}%",
            str(r["plan_changes"]),
            f"{speedup:.2f}x" if speedup else "",
        )
    console.print(table)


DEMO_PATTERN = (1.0, 1.0, 2.0, 4.0)
"""Per-sample times of the demo's emulated workers, repeating: speeds 4:4:2:1."""


def cmd_demo(args: argparse.Namespace) -> None:
    import threading

    from contract.enums import PolicyName
    from evenflow.experiment import Profile, ProfileWorker, optimum_ms, report
    from evenflow.local_cluster import LocalCluster

    n = args.workers
    profile = Profile(
        global_batch=64 * n,
        iterations=100,
        policies=[PolicyName.EQUAL, PolicyName.MINMAX],
        workload="cnn-digits",
        workers=[
            ProfileWorker(name=f"emulated-{i}", per_sample_ms=DEMO_PATTERN[i % 4], intercept_ms=5.0)
            for i in range(n)
        ],
    )
    overhead_ms = 4.0
    iterations = {
        p: max(
            20,
            math.ceil(
                args.seconds
                * 1000
                / (optimum_ms(profile.models(), profile.global_batch, p.value)[0] + overhead_ms)
            ),
        )
        for p in profile.policies
    }
    token = os.environ.get("EVENFLOW_ADMIN_TOKEN")
    workdir = Path(tempfile.mkdtemp(prefix="evenflow-demo-"))
    cluster = LocalCluster(workdir, workers=n, agents=min(2, n), port=args.port)
    if token:
        cluster.admin_token = token
    with cluster:
        console.print(
            Text.assemble(
                ("Evenflow demo", "bold"),
                f": {n} EMULATED workers (per-sample ms "
                f"{[w.per_sample_ms for w in profile.workers]}, +5 ms each), real "
                "torch.distributed (gloo)",
            )
        )
        console.print(f"dashboard  {cluster.url}/   (log in with the token below)")
        console.print(f"API docs   {cluster.url}/docs")
        console.print(f"token      {cluster.admin_token}")
        console.print(f"data       {workdir}")
        console.print(
            f"running the same job with equal batches, then with minmax (about {args.seconds:.0f} s each)"
        )
        results = _run_policies(cluster, profile, iterations)
        _print_results(report(profile, results))
        ids = ",".join(str(r.job_id) for r in results.values() if r.job_id is not None)
        console.print(f"side by side: {cluster.url}/compare?jobs={ids}")
        if args.exit:
            return
        console.print(f"still serving the dashboard at {cluster.url}/ — Ctrl-C to stop")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            console.print("stopping")


def cmd_migrate(args: argparse.Namespace) -> None:
    """Migrate the database and bootstrap the admin token, then exit (an init step)."""
    from server.config import Settings
    from server.serve import prepare

    prepare(Settings())


def cmd_server(args: argparse.Namespace) -> None:
    from server.serve import serve

    if args.workers < 1:
        raise SystemExit("--workers must be at least 1")
    serve(args.host, args.port, args.log_level, workers=args.workers, access_log=args.access_log)


def add_commands(sub: Any) -> None:
    """``server``, ``migrate``, ``agent``, ``demo`` and ``compare``."""
    p = sub.add_parser(
        "server", help="run the control plane (EVENFLOW_DATABASE_URL, EVENFLOW_ADMIN_TOKEN)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="API processes sharing the port (the control loop always runs in one more)",
    )
    p.add_argument("--access-log", action="store_true", help="log a line per request")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser(
        "migrate", help="migrate EVENFLOW_DATABASE_URL and bootstrap the admin token, then exit"
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("agent", help="run this host's agent: register devices, launch workers")
    p.add_argument(
        "--server",
        type=server_url,
        default=os.environ.get("EVENFLOW_SERVER", DEFAULT_SERVER),
        help="control plane URL (EVENFLOW_SERVER)",
    )
    p.add_argument(
        "--token", default=os.environ.get("EVENFLOW_TOKEN"), help="agent token (EVENFLOW_TOKEN)"
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("EVENFLOW_TOKEN_FILE"),
        help="read the agent token from this file (a mounted Secret; EVENFLOW_TOKEN_FILE)",
    )
    p.add_argument("--name", default=None, help="host name to register (default: hostname)")
    p.add_argument(
        "--address", default=None, help="address other hosts reach this one at (default: name)"
    )
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=None,
        help="offer N CPU devices (default: the CUDA devices, or 1 CPU without a GPU)",
    )
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    p.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME",
        help="an environment variable of the agent never passed to workers (repeatable); the "
        "agent's token never is, and workers get only an allow-list (docs/operations/trust-model.md)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="take this host name over from another live agent (which then stops)",
    )
    p.add_argument(
        "--workdir",
        default=os.environ.get("EVENFLOW_WORKDIR", "evenflow-agent"),
        help="worker logs, error files and the state of running workers",
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser(
        "demo", help="local emulated cluster: the same job with equal, then minmax batches"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0, help="about how long each policy runs")
    p.add_argument("--exit", action="store_true", help="exit after the table instead of serving on")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "compare", help="run an emulated profile under several policies and measure each"
    )
    p.add_argument("--profile", required=True, help="profile YAML (see evenflow/experiment.py)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workdir", default=None)
    p.set_defaults(func=cmd_compare)
