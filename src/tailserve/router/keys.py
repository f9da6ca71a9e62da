"""What the dispatcher reads from a request's body: its affinity key and its cost class.

The affinity key sends identical inputs (identical cache keys, as a rule) to the same replica,
where its cache holds the answer. The cost class keeps each size of request on its own hedge
delay, because a large request's latency says nothing about a small one's.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib

import orjson

# Cost classes by request body size: below 4 KiB small, below 64 KiB medium, else large.
_CLASS_EDGES = ((4096, "s"), (65536, "m"))


def cost_class(body_size: int) -> str:
    for edge, label in _CLASS_EDGES:
        if body_size < edge:
            return label
    return "l"


def body_key(body: bytes, header_length: int | None = None) -> str:
    """The affinity key of an inference request with no ``X-Affinity-Key``: its OIP
    ``parameters.affinity_key`` if it has one, else a hash of its inputs (JSON header and,
    with the binary extension, the raw data after it), so identical inputs (identical cache
    keys, as a rule) meet the same replica's cache whatever the request's ``id`` or options.
    A body that is not an OIP request is hashed whole."""
    header, data = body, b""
    if header_length is not None and 0 < header_length <= len(body):
        header, data = body[:header_length], body[header_length:]
    try:
        document = orjson.loads(header)
    except orjson.JSONDecodeError:
        document = None
    if not isinstance(document, dict) or "inputs" not in document:
        return hashlib.blake2b(body, digest_size=8).hexdigest()
    parameters = document.get("parameters")
    if isinstance(parameters, dict):
        given = parameters.get("affinity_key")
        if isinstance(given, str | int) and not isinstance(given, bool):
            return str(given)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(orjson.dumps(document["inputs"], option=orjson.OPT_SORT_KEYS))
    digest.update(data)
    return digest.hexdigest()
