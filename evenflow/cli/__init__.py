"""The ``evenflow`` command: the server, the agent, and the REST API for people and scripts.

Client commands talk to ``--server`` / ``EVENFLOW_SERVER`` with ``EVENFLOW_TOKEN``, print tables
for people and ``--json`` for scripts, and exit 1 with the server's message on an error.
Server-side modules are imported only by the subcommands that need them, so an agent host
does not need the server's dependencies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import httpx
from pydantic import ValidationError

from agent.client import ApiError
from evenflow.cli import admin, jobs, run
from evenflow.cli.output import client_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evenflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run.add_commands(sub)
    client = client_options()
    jobs.add_commands(sub, client)
    admin.add_commands(sub, client)
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
