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
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import httpx
import yaml
from pydantic import BaseModel, ValidationError
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from agent.client import ApiClient, ApiError, make_http
from contract.api import OverrideCreate, TokenCreate
from contract.base import LOSS_METRIC
from contract.dashboard import MetricsOut
from contract.enums import OverrideKind, Role
from contract.problems import explain
from contract.spec import JobSpec
from evenflow import contexts, job_views

DEFAULT_SERVER = "http://127.0.0.1:8000"
console = Console(markup=False)
"""Text from the server (errors, tracebacks, reasons) is printed as it is: square brackets in it
are not markup (a traceback's ``[/usr/lib/...]`` was a MarkupError); styles are given as
``Text`` spans."""


def server_url(value: str) -> str:
    """``--server``: an http(s) URL; ``host:port`` alone means ``http://host:port``. Anything
    else is refused at once, before a request is retried against it."""
    url = value if "://" in value else f"http://{value}"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an http(s) address of the control plane (e.g. http://server:8000)"
        )
    return url.rstrip("/")


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
    table = _table(columns, title)
    for row in rows(data):
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)


FOLDED = frozenset(
    {
        "name",
        "owner",
        "model",
        "use",
        "action",
        "model t(b)",
        "fit",
        "detail",
        "url",
        "reason",
    }
)
"""Columns of free text: they wrap onto more lines at 80 columns; the others (ids, statuses,
numbers, times) keep their width, so nothing is cut short and short values stay whole."""


def _table(columns: Sequence[str], title: str | None = None) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for column in columns:
        folded = column in FOLDED
        table.add_column(
            column, overflow="fold", no_wrap=not folded, min_width=12 if folded else None
        )
    return table


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
            f"{j.name} (emulated)" if j.emulated else j.name,
            j.status.value,
            j.spec.get("global_batch"),
            len(j.workers),
            j.plan_version,
            j.created_at.strftime("%m-%d %H:%M"),
        ]
        for j in jobs
    ]


JOB_COLUMNS = [
    "id",
    "name",
    "status",
    "batch",
    "workers",
    "plan",
    "created",
]


# ----------------------------------------------------------------------------- client commands


def cmd_jobs_submit(args: argparse.Namespace) -> None:
    try:
        raw = yaml.safe_load(Path(args.file).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read {args.file}: {exc}") from exc
    client = _client(args)
    if args.context is not None:
        if not isinstance(raw, dict) or not isinstance(raw.get("workload"), dict):
            raise SystemExit(f"error: {args.file} has no workload to give the context to")
        raw["workload"]["context"] = _ship_context(client, Path(args.context), quiet=args.json)
    job = client.submit(_validated(JobSpec, raw, args.file))
    _emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]), title="submitted")
    if not args.json:
        _print_pending([job])


def _ship_context(client: ApiClient, directory: Path, *, quiet: bool) -> str:
    """Pack ``directory`` (its ``.evenflowignore`` honoured), upload it unless the server has
    those bytes already, and return their SHA-256 for the spec's ``workload.context``."""
    with tempfile.TemporaryDirectory(prefix="evenflow-context-") as tmp:
        try:
            packed = contexts.pack_directory(directory, Path(tmp) / "context.tar.gz")
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from exc
        size = contexts.format_size(packed.size_bytes)
        if client.context_info(packed.sha256) is not None:
            what = "already on the server"
        else:
            try:
                with Progress(transient=True, disable=quiet) as progress:
                    task = progress.add_task(f"uploading {directory}", total=packed.size_bytes)
                    client.upload_context(
                        packed.path, packed.sha256, on_sent=lambda n: progress.advance(task, n)
                    )
            except ApiError as exc:
                if exc.status_code == 413:  # "request body over N bytes"
                    found = re.search(r"\d+", exc.detail)
                    limit = int(found.group()) if found else packed.size_bytes
                    raise SystemExit(
                        "error: " + contexts.over_limit_message(packed, limit)
                    ) from exc
                raise
            what = "uploaded"
        if not quiet:
            console.print(
                f"context {directory}: {packed.files} files, {size} packed, {what} "
                f"(sha256 {packed.sha256[:12]})"
            )
        return packed.sha256


M = TypeVar("M", bound=BaseModel)


def _validated(model: type[M], raw: Any, source: str) -> M:
    """``raw`` as a ``model``, or exit naming every problem of ``source`` in words."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = explain(exc.errors(), model)
        lines = "\n".join(f"  {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        raise SystemExit(f"error: {source} has {len(problems)} {noun}:\n{lines}") from exc


def cmd_jobs_list(args: argparse.Namespace) -> None:
    jobs = _client(args).jobs(status=args.status, limit=args.limit)
    _emit(args, jobs, JOB_COLUMNS, lambda d: _job_rows(d.items), title=f"{jobs.total} jobs")
    if not args.json:
        _print_pending(jobs.items)


def _print_pending(jobs: list[Any]) -> None:
    """Why each pending job waits, one line each (under the table: no column to truncate)."""
    for j in jobs:
        if j.status.value == "pending" and j.pending_reason:
            console.print(f"job {j.id} waits: {j.pending_reason}", highlight=False, markup=False)


def cmd_jobs_show(args: argparse.Namespace) -> None:
    client = _client(args)
    job = client.job(args.id)
    if args.json:
        _emit(args, job, [], lambda _: [])
        return
    _emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]))
    console.print(f"owner {job.owner}")
    if job.error:
        console.print(Text.assemble(("error:", "red"), f" {job.error}"))
    _print_pending([job])
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
    if job.restart_history:
        _print_restarts(job)
    if job.plan_version is not None:
        plan = client.plan(job.id)
        if plan is not None:
            console.print(
                f"plan v{plan.version} ({plan.source.value}): {plan.batch_sizes}  — {plan.reason}"
            )


def _print_restarts(job: Any) -> None:
    restarts = Table("attempt", "at", "resumed from", "iterations lost", title="restarts")
    for r in job.restart_history:
        restarts.add_row(
            str(r.attempt),
            r.at.strftime("%Y-%m-%d %H:%M:%S"),
            "iteration 0" if r.resumed_from is None else f"iteration {r.resumed_from}",
            "" if r.iterations_lost is None else str(r.iterations_lost),
        )
    console.print(restarts)
    for r in job.restart_history:  # reasons whole, not wrapped in a narrow column
        console.print(f"attempt {r.attempt} after: {r.reason}", soft_wrap=True)
    console.print(f"restarts: {job.restarts} of at most {job.spec.get('max_restarts', 3)}")


def cmd_jobs_checkpoints(args: argparse.Namespace) -> None:
    page = _client(args).checkpoints(args.id, limit=args.limit)

    def rows(p: Any) -> list[list[Any]]:
        return [
            [
                c.iteration,
                c.created_at.strftime("%m-%d %H:%M:%S"),
                contexts.format_size(c.size_bytes),
                f"{c.write_ms:.0f}",
                c.rank,
                c.attempt,
            ]
            for c in p.items
        ]

    columns = ["iteration", "written", "size", "write ms", "rank", "attempt"]
    shown = f"newest {len(page.items)} of " if len(page.items) < page.total else ""
    _emit(args, page, columns, rows, title=f"{shown}{page.total} checkpoints of job {args.id}")
    if args.json or not page.items:
        return
    # Where they are, under the table (no column of 80 could hold a URL): one folder when they
    # share it under the usual names, else each URL on a line of its own.
    folder = page.items[0].url.rpartition("/")[0]
    if all(c.url == f"{folder}/ckpt-{c.iteration:012d}.pt" for c in page.items):
        console.print(f"in {folder}/ as ckpt-<iteration>.pt", soft_wrap=True)
        return
    for c in page.items:
        console.print(f"{c.iteration}: {c.url}", soft_wrap=True)


def cmd_jobs_artifacts(args: argparse.Namespace) -> None:
    """What a job left, and with ``--download DIR`` each file copied there: from the server's
    copy, else from shared storage this machine reaches."""
    client = _client(args)
    page = client.artifacts(args.id)

    def rows(p: Any) -> list[list[Any]]:
        return [[a.rank, a.name, contexts.format_size(a.size_bytes), _kept(a)] for a in p.items]

    _emit(args, page, ["rank", "name", "size", "kept"], rows, title=f"artifacts of job {args.id}")
    if args.download is None:
        return
    target = Path(args.download)
    by_rank = len({a.rank for a in page.items}) > 1
    for a in page.items:
        dest = target / (f"rank-{a.rank}" if by_rank else "") / a.name
        how = _download(client, a, dest)
        if not args.json:
            console.print(f"{a.name}: {how}", soft_wrap=True)


def _kept(a: Any) -> str:
    if a.stored:
        return "server" + (f" (and host {a.host})" if a.host else "")
    return f"host {a.host}" if a.host else "shared"


def _download(client: ApiClient, a: Any, dest: Path) -> str:
    """Copy one artifact to ``dest``; what happened, in words."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if a.stored:
        with dest.open("wb") as f:
            for piece in client.artifact_bytes(a.job_id, a.id):
                f.write(piece)
        return f"downloaded to {dest}"
    try:
        fs, path = fsspec.core.url_to_fs(a.url)
        if a.host is None and fs.exists(path):  # shared storage this machine reaches
            fs.get(path, str(dest))
            return f"copied from {a.url} to {dest}"
    except Exception as exc:
        return f"not copied: {a.url} cannot be read from here ({exc})"
    where = f"on host {a.host}" if a.host else "on storage this machine does not reach"
    return f"not copied: it is {where}, at {a.url}, and the server holds no copy"


def cmd_jobs_logs(args: argparse.Namespace) -> None:
    """Each rank's root cause and log tail; with ``--follow``, the running ranks' logs as they
    grow (``rank N | line``), and each rank's end as it comes, until the job ends."""
    client = _client(args)
    shown: set[int] = set()
    streamed: dict[int, int] = {}
    """Per running rank, where in its log (bytes) the lines printed so far end."""
    while True:
        job = client.job(args.id)
        live = args.follow and not job.status.terminal
        ranks = (client.follow_logs if live else client.logs)(args.id, args.rank).items
        if args.follow:
            _print_live(ranks, shown, streamed, as_json=args.json)
        ended = [r for r in ranks if r.rank not in shown and r.state.value not in _LIVE_STATES]
        if args.json:
            print(json.dumps(_jsonable(ended), indent=2))
        else:
            for r in ended:
                _print_rank_log(r, streamed.get(r.rank))
        shown.update(r.rank for r in ended)
        if not args.follow or job.status.terminal or len(shown) == len(ranks):
            if not args.json and not shown and not streamed:
                console.print(f"job {args.id} ({job.status.value}): no rank has ended yet")
            return
        time.sleep(args.interval)


_LIVE_STATES = {"assigned", "launching", "running"}


def _print_live(ranks: list[Any], shown: set[int], streamed: dict[int, int], as_json: bool) -> None:
    """The lines running ranks printed since the last look."""
    for r in ranks:
        if r.rank in shown or r.state.value not in _LIVE_STATES or not r.log_tail:
            continue
        new = new_log_text(r.log_tail, r.log_end, streamed.get(r.rank))
        streamed[r.rank] = r.log_end or 0
        if not new:
            continue
        if as_json:
            print(json.dumps({"rank": r.rank, "state": r.state.value, "log": new}))
            continue
        for line in new.rstrip("\n").split("\n"):
            console.print(Text(f"rank {r.rank} | ", style="dim") + Text(line), highlight=False)


def new_log_text(tail: str, end: int | None, seen: int | None) -> str:
    """What a log's latest ``tail`` (ending ``end`` bytes into the log) holds beyond the first
    ``seen`` bytes, already printed: all of it when nothing was, or when more was printed since
    than a tail holds (the lines between are not shown), or the log started again."""
    if seen is None or end is None or end < seen:
        return tail
    data = tail.encode()
    new = end - seen
    return tail if new >= len(data) else data[len(data) - new :].decode(errors="replace")


def _print_rank_log(r: Any, streamed: int | None = None) -> None:
    exit_text = "" if r.exit_code is None else f", exit {r.exit_code}"
    console.print(Text.assemble((f"rank {r.rank}", "bold"), f" ({r.state.value}{exit_text})"))
    body = r.log_tail or r.error
    if streamed is not None and r.log_tail:  # its live lines were printed: what came after
        body = new_log_text(r.log_tail, r.log_end, streamed)
        if not body:
            return
    if not body:
        console.print("  (no log uploaded)")
        return
    console.print(body.rstrip("\n"), markup=False, highlight=False)


def cmd_jobs_cancel(args: argparse.Namespace) -> None:
    job = _client(args).cancel(args.id)
    _emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]), title="cancelled")


def cmd_jobs_plan(args: argparse.Namespace) -> None:
    client = _client(args)
    plan = client.plan(args.id)
    if plan is None:  # only with known_version, which this never sends
        raise SystemExit(f"error: job {args.id} has no plan")
    models = client.models(args.id).items
    if args.json:
        print(json.dumps({"plan": _jsonable(plan), "models": _jsonable(models)}, indent=2))
        return
    _emit(
        args,
        plan,
        job_views.PLAN_COLUMNS,
        lambda p: job_views.plan_rows(p, models),
        title=job_views.plan_title(plan),
    )


def cmd_jobs_events(args: argparse.Namespace) -> None:
    events = _client(args).events(args.id)
    _emit(
        args,
        events,
        job_views.EVENT_COLUMNS,
        lambda p: job_views.event_rows(p.items),
        title=f"{events.total} straggler events of job {args.id}",
    )


def cmd_jobs_metrics(args: argparse.Namespace) -> None:
    metrics = _client(args).metrics(args.id, names=args.names, rank=args.rank)
    if args.names and not metrics.series:
        known = ", ".join(metrics.names) or "none yet"
        raise SystemExit(
            f"error: job {args.id} has no metric {', '.join(args.names)} (it has: {known})"
        )
    _emit(
        args,
        metrics,
        job_views.METRIC_COLUMNS,
        job_views.metric_rows,
        title=f"training metrics of job {args.id}"
        if metrics.series
        else f"job {args.id} has reported no metrics yet",
    )


def cmd_jobs_override(args: argparse.Namespace) -> None:
    batches = None
    if args.batches is not None:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError as exc:
            raise SystemExit(
                f"error: --batches must be integers separated by commas: {exc}"
            ) from exc
    req = _validated(
        OverrideCreate,
        {
            "kind": args.kind,
            "reason": args.reason,
            "batch_sizes": batches,
            "rank": args.rank,
            "batch_size": args.batch_size,
            "preview": args.preview,
        },
        "the override",
    )
    out = _client(args).override(args.id, req)
    if args.json:
        _emit(args, out, [], lambda _: [])
        return
    verb = "would make" if args.preview else "applied; made"
    if out.plan is not None:
        now = f" (now {out.current_predicted_ms:.1f} ms)" if out.current_predicted_ms else ""
        console.print(f"{args.kind} {verb} {job_views.plan_title(out.plan)}{now}")
        console.print(f"batches {out.plan.batch_sizes}")
    else:
        console.print(f"{args.kind} {'previewed' if args.preview else 'applied'}")


def _loss_series(client: ApiClient, job_id: int) -> MetricsOut | None:
    """The job's loss for the watch line; None from a server without the metrics API."""
    try:
        return client.metrics(job_id, points=10, names=[LOSS_METRIC])
    except ApiError as exc:
        if exc.status_code in (404, 405):
            return None
        raise


def cmd_jobs_watch(args: argparse.Namespace) -> None:
    """A live line until the job ends (or ``--count`` updates): on a terminal it rewrites
    itself; piped, it prints one line per update."""
    client = _client(args)
    shown = 0
    while True:
        job = client.job(args.id)
        line = job_views.watch_line(
            job,
            client.throughput(args.id),
            client.series(args.id, points=10, window=args.window),
            client.plan(args.id) if job.plan_version is not None else None,
            _loss_series(client, args.id),
        )
        shown += 1
        done = job.status.terminal or (args.count is not None and shown >= args.count)
        if sys.stdout.isatty():
            print(f"\r\x1b[2K{line}", end="\n" if done else "", flush=True)
        else:
            print(line, flush=True)
        if done:
            return
        time.sleep(args.interval)


def cmd_hosts_list(args: argparse.Namespace) -> None:
    hosts = _client(args).hosts()
    _emit(
        args,
        hosts,
        job_views.DEVICE_COLUMNS,
        lambda p: job_views.device_rows(p.items),
        title=f"{hosts.total} hosts",
    )


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
        lambda p: [
            [
                t.id,
                t.name,
                t.role.value,
                t.prefix + "…",
                t.host,
                t.created_at.strftime("%Y-%m-%d"),
                t.revoked_at.strftime("%Y-%m-%d") if t.revoked_at else "",
            ]
            for t in p.items
        ],
        title=f"{toks.total} tokens",
    )


def cmd_tokens_revoke(args: argparse.Namespace) -> None:
    tok = _client(args).revoke_token(args.id)
    _emit(args, tok, ["id", "name", "revoked"], lambda t: [[t.id, t.name, t.revoked_at]])


# ----------------------------------------------------------------------------- processes


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
        raw = yaml.safe_load(Path(args.profile).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read {args.profile}: {exc}") from exc
    profile = _validated(Profile, raw, args.profile)
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
    table = _table(
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


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evenflow", description=__doc__.splitlines()[0])
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--server",
        type=server_url,
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

    jobs = sub.add_parser("jobs", help="submit, list, show and cancel jobs").add_subparsers(
        dest="action", required=True
    )
    p = jobs.add_parser("submit", parents=[client], help="submit a job spec (YAML)")
    p.add_argument("file")
    p.add_argument(
        "--context",
        metavar="DIR",
        help="ship DIR (your code: .git and what its .evenflowignore lists are left out) with "
        "the job; the ranks run in it, with it first on sys.path",
    )
    p.set_defaults(func=cmd_jobs_submit)
    p = jobs.add_parser(
        "artifacts", parents=[client], help="what a job left: its final model and output files"
    )
    p.add_argument("id", type=int)
    p.add_argument("--download", metavar="DIR", help="copy them into DIR")
    p.set_defaults(func=cmd_jobs_artifacts)
    p = jobs.add_parser("list", parents=[client])
    p.add_argument("--status")
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=cmd_jobs_list)
    p = jobs.add_parser("show", parents=[client])
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_jobs_show)
    p = jobs.add_parser("checkpoints", parents=[client], help="a job's checkpoints, newest first")
    p.add_argument("id", type=int)
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=cmd_jobs_checkpoints)
    p = jobs.add_parser(
        "logs", parents=[client], help="each rank's root cause and last log lines once it ended"
    )
    p.add_argument("id", type=int)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument(
        "--follow",
        action="store_true",
        help="print running ranks' logs as they grow, and each rank's end, until the job ends",
    )
    p.add_argument("--interval", type=float, default=2.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_jobs_logs)
    p = jobs.add_parser("cancel", parents=[client])
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_jobs_cancel)
    p = jobs.add_parser("plan", parents=[client], help="the plan in force and each worker's model")
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_jobs_plan)
    p = jobs.add_parser("events", parents=[client], help="a job's straggler events")
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_jobs_events)
    p = jobs.add_parser(
        "metrics", parents=[client], help="a job's training metrics: the loss, ctx.log values"
    )
    p.add_argument("id", type=int)
    p.add_argument(
        "--name", dest="names", action="append", help="only this metric (repeatable), e.g. loss"
    )
    p.add_argument("--rank", type=int, help="only this rank's")
    p.set_defaults(func=cmd_jobs_metrics)
    p = jobs.add_parser(
        "override", parents=[client], help="change a job's plan by hand (--preview first)"
    )
    p.add_argument("id", type=int)
    p.add_argument("kind", choices=[k.value for k in OverrideKind])
    p.add_argument("--reason", required=True, help="why; kept in the audit log")
    p.add_argument("--batches", help="set_batches: every rank's batch, comma-separated")
    p.add_argument("--rank", type=int, help="pin, exclude, readmit: the rank")
    p.add_argument("--batch-size", type=int, help="pin: the rank's batch")
    p.add_argument("--preview", action="store_true", help="show the plan it would make only")
    p.set_defaults(func=cmd_jobs_override)
    p = jobs.add_parser(
        "watch", parents=[client], help="a live line: iteration, samples/s, idle, the plan"
    )
    p.add_argument("id", type=int)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between updates")
    p.add_argument("--window", type=int, default=20, help="iterations the idle share averages")
    p.add_argument("--count", type=int, default=None, help="stop after this many updates")
    p.set_defaults(func=cmd_jobs_watch)

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
