"""The measuring floor: an ASGI app on the worker's own stack (uvicorn, httptools, uvloop) that
reads each request's body and answers one fixed reply, no model and no cache. What the load
generator measures against it, at a given rate on a given machine, is the least any server on
that stack can show there: the rest of a worker's figure is the worker's.

    uvicorn fixed_reply:app --port 8200 --loop uvloop --http httptools
"""

from __future__ import annotations

from typing import Any

REPLY = (
    b'{"model_name":"fixed","model_version":"1","outputs":'
    b'[{"name":"y","datatype":"FP32","shape":[1,1],"data":[0.5]}]}'
)
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"].endswith("/health/ready"):
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS[:1]})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": REPLY})
