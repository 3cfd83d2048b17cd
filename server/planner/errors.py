"""Every exception the planner raises.

::

    PlannerError                     base of everything below; catch this to catch them all
     +-- InvalidInput (ValueError)   a value is malformed: negative rate, duplicate worker id,
     |    |                          granularity < 1, NaN, ... (the caller's bug or bad request)
     |    +-- UnknownPolicy          a policy name not in ``POLICIES``
     +-- Infeasible                  well-formed, but the constraints cannot all hold; the message
     |                               names the constraint, ``constraint`` is a short code and
     |                               ``worker`` the worker concerned, if one
     +-- SolverError                 PuLP/CBC could not run or answered nonsense

An HTTP layer maps ``InvalidInput`` to 422 and ``Infeasible`` to 409 (or 422), both with the
message as detail; ``SolverError`` is a 500-class failure of the environment.

Placement does not raise ``Infeasible`` for a job that does not fit: waiting for devices is a normal
outcome there, so it is a status in the returned ``Placement``.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base of every planner exception."""


class InvalidInput(PlannerError, ValueError):
    """A malformed value; ``field`` names it when there is one."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownPolicy(InvalidInput):
    """A policy name that is not registered."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(
            f"unknown policy {name!r}; known policies: {', '.join(known)}", field="policy"
        )
        self.name = name


class Infeasible(PlannerError):
    """No plan satisfies every constraint.

    ``constraint`` is one of:

    - ``granularity``: the global batch is not a multiple of the granularity;
    - ``worker_bounds``: one worker has no admissible batch size (min > max, no multiple of the
      granularity between them, or a pin outside its bounds or off the granularity);
    - ``minimums``: pinned batches plus minimum batches add up to more than the global batch;
    - ``capacity``: maximum batches (and pins) add up to less than the global batch.
    """

    def __init__(self, message: str, *, constraint: str, worker: str | None = None) -> None:
        super().__init__(message)
        self.constraint = constraint
        self.worker = worker


class SolverError(PlannerError):
    """The ILP solver failed to run or returned a status the planner cannot use."""
