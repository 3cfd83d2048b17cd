"""Straggler events: what the detector reports about one rank, and how each report changed.

An event is a plain frozen value. The detector emits an ``EventUpdate`` whenever it opens an
event, changes its class or severity, or closes it; the newest update of an event carries its
whole current value, so a consumer (the server storing rows, a dashboard) can keep only that.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class StragglerKind(StrEnum):
    """Class of a straggler event, and the state machine an event goes through.

    ::

                       CUSUM of the log-ratio crosses h
        (no event) --------------------------------------> TRANSIENT (opened; start = onset)
                                                              |                   |
                 recovery CUSUM crosses h before the event    |                   | lasted
                 has lasted ``sustain_iterations``:           |                   | sustain_iterations
                 closed as TRANSIENT (a spike)  <-------------+                   | without recovery
                                                                                  v
                 recovery CUSUM crosses h and the samples                      DYNAMIC (updated)
                 since the recovery point look normal:  <--------------------------+
                 closed as DYNAMIC (end = recovery point)

    - ``TRANSIENT``: a sudden slowdown not (yet) sustained. An open TRANSIENT event is a suspect;
      a closed one was a short spike that reverted on its own. The ladder never acts on it.
    - ``DYNAMIC``: a sudden, sustained change of the rank's speed relative to its own model: the
      events the mitigation ladder acts on. ``end_iteration`` stays None while it lasts.

    A rank slow by design (an older or smaller device) is no event: its model says so, and the
    planner already gives it fewer samples. A rank has at most one open event at a time; the
    server closes what is still open when the job ends. Iterations are the only time axis.
    """

    DYNAMIC = "dynamic"
    TRANSIENT = "transient"


class Change(StrEnum):
    """What an ``EventUpdate`` says happened to its event."""

    OPENED = "opened"
    UPDATED = "updated"
    """The class changed (TRANSIENT -> DYNAMIC) or the severity moved by more than the
    configured relative step since the last report."""
    CLOSED = "closed"


@dataclass(frozen=True)
class StragglerEvent:
    """One rank running slower than it should, from ``start_iteration`` on."""

    rank: int
    kind: StragglerKind
    start_iteration: int
    """Estimated onset: the first iteration of the run that made the change-point test fire."""
    end_iteration: int | None
    """First iteration back to normal (exclusive end); None while the event is open."""
    severity: float
    """Slowdown factor: the median of measured/predicted time since the onset, relative to the
    rank's normal level."""
    detected_iteration: int
    """Iteration whose timing made the detector open the event."""
    confirmed_iteration: int | None = None
    """Iteration at which it became DYNAMIC; None for transient events."""
    peak: float = 0.0
    """Largest single measured/predicted ratio (relative to normal) seen in the event."""
    action: str = ""
    """What the mitigation ladder did about it (filled by the caller from a ``Decision``)."""

    @property
    def key(self) -> tuple[int, int, StragglerKind]:
        """Identity of the event: a rank has one event starting at a given iteration.

        A transient event keeps its key component ``DYNAMIC`` (see ``family``) so that it is
        the same event when confirmed.
        """
        return (self.rank, self.start_iteration, self.family)

    @property
    def family(self) -> StragglerKind:
        return StragglerKind.DYNAMIC

    @property
    def open(self) -> bool:
        return self.end_iteration is None

    @property
    def duration(self) -> int | None:
        """Iterations from onset to recovery; None while open."""
        return None if self.end_iteration is None else self.end_iteration - self.start_iteration


@dataclass(frozen=True)
class EventUpdate:
    """One change of one event, observed while processing timings of ``iteration``."""

    change: Change
    event: StragglerEvent
    iteration: int
