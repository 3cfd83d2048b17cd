"""``evenflow hosts list`` and ``evenflow tokens ...`` (an admin's)."""

from __future__ import annotations

import argparse
from typing import Any

from contract.api import TokenCreate
from contract.enums import Role
from evenflow import job_views
from evenflow.cli.output import (
    api_client,
    console,
    emit,
)


def cmd_hosts_list(args: argparse.Namespace) -> None:
    hosts = api_client(args).hosts()
    emit(
        args,
        hosts,
        job_views.DEVICE_COLUMNS,
        lambda p: job_views.device_rows(p.items),
        title=f"{hosts.total} hosts",
    )


def cmd_tokens_create(args: argparse.Namespace) -> None:
    created = api_client(args).create_token(
        TokenCreate(name=args.name, role=Role(args.role), host=args.host)
    )
    if args.json:
        emit(args, created, [], lambda _: [])
        return
    console.print(f"token {created.id} '{created.name}' ({created.role.value}); shown once:")
    print(created.token)


def cmd_tokens_list(args: argparse.Namespace) -> None:
    toks = api_client(args).tokens()
    emit(
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
    tok = api_client(args).revoke_token(args.id)
    emit(args, tok, ["id", "name", "revoked"], lambda t: [[t.id, t.name, t.revoked_at]])


def add_commands(sub: Any, client: argparse.ArgumentParser) -> None:
    """``hosts`` and ``tokens`` and their subcommands."""
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
