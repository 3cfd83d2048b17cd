"""The wire contract between the control plane, agents, training workers and API clients.

It imports only pydantic (and the standard library), so an agent host or a training worker
needs none of the server's dependencies. Both :mod:`server` and :mod:`agent` depend on it;
neither depends on the other.

=====================  ==========================================================
module                 audience
=====================  ==========================================================
:mod:`.base`           protocol constants, bounded field types, the error body
:mod:`.enums`          roles, states with their transitions, policies, kinds
:mod:`.spec`           the job spec a user submits and workers read back
:mod:`.agent`          the agent protocol: hosts, heartbeats, plans, telemetry
:mod:`.api`            the public REST API: jobs, hosts, overrides, tokens, audit
:mod:`.dashboard`      the dashboard's chart series and throughput
=====================  ==========================================================

Every request model refuses unknown fields and coerces nothing (``strict``): ``"5"`` is not an
integer here. Bounds on sizes and lengths are part of the contract, so a bad request is answered
with a 422 that names the field.
"""
