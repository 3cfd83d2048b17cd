"""Errors after which running the job again cannot help.

::

    FatalJobError                  the job cannot succeed as specified, wherever it runs
     +-- EntrypointError           its entrypoint cannot be imported or found
     +-- CheckpointPathError       its checkpoint directory cannot be written (checkpoint.py)
     +-- StreamEnded               its stream ran out before its last iteration (streams.py)
     +-- ReplicaDivergence         its loop stepped some ranks only (iteration.py)

A worker that fails with one exits with ``WORKER_EXIT_FATAL``, and the control plane fails the
job with the reason instead of restarting it: restarts are for faults (a lost host, a killed
rank, running out of memory), not for code that fails the same way every time.
"""

from __future__ import annotations


class FatalJobError(RuntimeError):
    """The job cannot succeed as specified: restarting it would fail the same way."""


class EntrypointError(FatalJobError):
    """The job's entrypoint cannot be imported, or names nothing callable."""
