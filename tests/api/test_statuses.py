"""Every status the server can return is in the OpenAPI document, for that operation, and
no status it cannot return is.

What a route can return is found here from the route itself, not from the document's own
derivation (``server.api.statuses``): its success code; the gate's 413 on any path and 401,
429 and 403 before an authenticated one; 404 and 422 for an id in its path, 422 for any other
input; and, read from the source of the route and of every ``server`` function it calls
(transitively, methods of the app context's parts included), each ``raise`` of a domain error (``server.errors``: 404, 403, 409, 422,
429 ...), each ``HTTPException`` and each explicit ``status_code=``.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.exceptions import HTTPException

from server.app import API_PREFIX, PUBLIC_PATHS, create_app
from server.errors import EvenflowError
from tests.harness import make_settings


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    db = tmp_path_factory.mktemp("statuses") / "s.db"
    return create_app(make_settings(f"sqlite:///{db}"))


def _routes(app: FastAPI) -> Iterator[tuple[str, APIRoute]]:
    """Each operation's full path and its route, as the app serves them (included routers)."""
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, APIRoute) and route.include_in_schema and context.path:
            yield context.path, route


def _flatten(dependant: Dependant) -> Iterator[Dependant]:
    yield dependant
    for sub in dependant.dependencies:
        yield from _flatten(sub)


def _function_of(obj: object) -> types.FunctionType | None:
    obj = inspect.unwrap(obj) if callable(obj) else obj  # type: ignore[arg-type]
    if isinstance(obj, types.FunctionType) and obj.__module__.startswith("server."):
        return obj
    return None


def _resolve(node: ast.expr, scope: dict[str, Any]) -> object:
    """What a name or dotted attribute names in a module's globals (None if not that simple)."""
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, scope)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


@cache
def _direct(function: types.FunctionType) -> tuple[frozenset[int], tuple[types.FunctionType, ...]]:
    """The statuses ``function`` answers or raises itself, and the ``server`` functions it
    names (calls, or passes on to be called): by name in its module's globals, such as
    ``jobs.get`` or ``_store``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError):
        return frozenset(), ()
    scope = sys.modules[function.__module__].__dict__
    codes: set[int] = set()
    named: list[types.FunctionType] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            codes |= _status_of_raise(node.exc, scope)
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "status_code" and isinstance(kw.value, ast.Constant):
                    codes.add(int(kw.value.value))
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "status_code":
                    codes.add(int(node.value.value))
        if isinstance(node, ast.Name | ast.Attribute):
            named += [f for f in _named(node, function, scope) if f is not function]
    return frozenset(codes), tuple(named)


def _named(
    node: ast.Name | ast.Attribute, function: types.FunctionType, scope: dict[str, Any]
) -> list[types.FunctionType]:
    """The ``server`` functions a name or attribute in ``function`` stands for: the one it
    names, or a method of every implementation of the interface it names."""
    found = _function_of(_resolve(node, scope))
    if found is not None:
        return [found]
    if not isinstance(node, ast.Attribute):
        return []
    return [f for m in _methods(node, function, scope) if (f := _function_of(m)) is not None]


def _methods(
    node: ast.Attribute, function: types.FunctionType, scope: dict[str, Any]
) -> list[object]:
    """The methods ``function`` names on an object whose class is known without running it:
    ``self.x`` in a method of a module-level class, and ``context.part.x`` where ``context`` is
    a parameter annotated with a class whose ``part`` is annotated with a class (the app
    context's parts, such as its telemetry writer); for a part annotated with an interface (a
    ``Protocol``, such as ``AgentPaths``), the method of each class that implements it."""
    owner: object = None
    if isinstance(node.value, ast.Name) and node.value.id == "self":
        owner = scope.get(function.__qualname__.split(".")[0])
    elif isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name):
        holder = _hints(function).get(node.value.value.id)
        owner = _hints(holder).get(node.value.attr) if isinstance(holder, type) else None
    if not isinstance(owner, type):
        return []
    owners = [owner]
    if getattr(owner, "_is_protocol", False):
        owners += owner.__subclasses__()
    return [getattr(o, node.attr, None) for o in owners]


def _hints(obj: object) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # a name only imported for type checking: not followed
        return {}


def _status_of_raise(exc: ast.Call, scope: dict[str, Any]) -> set[int]:
    raised = _resolve(exc.func, scope)
    if isinstance(raised, type) and issubclass(raised, EvenflowError):
        return {raised.status_code}
    if isinstance(raised, type) and issubclass(raised, HTTPException):
        first = exc.args[0] if exc.args else None
        if isinstance(first, ast.Constant) and isinstance(first.value, int):
            return {first.value}
    return set()


def _raised(function: types.FunctionType) -> set[int]:
    """Statuses ``function`` can answer or raise, itself or through every ``server`` function
    it reaches (call cycles included)."""
    codes: set[int] = set()
    seen: set[types.FunctionType] = set()
    todo = [function]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        own, named = _direct(f)
        codes |= own
        todo.extend(named)
    return codes


def can_return(path: str, route: APIRoute) -> set[int]:
    codes = {route.status_code or 200, 413}
    if path not in PUBLIC_PATHS:
        codes |= {401, 403, 429}
    dependants = list(_flatten(route.dependant))
    if any(d.path_params for d in dependants):
        codes |= {404, 422}
    inputs = any(d.query_params or d.body_params or d.header_params for d in dependants)
    if inputs or "requestBody" in (route.openapi_extra or {}):
        codes.add(422)
    for d in dependants:
        found = _function_of(d.call)
        if found is not None:
            codes |= _raised(found)
    return codes


def _documented(app: FastAPI, path: str, route: APIRoute) -> dict[str, set[int]]:
    operations = app.openapi()["paths"][path]
    return {m.lower(): {int(c) for c in operations[m.lower()]["responses"]} for m in route.methods}


def test_every_status_a_route_can_return_is_documented_and_no_other(app: FastAPI) -> None:
    problems = []
    routes = [(p, r) for p, r in _routes(app) if p.startswith(API_PREFIX)]
    assert len(routes) > 30
    for path, route in routes:
        expected = can_return(path, route)
        for method, documented in _documented(app, path, route).items():
            if missing := expected - documented:
                problems.append(f"{method.upper()} {path}: {sorted(missing)} undocumented")
            if extra := documented - expected:
                problems.append(f"{method.upper()} {path}: {sorted(extra)} cannot happen")
    assert not problems, "\n".join(problems)


def test_the_finder_sees_a_conflict_a_service_raises(app: FastAPI) -> None:
    """The check can fail: a 409 is found in ``jobs.cancel`` two calls below the route, and a
    document that lacks it is caught."""
    path = f"{API_PREFIX}/jobs/{{job_id}}/cancel"
    (cancel,) = [r for p, r in _routes(app) if p == path]
    assert {404, 409} <= can_return(path, cancel)
    documented = _documented(app, path, cancel)["post"]
    assert 409 in documented
    assert can_return(path, cancel) - (documented - {409}) == {409}


def test_errors_are_documented_with_the_one_error_body(app: FastAPI) -> None:
    for path, operations in app.openapi()["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                if int(code) >= 400:
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorOut"}, (
                        method,
                        path,
                        code,
                    )
