"""Process entry of one training worker: ``python -m agent.runtime.worker``.

The agent daemon launches one process per rank with this environment:

==========================  =================================================================
``EVENFLOW_SERVER``         control plane base URL, e.g. ``http://cp:8000``
``EVENFLOW_TOKEN``          this rank's credential (its plan, its telemetry; see below)
``EVENFLOW_JOB_ID``         the job's integer id
``EVENFLOW_SPEC``           the job's :class:`~contract.spec.JobSpec` as JSON
``RANK``, ``WORLD_SIZE``    this process's rank and the job's world size
``MASTER_ADDR``,            rank 0's address and rendezvous port; port ``0``: rank 0 binds a
``MASTER_PORT``             free port and publishes it through the control plane, the other
                            ranks look it up there (:mod:`agent.runtime.rendezvous`)
``EVENFLOW_BACKEND``        optional; ``gloo`` (default) or ``nccl``: the assigned backend
``EVENFLOW_DEVICE``         optional; ``cpu`` (default under gloo) or ``cuda:0`` (the one GPU
                            ``CUDA_VISIBLE_DEVICES`` leaves this rank): the assigned device
``EVENFLOW_RESULT``         optional; path where the :class:`RunResult` is written as JSON
``EVENFLOW_PLAN_POLL_S``    optional; seconds between plan polls on rank 0 (default 1)
``EVENFLOW_PLAN_WAIT_S``    optional; longest seconds a plan long-poll is held, within 0..30
                            (default 10; a new plan answers it at once)
``EVENFLOW_TELEMETRY_S``    optional; longest seconds between telemetry posts (default 2)
``EVENFLOW_LOG_LEVEL``      optional; default ``INFO``
``EVENFLOW_ERROR_FILE``     optional; where the traceback of a failure is written, so the
                            agent reports the root cause rather than a log tail
``EVENFLOW_AGENT_PID``      optional; the launching agent's pid: the worker exits (status 4)
                            within 10 s of that agent's death (``agent.runtime.parent``)
``EVENFLOW_JOB_DIR``        optional; the agent's directory for this job: checkpoints go to
                            its ``checkpoints/`` when the spec's ``checkpoint`` has no path
==========================  =================================================================

Exit status 0 after a completed run, 1 on any failure (the traceback is logged to stderr), 2
when the environment is incomplete or malformed, 3 (``WORKER_EXIT_JOB_ENDED``) when the control
plane said the job had ended (its telemetry answered 409): one log line, no traceback; 4
(``WORKER_EXIT_FATAL``) when the job cannot run as specified (``agent.runtime.errors``: its
entrypoint cannot be imported, its checkpoint directory cannot be written, its stream ran out,
its replicas diverged), which the control plane does not retry; 5 when its agent died.

``EVENFLOW_TOKEN`` is the rank's own credential, minted for this job and rank: it reads the
job's plan and posts this rank's telemetry and metrics, nothing else, and dies with the job.

``EVENFLOW_TELEMETRY_RELAY`` (optional) is the launching agent's telemetry relay
(``agent.relay``), e.g. ``http://127.0.0.1:PORT``: telemetry and metrics are posted there,
with the same credential; the agent keeps them on its disk and posts its host's ranks in one
batch per job. Without it they go to ``EVENFLOW_SERVER`` like everything else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import traceback

import httpx
from pydantic import ValidationError

from agent.runtime import outputs
from agent.runtime.errors import FatalJobError
from agent.runtime.parent import die_with_agent
from agent.runtime.remote import RemoteControlPlane
from agent.runtime.rendezvous import DeviceAssignment, Rendezvous
from agent.runtime.telemetry import TelemetryClosed
from agent.runtime.trainer import RunResult, RuntimeOptions, run_training
from contract.agent import WORKER_EXIT_FATAL, WORKER_EXIT_JOB_ENDED
from contract.base import MAX_PLAN_WAIT_S
from contract.spec import JobSpec

log = logging.getLogger("evenflow.runtime.worker")

REQUIRED = (
    "EVENFLOW_SERVER",
    "EVENFLOW_TOKEN",
    "EVENFLOW_JOB_ID",
    "EVENFLOW_SPEC",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def result_json(result: RunResult) -> str:
    """A run result as one JSON object."""
    return json.dumps(dataclasses.asdict(result))


def worker_main(environ: dict[str, str] | None = None) -> int:
    """Run one rank from environment variables; return the process exit status."""
    env = dict(os.environ if environ is None else environ)
    logging.basicConfig(
        level=env.get("EVENFLOW_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{env.get('RANK', '?')} %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll
    if env.get("EVENFLOW_AGENT_PID", "").isdigit():  # launched by an agent: die with it
        die_with_agent(int(env["EVENFLOW_AGENT_PID"]))
    missing = [k for k in REQUIRED if not env.get(k)]
    if missing:
        log.error("missing environment variables: %s", ", ".join(missing))
        return 2
    try:
        spec = JobSpec.model_validate_json(env["EVENFLOW_SPEC"])
        job_id = int(env["EVENFLOW_JOB_ID"])
        options = RuntimeOptions(
            plan_poll_s=float(env.get("EVENFLOW_PLAN_POLL_S", "1.0")),
            telemetry_flush_s=float(env.get("EVENFLOW_TELEMETRY_S", "2.0")),
            assignment=DeviceAssignment.from_env(env),
            checkpoint_dir=checkpoint_dir(spec, job_id, env.get("EVENFLOW_JOB_DIR")),
            output_dir=output_dir(spec, job_id, int(env["RANK"]), env.get("EVENFLOW_JOB_DIR")),
        )
        rdzv = Rendezvous.from_env(env, spec.rendezvous_timeout_s)
        # The plan fetch is a long-poll held up to this long (new plans arrive at once).
        plan_wait_s = float(env.get("EVENFLOW_PLAN_WAIT_S", "10.0"))
        if not 0 <= plan_wait_s <= MAX_PLAN_WAIT_S:
            raise ValueError(f"EVENFLOW_PLAN_WAIT_S must be within 0..{MAX_PLAN_WAIT_S}")
    except (ValidationError, ValueError) as exc:
        log.error("bad worker environment: %s", exc)
        return 2
    if spec.emulation is not None:
        log.info("EMULATED run: compute is padded to the speeds in the job spec")
    try:
        with httpx.Client(timeout=10.0) as client:
            remote = RemoteControlPlane(
                client,
                env["EVENFLOW_SERVER"],
                env["EVENFLOW_TOKEN"],
                job_id,
                plan_wait_s=plan_wait_s,
                telemetry_relay=env.get("EVENFLOW_TELEMETRY_RELAY") or None,
            )
            rdzv = dataclasses.replace(
                rdzv, publish_port=remote.publish_port, lookup_port=remote.lookup_port
            )
            rank = int(env["RANK"])
            result = run_training(
                spec,
                fetch_plan=remote.fetch_plan,
                post_telemetry=remote.post_telemetry,
                post_metrics=remote.post_metrics,
                options=options,
                rendezvous=rdzv,
                report_checkpoint=lambda saved: remote.report_checkpoint(rank, saved),
            )
            shared = spec.outputs.path is not None
            found = outputs.collect(result.output_dir, result.final_model, rank=rank, shared=shared)
            outputs.publish(found, rank, remote.report_artifact, remote.upload_artifact)
    except FatalJobError as exc:  # the same on every attempt: the job fails, no restart
        log.error("%s", exc)
        _write_error(env, traceback.format_exc())
        return WORKER_EXIT_FATAL
    except TelemetryClosed as exc:
        log.warning("job %d has ended on the control plane (%s); stopping", job_id, exc)
        return WORKER_EXIT_JOB_ENDED
    except Exception:
        log.exception("training failed")
        _write_error(env, traceback.format_exc())
        return 1
    text = result_json(result)
    log.info("finished: %s", text)
    if env.get("EVENFLOW_RESULT"):
        with open(env["EVENFLOW_RESULT"], "w") as f:
            f.write(text)
    return 0


def output_dir(spec: JobSpec, job_id: int, rank: int, job_dir: str | None) -> str | None:
    """Where this rank's ``ctx.output_dir`` is: ``<outputs.path>/job-<id>`` (shared by the
    ranks), else its own ``outputs/rank-<r>`` in the agent's job directory."""
    if spec.outputs.path is not None:
        return f"{spec.outputs.path.rstrip('/')}/job-{job_id}"
    return f"{job_dir.rstrip('/')}/outputs/rank-{rank}" if job_dir else None


def checkpoint_dir(spec: JobSpec, job_id: int, job_dir: str | None) -> str | None:
    """Where this job's checkpoints go: ``<checkpoint.path>/job-<id>`` (so jobs sharing a path
    never resume from each other's), else the agent's job directory's ``checkpoints``."""
    if spec.checkpoint is None:
        return None
    if spec.checkpoint.path is not None:
        return f"{spec.checkpoint.path.rstrip('/')}/job-{job_id}"
    return f"{job_dir.rstrip('/')}/checkpoints" if job_dir else None


def _write_error(env: dict[str, str], text: str) -> None:
    if env.get("EVENFLOW_ERROR_FILE"):
        with open(env["EVENFLOW_ERROR_FILE"], "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(worker_main())
