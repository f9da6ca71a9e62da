"""Starting a gRPC server beside an HTTP one (the worker's service, the router's front), or
saying why not: grpcio is an extra, and a taken port must not cost the HTTP side.

Imports nothing of grpcio itself, so the caller imports it whether or not it is installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


async def serve_or_log(
    build: Callable[[], Any], host: str, port: int, *, max_message_bytes: int, what: str
) -> Any:
    """The started server (a ``grpc.aio.Server``) of the handler ``build`` makes (it imports
    what it needs), on ``host:port``; None when ``port`` is 0, or, logged, when grpcio is not
    installed or the port cannot be had."""
    if not port:
        return None
    try:
        from tailserve.protocols.grpc.common import start

        handler = build()
    except ImportError as exc:
        log.error("%s: no gRPC on port %d: %s (pip install 'tailserve[grpc]')", what, port, exc)
        return None
    try:
        return await start(handler, host, port, max_message_bytes=max_message_bytes)
    except (OSError, RuntimeError) as exc:
        log.error("%s: no gRPC on %s:%d: %s; serving HTTP only", what, host, port, exc)
        return None
