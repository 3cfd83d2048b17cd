"""The Python a job's ranks run with: the agent's own, or a prepared environment the job names.

A job may name the interpreter of an environment prepared on every host (a venv or conda env
with torch, the job's dependencies and Evenflow: ``environment.python`` in its spec). Evenflow
does not install packages per job: an install per job and host would take minutes, fail in
ways unrelated to the job, and let two jobs fight over one environment. Before a host starts a
rank with such an interpreter, it runs it once (:data:`PROBE`): it must import Evenflow's
runtime and a torch that can run the job's backend (NCCL needs CUDA), else the rank fails at
once with the reason. What an interpreter answered is kept until its file changes.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

PROBE = """
import json, sys
import agent.runtime.worker
import torch
import torch.distributed as dist
ok = dist.is_available()
print(json.dumps({
    "python": sys.version.split()[0],
    "torch": torch.__version__,
    "cuda": torch.cuda.is_available(),
    "nccl": ok and dist.is_nccl_available(),
    "gloo": ok and dist.is_gloo_available(),
}))
"""
"""What an environment is asked: Evenflow's runtime imports, and what its torch can run."""

PROBE_TIMEOUT_S = 180.0


class InterpreterError(RuntimeError):
    """A job's interpreter cannot run its ranks on this host (the message says why)."""


@dataclass(frozen=True)
class Interpreter:
    """What an environment's Python reported."""

    path: str
    python: str
    torch: str
    cuda: bool
    nccl: bool
    gloo: bool


class Interpreters:
    """The interpreters this agent has checked, each once per version of its file."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._known: dict[tuple[str, float], Interpreter | str] = {}

    def check(self, path: str, backend: str, env: Mapping[str, str]) -> Interpreter:
        """The interpreter at ``path``, able to run ``backend`` ranks; ``InterpreterError``
        naming the reason when it cannot (run with ``env``, the ranks' environment)."""
        try:
            key = (path, os.stat(path).st_mtime)
        except OSError as exc:
            raise InterpreterError(
                f"environment.python {path} cannot be used here: {exc.strerror}"
            ) from None
        found = self._known.get(key)
        if found is None:
            found = self._known[key] = self._probe(path, env)
        if isinstance(found, str):
            raise InterpreterError(found)
        _check_backend(found, backend)
        return found

    def _probe(self, path: str, env: Mapping[str, str]) -> Interpreter | str:
        try:
            done = subprocess.run(
                [path, "-c", PROBE],
                env=dict(env),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"environment.python {path} cannot be run here: {exc}"
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return (
                f"environment.python {path} cannot run Evenflow's ranks: {said} (it needs "
                "torch and Evenflow installed in that environment)"
            )
        try:
            info = json.loads(done.stdout.strip().splitlines()[-1])
            return Interpreter(path=path, **info)
        except (ValueError, IndexError, TypeError):
            return f"environment.python {path} answered the check with {done.stdout[-200:]!r}"


def _check_backend(found: Interpreter, backend: str) -> None:
    if backend == "nccl" and not (found.cuda and found.nccl):
        raise InterpreterError(
            f"environment.python {found.path} has torch {found.torch}, which cannot run NCCL "
            "ranks on this GPU host (no CUDA or no NCCL in that build)"
        )
    if backend == "gloo" and not found.gloo:
        raise InterpreterError(
            f"environment.python {found.path} has torch {found.torch} without gloo: it cannot "
            "run CPU ranks"
        )
