"""The fleet's fast paths, behind one interface the plain path also implements.

A host's heartbeat and a telemetry post are most of what a fleet sends (hundreds a second at
10,000 devices). Each is answered by one object, :class:`AgentPaths`, which the app builds once
(``AppContext.paths``):

- :class:`~server.scale.plain.PlainPaths`, the plain path and the executable specification:
  a heartbeat is parsed and worked out in a transaction of its own (its host's time written
  with it); a telemetry post is judged and stored in a transaction of its own.
- :class:`~server.scale.fast.FastPaths`, what a fleet needs: a steady heartbeat answered from
  memory (a cache hit, ``host_answers``), its host's time written in batches (``Liveness``),
  the heartbeats the database works out committed in groups (``heartbeat_groups``); telemetry
  posts committed in groups by one writer thread (``telemetry_writer``), packed as arrays on
  PostgreSQL (``pg_arrays``).

Both answer every request with the same bytes and store the same rows (the property tests
drive both side by side). ``Settings.fast_paths`` (``EVENFLOW_FAST_PATHS``, default on)
picks one. The caches of credentials and plans (``cache``) serve every request, on either path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from server.context import AppContext
    from server.services.telemetry import Post
    from server.services.tokens import Principal


class AgentPaths(Protocol):
    """How an API process answers the fleet's two most frequent requests."""

    async def heartbeat(self, host_id: int, raw: bytes, principal: Principal) -> bytes:
        """The answer (a ``HeartbeatAck``'s JSON) to a host's heartbeat whose body is ``raw``;
        raises the refusal (``RequestValidationError`` for a body that does not parse,
        ``EvenflowError`` for one the domain refuses)."""
        ...

    async def telemetry(self, post: Post) -> tuple[int, int]:
        """(accepted, duplicates) once the post's rows are committed; raises its refusal."""
        ...


def agent_paths(context: AppContext) -> AgentPaths:
    """The paths ``context.settings.fast_paths`` asks for."""
    from server.scale.fast import FastPaths
    from server.scale.plain import PlainPaths

    return FastPaths(context) if context.settings.fast_paths else PlainPaths(context)
