"""A rank's outputs, handed to the control plane when it ends: its artifacts.

What a rank left in ``ctx.output_dir``, and the model ``ctx.save_final()`` wrote, are reported
(name, size, where) once the rank's training succeeded. On the default storage (the rank's own
directory on its host's disk) each file's bytes are uploaded too, so they can be downloaded
through the control plane when the host cannot be reached or is gone; the control plane keeps at
most ``EVENFLOW_ARTIFACT_MAX_BYTES`` a job, and past it a file stays listed where it is. On
shared storage (the spec's ``outputs.path``) rank 0 lists the job's files once and nothing is
uploaded: their readers reach them there. Best effort: a report or upload that fails is logged,
never fails the rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import fsspec

from contract.agent import ArtifactReport

log = logging.getLogger("evenflow.runtime.outputs")

FINAL_NAME = "final.pt"


@dataclass(frozen=True)
class Output:
    """One file to report: its name in the job's outputs, where it is, and its size."""

    name: str
    url: str
    size_bytes: int
    local: bool
    """On this host's disk (so its bytes are uploaded)."""


def collect(
    output_dir: str | None, final_model: str | None, *, rank: int, shared: bool
) -> list[Output]:
    """This rank's outputs: the files under ``output_dir`` (rank 0 alone when it is shared by
    the ranks) and the final model, wherever it was written."""
    found: list[Output] = []
    if output_dir is not None and (rank == 0 or not shared):
        fs, root = fsspec.core.url_to_fs(output_dir)
        root = root.rstrip("/")
        try:
            files = fs.find(root, detail=True)
        except FileNotFoundError:
            files = {}
        for path, info in sorted(files.items()):
            if info.get("type") != "file":
                continue
            name = path[len(root) :].lstrip("/")
            url = path if _is_local(fs) else fs.unstrip_protocol(path)
            found.append(
                Output(name, url, int(info.get("size") or 0), _is_local(fs) and not shared)
            )
    if final_model is not None and not any(o.url == final_model for o in found):
        fs, path = fsspec.core.url_to_fs(final_model)
        if fs.exists(path):
            local = _is_local(fs) and not shared
            found.append(Output(FINAL_NAME, final_model, int(fs.size(path)), local))
    return found


Report = Callable[[ArtifactReport], int]
"""Report one artifact; the id the control plane gave it."""
Upload = Callable[[int, str, int], None]
"""Upload the bytes of artifact ``id`` from a local path of ``size`` bytes."""


def publish(outputs: list[Output], rank: int, report: Report, upload: Upload) -> int:
    """Report every output and upload the local ones; how many were reported."""
    reported = 0
    for out in outputs:
        try:
            artifact_id = report(
                ArtifactReport(
                    rank=rank,
                    name=out.name,
                    size_bytes=out.size_bytes,
                    url=out.url,
                    shared=not out.local,
                )
            )
            reported += 1
            if out.local:
                upload(artifact_id, out.url, out.size_bytes)
        except Exception as exc:  # best effort: the rank's training succeeded
            log.warning("artifact %s not handed over: %s", out.name, exc)
    if outputs:
        log.info("rank %d: %d of %d artifacts reported", rank, reported, len(outputs))
    return reported


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local") and os.sep == "/"
