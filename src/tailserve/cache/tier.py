"""The shared tier's contract: what the result cache (tiered.py), the data plane's stats and a
precompute job ask of L2. `redis.RedisTier` is the real one; `inprocess.InProcessTier` is its
in-memory twin, so the cache's policies are tested without Redis and the same suites run
against both.

What every implementation guarantees:

- nothing raises to a request: a fault, a blown time budget or an open breaker makes a lookup
  a miss and a write a no-op, counted in ``skips`` by (operation, reason): ``breaker``,
  ``budget``, ``error``;
- `put` never waits: writes go out in the background, within a few milliseconds, each with its
  TTL (milliseconds, not rounded to seconds); `forget_writes` drops those not yet sent;
- a lease goes to the first caller until it runs out or its holder gives it back;
- `drop_prefix` deletes exactly the keys under a prefix (glob characters are literal in it);
- the administrative calls (`put_now`, `drop_prefix`, `publish`) raise on failure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from tailserve.cache.breaker import Breaker


class CacheTier(Protocol):
    breaker: Breaker
    budget_s: float
    skips: Counter[tuple[str, str]]

    @property
    def skipped(self) -> int:
        """Lookups answered as misses without the tier's answer (whatever the reason)."""
        ...

    async def connect(self) -> bool: ...

    async def get(self, key: str) -> bytes | None: ...

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def put_now(self, items: Sequence[tuple[str, bytes, float]]) -> None: ...

    def forget_writes(self, prefix: str) -> int: ...

    async def flush(self) -> None:
        """Send the writes still waiting now, and wait for all the tier does in the
        background (writes, leases given back)."""
        ...

    async def lease(self, key: str, owner: str, ttl_s: float) -> bool | None: ...

    def release_lease(self, key: str, owner: str) -> None: ...

    async def drop_prefix(self, prefix: str) -> int: ...

    async def publish(self, channel: str, message: bytes) -> None: ...

    async def close(self) -> None: ...
