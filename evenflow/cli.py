"""The ``evenflow`` command: the server, the agent, and the REST API for people and scripts.

Client commands talk to ``--server`` / ``EVENFLOW_SERVER`` with ``EVENFLOW_TOKEN``, print tables
for people and ``--json`` for scripts, and exit 1 with the server's message on an error.
Server-side modules are imported only by the subcommands that need them, so an agent host
does not need the server's dependencies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.table import Table

from agent.client import ApiClient, ApiError, make_http
from contract.api import TokenCreate
from contract.enums import Role
from contract.spec import JobSpec

DEFAULT_SERVER = "http://127.0.0.1:8000"
console = Console()


def _client(args: argparse.Namespace) -> ApiClient:
    return ApiClient(make_http(args.server, args.token))


def _emit(
    args: argparse.Namespace,
    data: Any,
    columns: Sequence[str],
    rows: Callable[[Any], list[list[Any]]],
    title: str | None = None,
) -> None:
    if args.json:
        print(json.dumps(_jsonable(data), indent=2, default=str))
        return
    table = Table(*columns, title=title)
    for row in rows(data):
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)


def _jsonable(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, list):
        return [_jsonable(d) for d in data]
    return data


def _job_rows(jobs: list[Any]) -> list[list[Any]]:
    return [
        [
            j.id,
            j.name,
            j.status.value,
            j.owner,
            j.spec.get("global_batch"),
            len(j.workers),
            j.plan_version,
            "yes" if j.emulated else "",
            j.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        ]
        for j in jobs
    ]


JOB_COLUMNS = [
    "id",
    "name",
    "status",
    "owner",
    "global batch",
    "workers",
    "plan",
    "emulated",
    "created",
]


# ----------------------------------------------------------------------------- client commands


def cmd_jobs_submit(args: argparse.Namespace) -> None:
    try:
        raw = yaml.safe_load(Path(args.file).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read {args.file}: {exc}") from exc
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise SystemExit(f"error: {args.file}: {loc}: {first['msg']}") from exc
    job = _client(args).submit(spec)
    _emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]), title="submitted")


def cmd_jobs_list(args: argparse.Namespace) -> None:
    jobs = _client(args).jobs(status=args.status, limit=args.limit)
    _emit(args, jobs, JOB_COLUMNS, lambda d: _job_rows(d.items), title=f"{jobs.total} jobs")


def cmd_jobs_show(args: argparse.Namespace) -> None:
    client = _client(args)
    job = client.job(args.id)
    if args.json:
        _emit(args, job, [], lambda _: [])
        return
    _emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]))
    if job.error:
        console.print(f"[red]error:[/red] {job.error}")
    workers = Table("rank", "device", "host", "state", "exit", title="workers")
    for w in job.workers:
        workers.add_row(
            str(w.rank),
            str(w.device_id),
            str(w.host_id),
            w.state.value,
            "" if w.exit_code is None else str(w.exit_code),
        )
    console.print(workers)
    if job.plan_version is not None:
        plan = client.plan(job.id)
        if plan is not None:
            console.print(
                f"plan v{plan.version} ({plan.source.value}): {plan.batch_sizes}  — {plan.reason}"
            )


def cmd_jobs_cancel(args: argparse.Namespace) -> None:
    job = _client(args).cancel(args.id)
    _emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]), title="cancelled")


def cmd_hosts_list(args: argparse.Namespace) -> None:
    hosts = _client(args).hosts()

    def rows(hs: list[Any]) -> list[list[Any]]:
        return [
            [
                h.id,
                h.name,
                h.address,
                h.status.value,
                len(h.devices),
                ", ".join(
                    f"{d.kind.value}:{d.index} {d.model} ({d.status.value})" for d in h.devices
                ),
                h.last_heartbeat.strftime("%H:%M:%S"),
            ]
            for h in hs
        ]

    _emit(args, hosts, ["id", "name", "address", "status", "devices", "detail", "heartbeat"], rows)


def cmd_tokens_create(args: argparse.Namespace) -> None:
    created = _client(args).create_token(
        TokenCreate(name=args.name, role=Role(args.role), host=args.host)
    )
    if args.json:
        _emit(args, created, [], lambda _: [])
        return
    console.print(f"token {created.id} '{created.name}' ({created.role.value}); shown once:")
    print(created.token)


def cmd_tokens_list(args: argparse.Namespace) -> None:
    toks = _client(args).tokens()
    _emit(
        args,
        toks,
        ["id", "name", "role", "prefix", "host", "created", "revoked"],
        lambda ts: [
            [
                t.id,
                t.name,
                t.role.value,
                t.prefix + "…",
                t.host,
                t.created_at.strftime("%Y-%m-%d"),
                t.revoked_at.strftime("%Y-%m-%d") if t.revoked_at else "",
            ]
            for t in ts
        ],
    )


def cmd_tokens_revoke(args: argparse.Namespace) -> None:
    tok = _client(args).revoke_token(args.id)
    _emit(args, tok, ["id", "name", "revoked"], lambda t: [[t.id, t.name, t.revoked_at]])


# ----------------------------------------------------------------------------- processes


def cmd_agent(args: argparse.Namespace) -> None:
    import logging
    import socket

    from agent.daemon import discover_devices, run_agent

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
    if replaced:
        raise SystemExit(f"error: another agent took host {name} over (--replace); stopped")


def _progress(stream: Any = None) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
    import tempfile

    from evenflow.experiment import Profile, report
    from evenflow.local_cluster import LocalCluster

    try:
        profile = Profile.model_validate(yaml.safe_load(Path(args.profile).read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read {args.profile}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SystemExit(
            f"error: {args.profile}: {'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from exc
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
    table = Table(
        "policy",
        "samples/s",
        "mean iteration",
        "idle (waiting)",
        "plan changes",
        "speedup vs equal",
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
    import tempfile
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
            f"[bold]Evenflow demo[/bold]: {n} EMULATED workers (per-sample ms "
            f"{[w.per_sample_ms for w in profile.workers]}, +5 ms each), real torch.distributed (gloo)"
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


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evenflow", description=__doc__.splitlines()[0])
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--server",
        default=os.environ.get("EVENFLOW_SERVER", DEFAULT_SERVER),
        help="control plane URL (EVENFLOW_SERVER)",
    )
    client.add_argument(
        "--token", default=os.environ.get("EVENFLOW_TOKEN"), help="API token (EVENFLOW_TOKEN)"
    )
    client.add_argument("--json", action="store_true", help="print JSON for scripts")
    sub = parser.add_subparsers(dest="command", required=True)

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
    p.add_argument("--server", default=os.environ.get("EVENFLOW_SERVER", DEFAULT_SERVER))
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
        "agent's token never is, and workers get only an allow-list (see README, Trust model)",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="take this host name over from another live agent (which then stops)",
    )
    p.add_argument(
        "--workdir",
        default=os.environ.get("EVENFLOW_WORKDIR", "evenflow-agent"),
        help="worker logs and error files",
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

    jobs = sub.add_parser("jobs", help="submit, list, show and cancel jobs").add_subparsers(
        dest="action", required=True
    )
    p = jobs.add_parser("submit", parents=[client], help="submit a job spec (YAML)")
    p.add_argument("file")
    p.set_defaults(func=cmd_jobs_submit)
    p = jobs.add_parser("list", parents=[client])
    p.add_argument("--status")
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=cmd_jobs_list)
    p = jobs.add_parser("show", parents=[client])
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_jobs_show)
    p = jobs.add_parser("cancel", parents=[client])
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_jobs_cancel)

    hosts = sub.add_parser("hosts", help="list hosts").add_subparsers(dest="action", required=True)
    p = hosts.add_parser("list", parents=[client])
    p.set_defaults(func=cmd_hosts_list)

    toks = sub.add_parser("tokens", help="manage API tokens (admin)").add_subparsers(
        dest="action", required=True
    )
    p = toks.add_parser("create", parents=[client])
    p.add_argument("--role", required=True, choices=[r.value for r in Role if r is not Role.WORKER])
    p.add_argument("--name", default=None, help="defaults to '<role>-token'")
    p.add_argument("--host", default=None, help="for agent tokens: the host they act for")
    p.set_defaults(func=cmd_tokens_create)
    p = toks.add_parser("list", parents=[client])
    p.set_defaults(func=cmd_tokens_list)
    p = toks.add_parser("revoke", parents=[client])
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_tokens_revoke)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "name", "x") is None:
        args.name = f"{args.role}-token"
    try:
        args.func(args)
    except ApiError as exc:
        where = f" ({exc.field})" if exc.field else ""
        print(f"error: {exc.status_code}{where}: {exc.detail}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        print(f"error: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:  # connection refused and friends
        print(
            f"error: cannot reach {getattr(args, 'server', 'the server')}: {exc}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
