"""Raw routes: endpoints that read their own request, for the two requests a fleet sends most.

A host's heartbeat and a telemetry post are most of a fleet's requests (hundreds a second).
FastAPI's handling of a route (solving its dependencies, parsing and validating a declared
body, serialising a response model) was over half of such a request's CPU, so these two are
:class:`RawRoute` s: matched and documented like any other operation (their path parameters,
the body's schema through ``bodies.documented_body``, the response model), but the endpoint is
called with the request, its validated path parameters, the app's context and the caller's
principal (declared as ``Context`` and ``Authenticated``, as any route does, but handed over
without solving dependencies); it reads the body itself and returns the response. Errors it raises reach the app's handlers as any route's do.
What passes before them (origin checks, authentication, throttling, body limits) is the gate's
(``server.api.gate``); the caller's principal is in ``scope["state"]``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.dependencies.utils import request_params_to_args
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from server.api.bodies import JSONRoute
from server.api.gate import PRINCIPAL_STATE
from server.context import context_of

RawEndpoint = Callable[..., Awaitable[Response]]


class RawRoute(JSONRoute):
    """A route whose endpoint takes ``(request, context, principal, **path_params)`` and
    returns a ``Response``; nothing else of FastAPI's request handling runs (see the module
    docstring)."""

    def __init__(self, path: str, endpoint: RawEndpoint, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.app = self._serve

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        params, errors = request_params_to_args(self.dependant.path_params, scope["path_params"])
        if errors:
            raise RequestValidationError(errors)
        try:
            response = await self.endpoint(
                Request(scope, receive),
                context=context_of(scope["app"]),
                principal=scope["state"][PRINCIPAL_STATE],
                **params,
            )
        except ClientDisconnect:
            return  # the caller left before its body arrived: nobody to answer
        await response(scope, receive, send)


def raw_post(router: APIRouter, path: str, **kwargs: Any) -> Callable[[RawEndpoint], RawEndpoint]:
    """``@router.post(path, **kwargs)`` for a :class:`RawRoute`."""

    def add(endpoint: RawEndpoint) -> RawEndpoint:
        router.add_api_route(
            path, endpoint, methods=["POST"], route_class_override=RawRoute, **kwargs
        )
        return endpoint

    return add


def first(routes: list[BaseRoute]) -> None:
    """Put the raw routes at the head of an app's ``routes``, in place: a request is matched
    against the routes in order, one pattern each, and these two are most of a fleet's
    requests. (No other route answers a POST to their paths, so none is shadowed.)"""
    routes.sort(key=lambda route: not isinstance(route, RawRoute))


def json_bytes(body: bytes) -> Response:
    """A 200 whose body is already JSON."""
    return Response(body, media_type="application/json")
