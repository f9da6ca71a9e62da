"""Who may call a worker's admin routes (repository index, model load and unload, cache
invalidation): the decision, made once at start-up from the listening address and the token.

On loopback only the machine's own users reach the port, so with no token the admin routes
stay open, as a local tool expects. Beyond loopback anyone on the network could unload the
models or empty the caches: there the routes need a token, and with none set they are closed.
"""

from __future__ import annotations

import ipaddress
from enum import StrEnum


class AdminAccess(StrEnum):
    OPEN = "open"  # loopback and no token: anyone who reaches the port
    TOKEN = "token"  # a token is set: the bearer token is checked
    CLOSED = "closed"  # beyond loopback with no token: refused


CLOSED_MESSAGE = (
    "the admin routes need a token when the worker listens beyond loopback: start it with "
    "--admin-token TOKEN (or TAILSERVE_ADMIN_TOKEN) and send 'Authorization: Bearer TOKEN'"
)


def admin_access(host: str, token: str | None) -> AdminAccess:
    if token:
        return AdminAccess.TOKEN
    return AdminAccess.OPEN if is_loopback(host) else AdminAccess.CLOSED


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address. ``localhost`` is; any other name is taken as
    beyond loopback (it could resolve anywhere), and so are "" and the wildcards."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
