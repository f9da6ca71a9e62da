"""The measuring floor: the worker's own HTTP server (tailserve.transport.server, on
uvloop) answering every request with one fixed reply, no model and no cache. What the load
generator measures against it, at a given rate on a given machine, is the least any server on
that stack can show there: the rest of a worker's figure is the worker's.

    python fixed_reply.py --port 8200
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine
from typing import Any

from tailserve.process.loops import run
from tailserve.transport.request import HttpRequest
from tailserve.transport.server import HttpServer, Reply

REPLY = (
    b'{"model_name":"fixed","model_version":"1","outputs":'
    b'[{"name":"y","datatype":"FP32","shape":[1,1],"data":[0.5]}]}'
)
JSON = [(b"content-type", b"application/json")]


class FixedReply:
    def answer_now(self, request: HttpRequest) -> Reply | None:
        if request.path.endswith("/health/ready"):
            return 200, JSON, b"{}"
        return 200, JSON, REPLY

    def answer(self, request: HttpRequest) -> Coroutine[Any, Any, Reply]:
        raise AssertionError("every request is answered at once")


async def serve(host: str, port: int) -> None:
    server = HttpServer(FixedReply(), max_body_bytes=64 * 1024 * 1024)
    await server.start(host, port)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
