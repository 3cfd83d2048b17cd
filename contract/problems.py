"""Validation errors in words: every problem of a request at once, each with its dotted field,
patterns named instead of quoted as regular expressions, and a "did you mean" for a misspelt key.

Pydantic's messages are good except in two places a person meets them most: a name that breaks
a pattern ("String should match pattern '^[A-Za-z0-9]...'") and an unknown key ("Extra inputs
are not permitted", which does not say what was meant). ``explain`` rewrites those two and
strips pydantic's "Value error, " prefix from the contract's own checks.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from contract.base import NAME_PATTERN

PATTERN_WORDS: Mapping[str, str] = {
    NAME_PATTERN: "must start with a letter or digit and hold only letters, digits and . _ : -",
}
"""What each pattern the contract uses means, for people."""


@dataclass(frozen=True)
class Problem:
    field: str
    """Dotted path of the offending value (``policy.name``, ``emulation.2.per_sample_ms``);
    empty for the request as a whole."""
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def explain(
    errors: Iterable[Mapping[str, Any]], model: type[BaseModel] | None = None
) -> list[Problem]:
    """Pydantic error dicts (``ValidationError.errors()``, or a 422's ``errors``) as problems.

    With ``model``, an unknown key is matched against the keys the model accepts there."""
    return [_problem(e, model) for e in errors]


def _problem(error: Mapping[str, Any], model: type[BaseModel] | None) -> Problem:
    loc = [p for p in error.get("loc", ()) if p not in ("body", "query", "path")]
    field = ".".join(str(p) for p in loc)
    kind = str(error.get("type", ""))
    message = str(error.get("msg", ""))
    if kind == "string_pattern_mismatch":
        pattern = str((error.get("ctx") or {}).get("pattern", ""))
        message = PATTERN_WORDS.get(pattern, f"must match the pattern {pattern}")
    elif kind == "extra_forbidden":
        message = _unknown_key(loc, model)
    elif kind == "missing":
        message = "is required"
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    return Problem(field, message)


def _unknown_key(loc: Sequence[Any], model: type[BaseModel] | None) -> str:
    known = _keys_at(model, loc[:-1]) if model is not None else []
    key = str(loc[-1]) if loc else ""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean '{close[0]}'?"
    if known:
        return f"unknown key; expected one of {', '.join(sorted(known))}"
    return "unknown key"


def _keys_at(model: type[BaseModel], path: Sequence[Any]) -> list[str]:
    """The keys the (nested) model at ``path`` accepts; list indices are stepped over."""
    current: type[BaseModel] | None = model
    for part in path:
        if current is None:
            return []
        if isinstance(part, int):
            continue
        info = current.model_fields.get(str(part))
        current = _model_in(info.annotation) if info is not None else None
    return list(current.model_fields) if current is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as ``list[X] | None``, if there is one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is None and not isinstance(annotation, types.UnionType):
        return None
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
