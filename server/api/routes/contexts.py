"""Code archives: operators upload them (a job names one in ``workload.context``), agents fetch
those of their jobs."""

from __future__ import annotations

import hashlib
import re
import tempfile
from typing import Annotated

from fastapi import APIRouter, Path, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from contract.api import ContextOut
from server.api.bodies import JSONRoute
from server.api.deps import Authenticated, Context, Now, Operator, SessionDep
from server.errors import Invalid
from server.services import archives, blobs, contexts

router = APIRouter(prefix="/contexts", tags=["contexts"], route_class=JSONRoute)

UPLOAD_PATH = "/contexts"
"""The upload's path under the API prefix: the gate gives it the context size limit."""

SPOOL_BYTES = 1 << 20
"""An upload is spooled to a temporary file past this many bytes, never held in memory."""

Sha256 = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="The archive's SHA-256.")]

EXPECTED = re.compile(r"^[0-9a-f]{64}$")


ARCHIVE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("", status_code=201, openapi_extra=ARCHIVE_BODY)
async def upload_context(
    request: Request, context: Context, principal: Operator, now: Now
) -> ContextOut:
    """Upload a job's code as one archive (``.tar.gz``, ``.tar`` or ``.zip``) in the body; it
    is stored once under the SHA-256 of its bytes, which a job's ``workload.context`` names.
    ``X-Evenflow-Sha256`` (optional) is the digest the client computed: a body that hashes to
    anything else is refused as corrupt, and so is one an agent could not safely unpack (an
    entry outside it, a link out, a device, a bomb). Past the server's limit (``EVENFLOW_CONTEXT_MAX_BYTES``,
    64 MiB by default) the answer is 413."""
    expected = request.headers.get("x-evenflow-sha256")
    if expected is not None and not EXPECTED.match(expected):
        raise Invalid("X-Evenflow-Sha256 must be 64 lowercase hex digits", field="sha256")
    digest = hashlib.sha256()
    size = 0
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
        async for piece in request.stream():  # the gate refuses it at the size limit (413)
            digest.update(piece)
            size += len(piece)
            await run_in_threadpool(spool.write, piece)
        if size == 0:
            raise Invalid("the body is empty: send the archive's bytes", field="body")
        sha256 = digest.hexdigest()
        if expected is not None and expected != sha256:
            raise Invalid(
                f"the archive is corrupt: its {size} bytes hash to {sha256}, not {expected}",
                field="sha256",
            )
        await run_in_threadpool(archives.check_archive, spool, size)
        return await run_in_threadpool(contexts.store, context, spool, sha256, size, principal, now)


@router.get("/{sha256}/info")
def context_info(session: SessionDep, principal: Authenticated, sha256: Sha256) -> ContextOut:
    """Whether an archive is stored, and its size (an operator, or an agent running a job of
    it)."""
    return contexts.info(session, sha256, principal)


@router.get(
    "/{sha256}",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The archive's bytes.",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
)
def download_context(
    session: SessionDep, context: Context, principal: Authenticated, sha256: Sha256
) -> StreamingResponse:
    """The archive's bytes, streamed a piece at a time (an operator, or an agent running a job
    of it)."""
    contexts.check_readable(session, sha256, principal)
    return StreamingResponse(
        blobs.read(context, sha256),
        media_type="application/octet-stream",
        headers={"X-Evenflow-Sha256": sha256},
    )
