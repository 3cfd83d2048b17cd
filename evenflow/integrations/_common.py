"""What the framework integrations share: the supported version ranges and the spec checks."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from packaging.version import Version

__all__ = ["SUPPORTED", "IntegrationError", "check_spec", "check_version"]

SUPPORTED = {
    "transformers": ("4.50", "6"),
    "accelerate": ("1.0", "2"),
}
"""``package: (lowest, first unsupported)``: pyproject's ``integrations`` extra."""


class IntegrationError(ValueError):
    """A framework setting (or version) that conflicts with Evenflow's plan, said at start with
    what Evenflow does instead."""


def check_version(package: str, installed: str | None = None) -> str:
    """Refuse a version of ``package`` outside the range the integration is tested with."""
    low, high = SUPPORTED[package]
    found = installed if installed is not None else metadata.version(package)
    if not Version(low) <= Version(found) < Version(high):
        raise IntegrationError(
            f"{package} {found} is outside the range Evenflow's integration supports "
            f"({package}>={low},<{high}, pyproject's 'integrations' extra): install a version "
            f"in that range, e.g. pip install '{package}>={low},<{high}'"
        )
    return found


def check_spec(ctx: Any, framework: str) -> None:
    """A framework that counts its own steps cannot follow a plan that takes a rank out of the
    all-reduce (``ctx.batches()`` would skip iterations on that rank): the job must say
    ``policy: {exclude: false}`` so a straggler is re-planned a smaller share instead."""
    if ctx.spec.policy.exclude:
        raise IntegrationError(
            f"{framework} counts its own steps, so it cannot run while the plan excludes a rank "
            "(that rank would skip iterations): add `policy: {exclude: false}` to the job spec; "
            "Evenflow then gives a slow rank a smaller share (down to 0 samples) instead of "
            "excluding it"
        )
