"""The jobs routes over HTTP: submit (202 and a `Location`), read, cancel and list.

The work is the jobs desk's (`tailserve.jobs.desk.JobDesk`): this module only reads the path,
the query and the headers, and writes the documents the desk returns.
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Protocol

import orjson

from tailserve.errors import InvalidInput, shown
from tailserve.protocols.http.headers import Headers, Reply
from tailserve.transport.request import HttpRequest

_JSON: Headers = [(b"content-type", b"application/json")]
WEBHOOK_HEADER = b"x-webhook-url"


class JobsApi(Protocol):
    async def submit(
        self,
        *,
        model: str,
        version: str | None,
        kind: str,
        body: bytes,
        header_length: int | None = None,
        webhook: str | None = None,
    ) -> dict[str, Any]: ...

    async def get(self, job_id: str) -> dict[str, Any]: ...

    async def cancel(self, job_id: str) -> dict[str, Any]: ...

    async def listing(
        self, *, model: str | None, status: str | None, limit: str | None
    ) -> dict[str, Any]: ...


async def submit(
    jobs: JobsApi, request: HttpRequest, kind: str, header_length: int | None
) -> Reply:
    p = request.params
    webhook = request.header(WEBHOOK_HEADER)
    document = await jobs.submit(
        model=p["model"],
        version=p.get("version"),
        kind=kind,
        body=request.decoded_body(),
        header_length=header_length,
        webhook=webhook.decode("latin-1") if webhook is not None else None,
    )
    location = f"/v2/jobs/{document['id']}".encode()
    return 202, [*_JSON, (b"location", location)], orjson.dumps(document)


async def get(jobs: JobsApi, request: HttpRequest) -> Reply:
    return 200, _JSON, orjson.dumps(await jobs.get(request.params["job"]))


async def cancel(jobs: JobsApi, request: HttpRequest) -> Reply:
    return 200, _JSON, orjson.dumps(await jobs.cancel(request.params["job"]))


async def listing(jobs: JobsApi, request: HttpRequest) -> Reply:
    query = _query(request)
    unknown = sorted(set(query) - {"model", "status", "limit"})
    if unknown:
        raise InvalidInput(
            f"unknown query parameter {shown(unknown[0])} (known: model, status, limit)"
        )
    document = await jobs.listing(
        model=query.get("model"), status=query.get("status"), limit=query.get("limit")
    )
    return 200, _JSON, orjson.dumps(document)


def _query(request: HttpRequest) -> dict[str, str]:
    _, _, raw = request.target.partition(b"?")
    try:
        pairs = urllib.parse.parse_qsl(
            raw.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(raw)
        )
    except (UnicodeDecodeError, ValueError):
        raise InvalidInput(
            f"the query string {shown(raw)} cannot be read: it must be UTF-8, "
            "name=value pairs joined by '&'"
        ) from None
    return dict(pairs)
