"""``evenflow jobs ...``: submit a job, follow it, read what it left, change its plan by hand."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import yaml
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from agent.client import ApiClient, ApiError
from contract.api import OverrideCreate
from contract.base import LOSS_METRIC
from contract.dashboard import MetricsOut
from contract.enums import OverrideKind
from contract.spec import JobSpec
from evenflow import contexts, job_views
from evenflow.cli.output import (
    api_client,
    console,
    emit,
    jsonable,
    validated,
)


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


def cmd_jobs_submit(args: argparse.Namespace) -> None:
    try:
        raw = yaml.safe_load(Path(args.file).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: cannot read {args.file}: {exc}") from exc
    client = api_client(args)
    if args.context is not None:
        if not isinstance(raw, dict) or not isinstance(raw.get("workload"), dict):
            raise SystemExit(f"error: {args.file} has no workload to give the context to")
        raw["workload"]["context"] = _ship_context(client, Path(args.context), quiet=args.json)
    job = client.submit(validated(JobSpec, raw, args.file))
    emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]), title="submitted")
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


def cmd_jobs_list(args: argparse.Namespace) -> None:
    jobs = api_client(args).jobs(status=args.status, limit=args.limit)
    emit(args, jobs, JOB_COLUMNS, lambda d: _job_rows(d.items), title=f"{jobs.total} jobs")
    if not args.json:
        _print_pending(jobs.items)


def _print_pending(jobs: list[Any]) -> None:
    """Why each pending job waits, one line each (under the table: no column to truncate)."""
    for j in jobs:
        if j.status.value == "pending" and j.pending_reason:
            console.print(f"job {j.id} waits: {j.pending_reason}", highlight=False, markup=False)


def cmd_jobs_show(args: argparse.Namespace) -> None:
    client = api_client(args)
    job = client.job(args.id)
    if args.json:
        emit(args, job, [], lambda _: [])
        return
    emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]))
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
    page = api_client(args).checkpoints(args.id, limit=args.limit)

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
    emit(args, page, columns, rows, title=f"{shown}{page.total} checkpoints of job {args.id}")
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
    client = api_client(args)
    page = client.artifacts(args.id)

    def rows(p: Any) -> list[list[Any]]:
        return [[a.rank, a.name, contexts.format_size(a.size_bytes), _kept(a)] for a in p.items]

    emit(args, page, ["rank", "name", "size", "kept"], rows, title=f"artifacts of job {args.id}")
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
    client = api_client(args)
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
            print(json.dumps(jsonable(ended), indent=2))
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
    job = api_client(args).cancel(args.id)
    emit(args, job, JOB_COLUMNS, lambda j: _job_rows([j]), title="cancelled")


def cmd_jobs_plan(args: argparse.Namespace) -> None:
    client = api_client(args)
    plan = client.plan(args.id)
    if plan is None:  # only with known_version, which this never sends
        raise SystemExit(f"error: job {args.id} has no plan")
    models = client.models(args.id).items
    if args.json:
        print(json.dumps({"plan": jsonable(plan), "models": jsonable(models)}, indent=2))
        return
    emit(
        args,
        plan,
        job_views.PLAN_COLUMNS,
        lambda p: job_views.plan_rows(p, models),
        title=job_views.plan_title(plan),
    )


def cmd_jobs_events(args: argparse.Namespace) -> None:
    events = api_client(args).events(args.id)
    emit(
        args,
        events,
        job_views.EVENT_COLUMNS,
        lambda p: job_views.event_rows(p.items),
        title=f"{events.total} straggler events of job {args.id}",
    )


def cmd_jobs_metrics(args: argparse.Namespace) -> None:
    metrics = api_client(args).metrics(args.id, names=args.names, rank=args.rank)
    if args.names and not metrics.series:
        known = ", ".join(metrics.names) or "none yet"
        raise SystemExit(
            f"error: job {args.id} has no metric {', '.join(args.names)} (it has: {known})"
        )
    emit(
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
    req = validated(
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
    out = api_client(args).override(args.id, req)
    if args.json:
        emit(args, out, [], lambda _: [])
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
    client = api_client(args)
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


def add_commands(sub: Any, client: argparse.ArgumentParser) -> None:
    """``jobs`` and its subcommands."""
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
