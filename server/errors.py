"""Domain errors, mapped to HTTP responses by one handler in ``server.app``.

::

    EvenflowError                 500 (never raised on purpose)
     +-- NotFound                 404  a named resource does not exist
     +-- Unauthorized             401  no token, or an unknown / revoked one
     +-- Forbidden                403  the token's role or host may not do this
     +-- Conflict                 409  the request contradicts stored state
     |    +-- ProtocolMismatch    409  an agent speaks another protocol version
     +-- Invalid                  422  well-formed but impossible (names the field)
     +-- TooMany                  429  over a per-token cap (live streams)

Every error carries a message for people and, where one field is at fault, the field's name.
"""

from __future__ import annotations


class EvenflowError(Exception):
    status_code = 500

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(EvenflowError):
    status_code = 404


class Unauthorized(EvenflowError):
    status_code = 401


class Forbidden(EvenflowError):
    status_code = 403


class Conflict(EvenflowError):
    status_code = 409


class ProtocolMismatch(Conflict):
    pass


class Invalid(EvenflowError):
    status_code = 422


class TooMany(EvenflowError):
    status_code = 429
