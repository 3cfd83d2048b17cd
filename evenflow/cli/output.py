"""What the client commands share: the control plane's address and credential, and how they
print (tables for people, ``--json`` for scripts).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from rich import box
from rich.console import Console
from rich.table import Table

from agent.client import ApiClient, make_http
from contract.problems import explain

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


def api_client(args: argparse.Namespace) -> ApiClient:
    return ApiClient(make_http(args.server, args.token))


def emit(
    args: argparse.Namespace,
    data: Any,
    columns: Sequence[str],
    rows: Callable[[Any], list[list[Any]]],
    title: str | None = None,
) -> None:
    if args.json:
        print(json.dumps(jsonable(data), indent=2, default=str))
        return
    table = new_table(columns, title)
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


def new_table(columns: Sequence[str], title: str | None = None) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for column in columns:
        folded = column in FOLDED
        table.add_column(
            column, overflow="fold", no_wrap=not folded, min_width=12 if folded else None
        )
    return table


def jsonable(data: Any) -> Any:
    if isinstance(data, BaseModel):
        return data.model_dump(mode="json")
    if isinstance(data, list):
        return [jsonable(d) for d in data]
    return data


def client_options() -> argparse.ArgumentParser:
    """The options every client command takes (a parent parser)."""
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
    return client


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], raw: Any, source: str) -> M:
    """``raw`` as a ``model``, or exit naming every problem of ``source`` in words."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = explain(exc.errors(), model)
        lines = "\n".join(f"  {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        raise SystemExit(f"error: {source} has {len(problems)} {noun}:\n{lines}") from exc
