"""Job code as an attacker would write it, for the agent's isolation test: it records the
environment it was given and tries to cancel another user's job with the token it holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

from agent.runtime.context import EvenflowContext
from agent.runtime.workloads import Workload
from tests.runtime.user_workload import make


def main(ctx: EvenflowContext) -> Workload:
    victim = int(ctx.args["victim"])
    token = os.environ.get("EVENFLOW_TOKEN", "")
    cancel = httpx.post(
        f"{os.environ['EVENFLOW_SERVER']}/api/v1/jobs/{victim}/cancel",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    out = Path(os.environ["EVENFLOW_RESULT"]).with_name(f"rank-{ctx.rank}.environ.json")
    out.write_text(json.dumps({"environ": dict(os.environ), "cancel": cancel.status_code}))
    return make(ctx)
