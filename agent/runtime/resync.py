"""Re-synchronising a readmitted rank: parameters, buffers, optimizer state and job records.

A rank that sat out some iterations holds stale parameters, stale module buffers (its probes even
moved BatchNorm statistics) and stale or missing optimizer state (momentum, Adam moments, step
counts). At its join, the root (an active rank that stayed active) broadcasts all of them to the
new group:

1. one object broadcast (pickled, on the CPU control group): the optimizer's ``state_dict`` with
   every tensor replaced by its shape and dtype (a *skeleton*), plus ``extra`` (small records such
   as the plan history, so every rank ends with the same);
2. the tensors themselves, coalesced into one flat buffer per (device, dtype): parameters and
   buffers of the model, then the optimizer state tensors in skeleton order. A usual model costs
   one broadcast per dtype; nothing is pickled but the skeleton.

Ranks that were active all along take part in the collectives (they are group members) but
change nothing. The cost is measured by the caller (``resync_ms`` in the run result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    cuda: bool


def resync(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    root: int,
    apply: bool,
    group: dist.ProcessGroup | None,
    control: dist.ProcessGroup | None,
    extra: Any = None,
) -> Any:
    """Make ``model`` and ``optimizer`` equal to ``root``'s; return ``root``'s ``extra``.

    Every member of ``group`` calls it. ``apply`` is false on ranks already in step (they join
    the collectives only). ``control`` carries CPU tensors and the skeleton (the job's gloo
    control group under NCCL; the same as ``group`` otherwise).
    """
    sending = rank == root
    header: list[Any] = [None]
    if sending:
        header[0] = (_skeleton(optimizer.state_dict()), extra)
    dist.broadcast_object_list(header, src=root, group=control)
    skeleton, extra = header[0]
    device = next(model.parameters()).device
    if sending:
        state = [t for _, _, t in _state_tensors(optimizer.state_dict())]
    else:
        state = [_empty(s, device) for _, _, s in _state_tensors(skeleton)]
    with torch.no_grad():
        module_tensors = [t.data for t in [*model.parameters(), *model.buffers()]]
        received = _broadcast_coalesced(
            module_tensors + state, root=root, sending=sending, group=group, control=control
        )
        if apply and not sending:
            for target, value in zip(module_tensors, received, strict=False):
                target.copy_(value)
            optimizer.load_state_dict(_fill(skeleton, received[len(module_tensors) :]))
    return extra


def _skeleton(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {
        "param_groups": state_dict["param_groups"],
        "state": {
            pid: {
                k: _Spec(tuple(v.shape), v.dtype, v.is_cuda) if isinstance(v, torch.Tensor) else v
                for k, v in entries.items()
            }
            for pid, entries in state_dict["state"].items()
        },
    }


def _state_tensors(state_dict: dict[str, Any]) -> list[tuple[Any, str, Any]]:
    """(param id, key, tensor or spec) of every tensor in the state, in a fixed order."""
    out = []
    for pid in sorted(state_dict["state"]):
        entries = state_dict["state"][pid]
        for k in sorted(entries):
            if isinstance(entries[k], torch.Tensor | _Spec):
                out.append((pid, k, entries[k]))
    return out


def _empty(spec: _Spec, device: torch.device) -> torch.Tensor:
    return torch.empty(spec.shape, dtype=spec.dtype, device=device if spec.cuda else "cpu")


def _fill(skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    state = {pid: dict(entries) for pid, entries in skeleton["state"].items()}
    for (pid, k, _), t in zip(_state_tensors(skeleton), tensors, strict=True):
        state[pid][k] = t
    return {"state": state, "param_groups": skeleton["param_groups"]}


def _broadcast_coalesced(
    tensors: list[torch.Tensor],
    *,
    root: int,
    sending: bool,
    group: dist.ProcessGroup | None,
    control: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """Broadcast ``tensors`` from ``root``, one flat buffer per (device, dtype); on receivers,
    return the received values in order (views of the flat buffers; the root gets its own)."""
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    out: list[torch.Tensor] = list(tensors)
    for (device, dtype), members in buckets.items():
        numels = [tensors[i].numel() for i in members]
        if sending:
            flat = torch.cat([tensors[i].reshape(-1) for i in members])
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        on = group if device.type == "cuda" else control
        dist.broadcast(flat, src=root, group=on)
        if not sending:
            for i, piece in zip(members, flat.split(numels), strict=True):
                out[i] = piece.view_as(tensors[i])
    return out
