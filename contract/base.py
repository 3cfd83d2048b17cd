"""Shared pieces of the wire contract: protocol constants, bounded field types, the request and
response bases and the error body every 4xx carries.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 2
"""Bumped on any incompatible change; an agent with another version is refused at registration.
2: rank 0 publishes its rendezvous port (``master_port`` 0 until then), attempts, signals, log
tails and peak memory in worker reports and telemetry."""


MAX_TELEMETRY_RECORDS = 5000
"""Largest telemetry batch one request may carry."""


MAX_METRIC_VALUE = 1e30
"""Largest magnitude of a training metric's value: larger is an input error (a diverged loss
is better seen as a gap than as a number that overflows the server's bucket sums)."""


MAX_METRIC_NAMES = 64
"""Most distinct metric names one job may report: each is a series in every chart read."""


LOSS_METRIC = "loss"
"""The name the runtime reports the job's global mean loss under (from the plan's leader
rank); reserved, user code logs its own metrics under other names."""


MAX_PLAN_WAIT_S = 30.0
"""Longest a plan long-poll (``GET /jobs/{id}/plan?wait_s=``) is held; clients' read timeouts
must exceed it."""


CONTEXT_UNPACKED_MIN_BYTES = 512 * 2**20
CONTEXT_UNPACKED_RATIO = 20
"""A job's code archive may unpack to 20 times its size, or 512 MiB if that is more: past it,
it is a bomb (refused at upload by the server, and at unpacking by every agent)."""


MAX_WORKERS = 10_000


MAX_PAGE = 1000
"""Most items one page of a list endpoint holds (``limit``); a larger ``limit`` is a 422."""


MAX_MS = 1e7
"""No timing above ~2.8 hours per iteration phase is plausible; larger values are input errors."""


MAX_ID = 2**31 - 1
"""Largest id a client may send (PostgreSQL's INTEGER): a larger one is an input error, a 422,
not a database overflow."""


def _refuse_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\x00) characters")
    return value


Text = Annotated[str, AfterValidator(_refuse_nul)]
"""Every string a client sends: PostgreSQL cannot store NUL characters, so they are refused."""


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"


Name = Annotated[Text, Field(min_length=1, max_length=128, pattern=NAME_PATTERN)]


Id = Annotated[int, Field(ge=1, le=MAX_ID)]


Batch = Annotated[int, Field(ge=0, le=10_000_000)]


Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]


class Request(BaseModel):
    """Base of everything a client sends: strict types, no unknown fields.

    Enum fields opt out of strictness so they accept their JSON string values.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Response(BaseModel):
    """Base of everything the server answers; lenient so older clients read newer servers."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)


class ErrorOut(Response):
    """Every 4xx answer: a message for people and, where one field is at fault, its dotted path."""

    detail: str
    field: str | None = None
    errors: list[dict[str, Any]] | None = None
    """For validation errors: each problem with its location."""
