"""The bytes of a job's artifacts: a rank uploads a copy of a file on its host's disk, people
download the copies the server holds."""

from __future__ import annotations

import hashlib
import re
import tempfile

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from contract.api import ArtifactOut
from server.api.bodies import JSONRoute
from server.api.deps import (
    Authenticated,
    Context,
    JobReader,
    Now,
    PathId,
    SessionDep,
    SettingsDep,
)
from server.api.statuses import declare
from server.services import artifacts, blobs

router = APIRouter(prefix="/jobs", tags=["artifacts"], route_class=JSONRoute)

CONTENT_PATH = re.compile(r"^/api/v1/jobs/\d+/artifacts/\d+/content$")
"""An artifact's upload: the gate gives it the artifact size limit."""

SPOOL_BYTES = 1 << 20
ARTIFACT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.put("/{job_id}/artifacts/{artifact_id}/content", openapi_extra=ARTIFACT_BODY)
async def upload_artifact(
    request: Request,
    context: Context,
    settings: SettingsDep,
    principal: Authenticated,
    now: Now,
    job_id: PathId,
    artifact_id: PathId,
) -> ArtifactOut:
    """Upload a copy of a reported artifact's bytes (the rank's own credential): the server
    keeps at most ``EVENFLOW_ARTIFACT_MAX_BYTES`` per job (413 past it)."""
    declared = int(request.headers.get("content-length") or 0)
    limit = settings.artifact_max_bytes
    await run_in_threadpool(_check, context, job_id, artifact_id, principal, declared, limit)
    digest, size = hashlib.sha256(), 0
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
        async for piece in request.stream():
            digest.update(piece)
            size += len(piece)
            await run_in_threadpool(spool.write, piece)
        await run_in_threadpool(_check, context, job_id, artifact_id, principal, size, limit)
        return await run_in_threadpool(
            artifacts.store,
            context,
            job_id,
            artifact_id,
            spool,
            digest.hexdigest(),
            size,
            principal,
            now,
        )


@router.get(
    "/{job_id}/artifacts/{artifact_id}/content",
    response_class=StreamingResponse,
    responses={
        **declare(404),
        **{
            200: {
                "description": "The artifact's bytes.",
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    },
)
def download_artifact(
    session: SessionDep, context: Context, _: JobReader, job_id: PathId, artifact_id: PathId
) -> StreamingResponse:
    """The bytes of an artifact the server holds a copy of, streamed."""
    blob, filename = artifacts.stored_blob(session, job_id, artifact_id)
    return StreamingResponse(
        blobs.read(context, blob),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )


def _check(
    context: Context, job_id: int, artifact_id: int, principal: Authenticated, size: int, limit: int
) -> None:
    with context.transaction(write=False) as session:
        artifacts.check_may_store(session, job_id, artifact_id, principal, size, limit)
