"""Request bodies parsed straight from bytes, for the hot write path.

FastAPI parses a declared body with ``json.loads`` and then validates the Python objects, on
the event loop. For telemetry (batches of up to 5,000 records) that was half the server's CPU;
pydantic's ``model_validate_json`` does both in one pass in Rust. Errors keep FastAPI's shape
(a ``RequestValidationError`` with ``body`` locations), and ``documented_body`` puts the same
schema in the OpenAPI document, so clients and schemathesis see no difference.

Every other body is parsed by the same Rust JSON parser (``JSONRoute``, the route class of
every router): it refuses what Python's ``json`` lets through, bytes that are not UTF-8 and
lone surrogates (``"\\ud800"``), which no database can store, so each is a 422 naming the
body, never a 500 at the database or an undocumented 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pydantic_core
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)], body=body
        ) from None


def documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads ``model`` itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def component_schemas(*models: type[BaseModel]) -> dict[str, Any]:
    """The models' JSON schemas (and those they refer to), as OpenAPI components."""
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


class StrictJSONRequest(Request):
    """A request whose ``json()`` is pydantic-core's parser: invalid UTF-8 or a lone surrogate
    is a ``json.JSONDecodeError``, which FastAPI answers with a ``json_invalid`` 422."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = pydantic_core.from_json(body)
            except ValueError as exc:
                raise json.JSONDecodeError(str(exc), body.decode("utf-8", "replace"), 0) from None
        return self._json


class JSONRoute(APIRoute):
    """The route class of every router: bodies are parsed by ``StrictJSONRequest``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
