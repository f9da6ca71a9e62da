"""Encoded replies of L1 hits, kept by the digest of the request that asked for them.

A hit still costs decoding the request, building its key and encoding the reply: for the
ranker's 500 candidates most of a hit's time. A client asking again with the same bytes (a
returning user, a retry, a hedge) can have the reply encoded the first time, once L1 confirms
that the entry it was made from is still the one it serves, fresh, under the version that
would serve the request now (protocols/http/replay.py). So the reply memo adds no freshness
rules of its own: an invalidation, an expiry, a stale entry or a new version sends the request
down the whole path again, and the memo's entry is dropped.

Bounded by bytes, oldest stored first out (an entry lives no longer than its L1 entry, which
has one TTL per model: the oldest has the least life left). Pure: no clock, no I/O.

An entry is kept as a plain tuple of numbers and bytes, which the garbage collector stops
tracking after its first young collection: a full collection then walks none of them. Kept as
`Replay` objects with a headers list, 10,000 entries were two thirds of what a hit-path
worker's full collection walked (26-34 ms under load, a bad second of the p99 each time).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

Headers = list[tuple[bytes, bytes]]

# What an entry costs beside its reply's bytes (the digest, the objects, the dict slot).
_OVERHEAD = 256


@dataclass(slots=True, frozen=True)
class Replay:
    """A reply, and the L1 entry it was encoded from."""

    view: int  # the serial of the `ModelView` (one served version) that answered
    key: str  # the result's cache key
    value: bytes  # the L1 entry's stored bytes, compared by identity
    status: int
    headers: Headers
    body: bytes

    @property
    def size(self) -> int:
        # The L1 entry's bytes count too: held here, they outlive its eviction from L1.
        headers = sum(len(n) + len(v) for n, v in self.headers)
        return len(self.body) + len(self.value) + headers + _OVERHEAD


def digest(*parts: bytes) -> bytes:
    """A request's identity: 128 bits of BLAKE2b over its parts, each length-prefixed (so no
    two different lists of parts run together the same)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


# What the memo holds of a `Replay`: (view, key, value, status, headers, body, size), headers a
# tuple of pairs.
_Kept = tuple[int, str, bytes, int, tuple[tuple[bytes, bytes], ...], bytes, int]


class ReplyMemo:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, _Kept] = OrderedDict()
        self.hits = 0
        self.stale = 0  # found, but L1 no longer holds what it was made from

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Replay | None:
        kept = self._entries.get(key)
        if kept is None:
            return None
        view, cache_key, value, status, headers, body, _ = kept
        return Replay(view, cache_key, value, status, list(headers), body)

    def put(self, key: bytes, replay: Replay) -> None:
        size = replay.size
        if size > self.max_bytes:
            return
        self.drop(key)
        self._entries[key] = (
            replay.view,
            replay.key,
            replay.value,
            replay.status,
            tuple(replay.headers),
            replay.body,
            size,
        )
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest[-1]

    def drop(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[-1]

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
