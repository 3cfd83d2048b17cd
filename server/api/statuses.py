"""The statuses each API operation documents, derived from what the route depends on.

Every operation can get 413 (the gate refuses a declared body over the limit on any path);
one that needs a token, 401 and 429 (the gate: a bad token, too many from one address) and
403 (a role, a worker credential or an agent's host may not do this; a cookie write from
another origin); one with an id in its path, 404; one with any input (path, query or body,
or a body it parses itself), 422. What only a service knows, a 409 for a request that
contradicts the stored state, the route declares itself (``declare(409)``), and so does a
success other than its status code (a 304, a preview's 200).
``tests/api/test_statuses.py`` finds every status each route can return, from its code,
and checks that the document lists each and no other.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastapi import APIRouter
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from contract.base import ErrorOut

DESCRIPTIONS = {
    401: "No token, or an unknown or revoked one",
    403: "The token's role or host may not do this",
    404: "No such resource",
    409: "Conflicts with the stored state",
    413: "Request body too large",
    422: "Invalid input; `field` names the culprit",
    429: "Too many bad credentials from this address, or too many live streams",
}


def declare(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route whose service may answer ``codes`` besides what its
    dependencies imply: 409 for a request contradicting the stored state, 404 for an id that
    is not in the path."""
    return {code: {"description": DESCRIPTIONS[code]} for code in codes}


def document(router: APIRouter, *, api_prefix: str, public: Collection[str]) -> None:
    """Add the statuses its dependencies imply to each route of ``router`` (an API router,
    before the app includes it under ``api_prefix``; ``public`` are the full paths needing no
    token). Idempotent: every app built includes the same routers."""
    for route in router.routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue
        codes = implied(route, authenticated=api_prefix + route.path not in public)
        declared = {int(k): v for k, v in route.responses.items()}
        for code in sorted(codes | {c for c in declared if c >= 400}):
            entry = {"description": DESCRIPTIONS[code], **declared.get(code, {})}
            declared[code] = {"model": ErrorOut, **entry}
        route.responses = dict(sorted(declared.items()))


def implied(route: APIRoute, *, authenticated: bool) -> set[int]:
    codes = {413}
    if authenticated:
        codes |= {401, 403, 429}
    path, other = _params(route.dependant)
    if path:
        codes |= {404, 422}
    if other or "requestBody" in (route.openapi_extra or {}):
        codes.add(422)
    return codes


def _params(dependant: Dependant) -> tuple[bool, bool]:
    """Whether ``dependant`` (with its sub-dependencies) reads a path parameter, and whether it
    reads any other input (query, header, cookie or body parameters)."""
    path = bool(dependant.path_params)
    other = bool(dependant.query_params or dependant.body_params or dependant.header_params)
    other = other or bool(dependant.cookie_params)
    for sub in dependant.dependencies:
        sub_path, sub_other = _params(sub)
        path, other = path or sub_path, other or sub_other
    return path, other
