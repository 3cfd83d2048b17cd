"""Raw routes: endpoints that read their own request, for the two requests a fleet sends most.

A host's heartbeat and a telemetry post are most of a fleet's requests (hundreds a second).
FastAPI's handling of a route (its included routers' matching, solving the route's
dependencies, parsing a declared body, serialising a response model) costs several times what
answering a steady heartbeat does, so these two are :class:`RawRoute` s: documented like any
other operation (their path parameters, the body's schema through ``bodies.documented_body``,
the response model), but mounted at the head of the app's own routes (``mount``: one pattern
tried before them) and called with the request, its validated path parameters, the app's
context and the caller's principal (declared as ``Context`` and ``Authenticated``, as any route
does, but handed over without solving dependencies); the endpoint reads the body itself and
returns the JSON body of its answer. Errors it raises reach the app's handlers as any route's
do. What passes before them (origin checks, authentication, throttling, body limits) is the
gate's (``server.api.gate``), which leaves the principal in ``scope["state"]``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.utils import request_params_to_args
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from starlette import routing
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from server.api import statuses
from server.api.bodies import JSONRoute
from server.api.gate import PRINCIPAL_STATE
from server.context import AppContext, context_of

RawEndpoint = Callable[..., Awaitable[bytes]]
"""``(request, context, principal, **path_params)`` -> the JSON body of a 200."""


@dataclass(frozen=True)
class _Declared:
    path: str
    endpoint: RawEndpoint
    options: dict[str, Any]


_DECLARED: list[_Declared] = []
"""The raw routes the route modules declare (``post``), mounted by every app built."""


class RawRoute(JSONRoute):
    """A POST route whose endpoint takes ``(request, context, principal, **path_params)`` and
    returns the JSON body of its 200; nothing else of FastAPI's request handling runs (see the
    module docstring)."""

    def __init__(self, path: str, endpoint: RawEndpoint, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self._adapters: dict[str, TypeAdapter[Any]] = {
            f.name: TypeAdapter(Annotated[f.field_info.annotation, f.field_info])  # type: ignore[arg-type]
            for f in self.dependant.path_params
        }
        """Each path parameter's validator, called directly: FastAPI's machinery around the
        same validation costs more than the validation."""
        self.context: AppContext | None = None
        """The app's context, once mounted (``mount``)."""

    def _path_params(self, raw: dict[str, str]) -> dict[str, Any]:
        """The path parameters validated; a refusal in FastAPI's words (its ``loc``)."""
        try:
            return {
                name: adapter.validate_python(raw[name]) for name, adapter in self._adapters.items()
            }
        except ValidationError:
            _, errors = request_params_to_args(self.dependant.path_params, raw)
            raise RequestValidationError(errors) from None

    def matches(self, scope: Scope) -> tuple[routing.Match, Scope]:
        return routing.Route.matches(self, scope)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        methods = self.methods or set()
        if scope["method"] not in methods:
            raise HTTPException(405, headers={"Allow": ", ".join(sorted(methods))})
        try:
            body = await self.endpoint(
                Request(scope, receive),
                context=self.context or context_of(scope["app"]),
                principal=scope["state"][PRINCIPAL_STATE],
                **self._path_params(scope["path_params"]),
            )
        except ClientDisconnect:
            return  # the caller left before its body arrived: nobody to answer
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def post(path: str, **options: Any) -> Callable[[RawEndpoint], RawEndpoint]:
    """Declare a raw ``POST path`` (under the API prefix); ``options`` as ``APIRouter.post``'s."""

    def declare(endpoint: RawEndpoint) -> RawEndpoint:
        _DECLARED.append(_Declared(path, endpoint, options))
        return endpoint

    return declare


def mount(app: FastAPI, *, prefix: str, public: Collection[str]) -> None:
    """The declared raw routes, under ``prefix``, at the head of ``app``'s routes (no other
    route answers a POST to their paths, so none is shadowed), with the statuses their
    dependencies imply documented (``server.api.statuses``)."""
    staged = APIRouter(prefix=prefix, route_class=RawRoute)
    for declared in _DECLARED:
        staged.add_api_route(declared.path, declared.endpoint, methods=["POST"], **declared.options)
    statuses.document(staged, api_prefix="", public=public)
    # built again with those statuses: a route reads its responses' models when it is made
    router = APIRouter(prefix=prefix, route_class=RawRoute)
    for declared, route in zip(_DECLARED, staged.routes, strict=True):
        assert isinstance(route, RawRoute)
        options = {**declared.options, "responses": route.responses}
        router.add_api_route(declared.path, declared.endpoint, methods=["POST"], **options)
    for route in router.routes:
        assert isinstance(route, RawRoute)
        route.context = context_of(app)
    app.router.routes[0:0] = router.routes
