"""The agent's own address, checked before it registers.

Other hosts' ranks reach this host's rank 0 at the address the agent registers (``--address``,
default its name). One that does not resolve would leave every job whose rank 0 runs here
waiting at the rendezvous, so the agent refuses to start with it.
"""

from __future__ import annotations

import contextlib
import logging
import socket

log = logging.getLogger("evenflow.agent")


class AddressError(ValueError):
    """The agent's address cannot be used by other hosts to reach it."""


def check_address(address: str) -> list[str]:
    """The IP addresses ``address`` resolves to; raises :class:`AddressError` when it resolves
    to none. Logs a warning when none of them belongs to this host (it may be a NAT address)."""
    try:
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise AddressError(
            f"the agent's address {address!r} does not resolve ({exc}); other hosts' ranks "
            "could not reach this host: give --address a name or IP that resolves"
        ) from None
    ips = sorted({str(info[4][0]) for info in infos})
    if not any(_is_local(info[0], str(info[4][0])) for info in infos):
        log.warning("address %s (%s) is not an address of this host", address, ", ".join(ips))
    return ips


def _is_local(family: int, ip: str) -> bool:
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return True
    return False
