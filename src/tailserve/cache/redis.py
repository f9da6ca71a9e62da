"""L2: the shared result cache in Redis (or Redis Cluster), behind a time budget and a breaker.

Lookups made in the same turn of the event loop go to Redis together: one MGET (on a cluster,
one per slot; a model's keys share a slot through their hash tag). Writes are gathered over a
few milliseconds into one pipeline of ``SET key value PX ttl``. Each lookup waits at most
``budget_s`` (plus the event loop's current lag); a
slow Redis is skipped (the lookup counts as a miss and a failure), not waited on, and after
repeated failures the breaker stops asking until a probe succeeds. Nothing here raises to
the caller: the shared tier is an optimisation, so its faults degrade to misses.

On a cluster, the probe after a failed call reads the slot map afresh first: a master that
died may have been replaced by its replica (``_probe_cluster``).

What the tier did without is counted by operation (lookup, write) and reason: ``breaker``
(open: Redis was not asked), ``budget`` (a lookup with no answer in time) and ``error``
(Redis or the connection failed); ``on_skip`` hears each (the worker's
``tailserve_cache_l2_skipped_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.resp import LeanRedis
from tailserve.cache.write_behind import Write, WriteBehind
from tailserve.errors import ConfigError

log = logging.getLogger(__name__)

INVALIDATION_CHANNEL = "tailserve:invalidate"
_SCHEMES = ("redis", "rediss", "unix")
# Delete a lease only if it is still the caller's (it may have run out and been taken since).
_RELEASE = """
if redis.call("GET", KEYS[1]) == ARGV[1] then return redis.call("DEL", KEYS[1]) end
return 0
"""


def parse_url(url: str, *, cluster: bool = False) -> tuple[str, bool]:
    """The URL redis-py takes for ``url``, and whether it names a node of a Redis Cluster.

    ``redis+cluster://host:port[/0]`` (``rediss+cluster://`` with TLS) is ``redis://`` with
    ``cluster`` (``--redis-cluster``); ``redis://``, ``rediss://`` and ``unix://`` are taken as
    they are. Anything else is a ``ConfigError`` naming what is taken."""
    given = url
    scheme, sep, rest = url.partition("://")
    base, plus, kind = scheme.lower().partition("+")
    if not sep or base not in _SCHEMES or (plus and (kind != "cluster" or base == "unix")):
        raise ConfigError(
            f"Redis URL {redacted(given)!r}: the scheme must be redis://, rediss://, unix:// or, "
            "for a node of a Redis Cluster, redis+cluster:// (rediss+cluster://)"
        )
    if plus:
        url, cluster = f"{base}://{rest}", True
    if cluster:
        if base == "unix":
            raise ConfigError("a Redis Cluster is reached over TCP: redis+cluster://host:port")
        if urlsplit(url).path.strip("/") not in ("", "0"):
            raise ConfigError(f"Redis URL {redacted(given)!r}: a Redis Cluster has database 0 only")
    return url, cluster


def secured_url(
    url: str,
    *,
    password: str | None = None,
    password_file: str | None = None,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> str:
    """``url`` with a password given apart from it (``password``, else the first line of
    ``password_file``; either wins over one in the URL) and the TLS files of a ``rediss://``
    URL, as the query options redis-py reads (``ssl_ca_certs``, ``ssl_certfile``,
    ``ssl_keyfile``). The password stays out of command lines and logs this way: it is given
    by a file or the environment, and `redacted` hides it wherever the URL is shown."""
    if password_file and not password:
        try:
            password = Path(password_file).read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, IndexError, UnicodeDecodeError) as exc:
            reason = "it is empty" if isinstance(exc, IndexError) else str(exc)
            raise ConfigError(
                f"cannot read the Redis password file {password_file}: {reason}"
            ) from None
    parts = urlsplit(url)
    given = {"ssl_ca_certs": ca_file, "ssl_certfile": cert_file, "ssl_keyfile": key_file}
    tls = {name: value for name, value in given.items() if value is not None and value}
    if tls and parts.scheme != "rediss":
        raise ConfigError(
            f"Redis URL {redacted(url)!r}: TLS files are for a rediss:// URL (Redis over TLS)"
        )
    for value in tls.values():
        if not Path(value).is_file():
            raise ConfigError(f"Redis TLS file {value} not found")
    if password:
        host = parts.netloc.rpartition("@")[2]
        user = parts.username or ""
        parts = parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}")
    if tls:
        query = [*parse_qsl(parts.query), *tls.items()]
        parts = parts._replace(query=urlencode(query))
    return parts.geturl()


def without_password(url: str) -> tuple[str, str | None]:
    """``url`` with its password taken out, and the password (None: it had none), so that a
    process started with the URL gets the password through its environment instead."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username}@{host}" if parts.username else host
    return parts._replace(netloc=netloc).geturl(), unquote(parts.password)


def node_url(url: str, host: str, port: int) -> str:
    """``url`` (credentials, options) aimed at another node, ``host:port``."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return parts._replace(netloc=f"{userinfo}@{netloc}" if userinfo else netloc).geturl()


async def refresh_slots(client: Any) -> None:
    """Have a redis-py cluster client read the slot map afresh, keeping its connections to
    the nodes that stay. It reads it again by itself only at the next single command after
    one failed, which may be another slot's command, before a failover is over; and never
    after a failed pipeline (the MGET by slot, the SET pipeline) when it may not retry."""
    await client.nodes_manager.initialize()


async def on_slot_owner(client: Any, key: bytes, *command: Any) -> Any:
    """``command``, whose keys all share ``key``'s slot, sent by a redis-py cluster client
    straight to the master its slot map names for that slot.

    The client's own ``execute_command`` would, after any connection failure, have its next
    command of *every* slot read the slot map and the command table afresh first, one at a
    time under a lock: a dead master would slow the reads of the live ones by as much, again
    at each of its failures until its replica took over. Here a failure leaves the client as
    it was (the breaker's probe reads the slot map, ``refresh_slots``). A slot the map lacks,
    or a redirection (the slot moved), goes by the client's own path, which follows it."""
    from redis.exceptions import (
        AskError,
        ClusterDownError,
        MovedError,
        SlotNotCoveredError,
        TryAgainError,
    )

    try:
        node = client.get_node_from_key(key)
        return await node.execute_command(*command)
    except (SlotNotCoveredError, MovedError, AskError, TryAgainError, ClusterDownError):
        return await client.execute_command(*command)


def redacted(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{parts.username or ''}:***@{host}").geturl()


def connect(url: str, *, cluster: bool = False, timeout_s: float = 0.25, **extra: Any) -> Any:
    """A redis-py asyncio client (hiredis parses replies when installed) that fails fast:
    no retries of its own (the breaker decides), short connect and socket timeouts. ``url``
    as ``parse_url`` takes it (``redis+cluster://`` names a node of a cluster)."""
    from redis.asyncio import Redis, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    options: dict[str, Any] = {
        "socket_connect_timeout": timeout_s,
        "socket_timeout": max(timeout_s, 1.0),
        "retry": Retry(NoBackoff(), 0),
        **extra,
    }
    url, cluster = parse_url(url, cluster=cluster)
    if cluster:
        return RedisCluster.from_url(url, **options)
    return Redis.from_url(url, **options)


class RedisTier(WriteBehind):
    def __init__(
        self,
        client: Any,
        *,
        budget_s: float = 0.005,
        breaker: Breaker | None = None,
        cluster: bool = False,
        on_latency: Callable[[float], None] | None = None,
        on_breaker: Callable[[BreakerState], None] | None = None,
        on_skip: Callable[[str, str, int], None] | None = None,
        loop_lag: Callable[[], float] | None = None,
        write_window_s: float = 0.005,
        fast: LeanRedis | None = None,
    ) -> None:
        super().__init__(
            breaker or Breaker(clock=time.monotonic, on_change=on_breaker),
            write_window_s=write_window_s,
            on_skip=on_skip,
        )
        self.client = client
        # The hot path's MGET and SET pipeline go through this lean connection when given
        # (a single Redis; a cluster's slot routing stays with redis-py).
        self.fast = None if cluster else fast
        self.budget_s = budget_s
        # The event loop's own lag is added to the budget: a busy worker must not blame Redis
        # for the time its reply waited to be read.
        self._lag = loop_lag or (lambda: 0.0)
        self.cluster = cluster
        # A cluster call failed: the slot map may name a node that is gone (_probe_cluster).
        self._stale_slots = False
        self._on_latency = on_latency
        self._pending: list[tuple[str, asyncio.Future[bytes | None]]] = []

    async def connect(self) -> bool:
        """Open a connection ahead of the first lookup (whose budget a connection set-up would
        blow); False when Redis does not answer (the breaker copes later)."""
        try:
            async with asyncio.timeout(1.0):
                await self.client.ping()
                if self.fast is not None:
                    await self.fast.open()
        except Exception as exc:
            log.warning("redis does not answer yet (%s); serving without L2 until it does", exc)
            return False
        return True

    # --- lookups ----------------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        """The value under ``key``, or None (absent, Redis slow or down)."""
        if not self.breaker.allow():
            self._skip("lookup", "breaker")
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes | None] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush_lookups)
        self._pending.append((key, future))
        return await future

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    def _flush_lookups(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        if self._stale_slots and self.breaker.state is BreakerState.HALF_OPEN:
            self._probe_cluster(batch)
        else:
            self._send(batch)

    def _send(self, batch: list[tuple[str, asyncio.Future[bytes | None]]]) -> None:
        # One timer a batch, not one a lookup: what has no answer when it fires is a miss.
        loop = asyncio.get_running_loop()
        expired: list[bool] = [False]
        loop.call_later(self.budget_s + self._lag(), self._expire, batch, expired)
        self._own(self._mget(batch, expired))

    def _probe_cluster(self, batch: list[tuple[str, asyncio.Future[bytes | None]]]) -> None:
        """The probe after a cluster call failed: its lookups are misses at once, and in the
        background the client reads the slot map afresh (after a master died, its replica may
        hold the slots now) and asks for their keys, with no budget (reconnecting alone may
        take more), for the breaker's verdict."""
        self._stale_slots = False
        for _, future in batch:
            if not future.done():
                self._skip("lookup", "breaker")
                future.set_result(None)

        async def probe() -> None:
            try:
                async with asyncio.timeout(1.0):
                    await refresh_slots(self.client)
                    await self.client.mget_nonatomic([key for key, _ in batch])
            except Exception as exc:
                self._failed("MGET", exc)
            else:
                self.breaker.success()

        self._own(probe())

    def _expire(
        self, batch: list[tuple[str, asyncio.Future[bytes | None]]], expired: list[bool]
    ) -> None:
        for _, future in batch:
            if not future.done():
                self._skip("lookup", "budget")
                future.set_result(None)
                expired[0] = True
        if expired[0]:
            # A failure now, not when the answer or the socket timeout (a second) comes: a
            # paused or unreachable Redis opens the breaker after `failures` budgets, and the
            # lookups after those skip it at once instead of each waiting out its budget.
            self.breaker.failure()

    async def _mget(
        self, batch: list[tuple[str, asyncio.Future[bytes | None]]], expired: list[bool]
    ) -> None:
        keys = [key for key, _ in batch]
        started = time.perf_counter()
        try:
            if self.fast is not None:
                values = await self.fast.mget(keys)
            elif self.cluster:
                values = await self.client.mget_nonatomic(keys)
            else:
                values = await self.client.mget(keys)
        except Exception as exc:  # any Redis or socket fault is a miss and a failure
            if not expired[0]:  # (counted when the budget ran out)
                self._failed("MGET", exc)
            self._skip("lookup", "error", sum(not future.done() for _, future in batch))
            values = [None] * len(keys)
        else:
            elapsed = time.perf_counter() - started
            if self._on_latency is not None:
                self._on_latency(elapsed)
            # An answer past the budget still counts against Redis: it was too slow to use
            # (once: when the budget ran out, if a lookup was still waiting for it then).
            if elapsed > self.budget_s + self._lag():
                if not expired[0]:
                    self.breaker.failure()
            else:
                self.breaker.success()
        for (_, future), value in zip(batch, values, strict=True):
            if not future.done():
                future.set_result(value)

    # --- writes (the rest: write_behind.py) -------------------------------------------------

    async def _set_many(self, batch: Sequence[Write]) -> None:
        """SET ... PX of each (key, value, milliseconds), in one pipeline."""
        if self.fast is not None:
            await self.fast.set_many(batch)
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for key, value, ttl_ms in batch:
                pipe.set(key, value, px=ttl_ms)
            await pipe.execute()

    # --- leases (cross-worker coalescing) ---------------------------------------------------

    async def lease(self, key: str, owner: str, ttl_s: float) -> bool | None:
        """Take the short lease on computing ``key``: True if ours, False if another worker
        holds it, None when Redis cannot say (then compute without one)."""
        if not self.breaker.allow():
            return None
        try:
            async with asyncio.timeout(self.budget_s):
                taken = await self.client.set(
                    key + ":lease", owner, nx=True, px=max(1, int(ttl_s * 1000))
                )
        except Exception as exc:
            self._failed("SET NX", exc)
            return None
        self.breaker.success()
        return bool(taken)

    def release_lease(self, key: str, owner: str) -> None:
        """Give the lease on ``key`` back, if ``owner`` still holds it (in the background;
        at worst it runs out on its own)."""

        async def release() -> None:
            try:
                async with asyncio.timeout(max(self.budget_s, 0.05)):
                    await self.client.eval(_RELEASE, 1, key + ":lease", owner)
            except Exception as exc:
                log.debug("releasing the lease on %s failed: %s", key, exc)

        self._own(release())

    # --- invalidation -----------------------------------------------------------------------

    async def drop_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (SCAN + UNLINK); raises if Redis fails."""
        dropped = 0
        batch: list[Any] = []
        async for key in self.client.scan_iter(match=_glob_escape(prefix) + "*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                dropped += await self._unlink(batch)
                batch = []
        if batch:
            dropped += await self._unlink(batch)
        return dropped

    async def _unlink(self, keys: list[Any]) -> int:
        if self.cluster:
            # A command's keys must share a slot. One model's keys do (their hash tag), so a
            # model's invalidation is one UNLINK per batch; a prefix above the model may span
            # slots: one UNLINK per slot it meets.
            from redis.crc import key_slot

            by_slot: dict[int, list[Any]] = {}
            for key in keys:
                raw = key if isinstance(key, bytes) else str(key).encode()
                by_slot.setdefault(key_slot(raw), []).append(key)
            return sum([int(await self.client.unlink(*group)) for group in by_slot.values()])
        return int(await self.client.unlink(*keys))

    async def publish(self, channel: str, message: bytes) -> None:
        await self.client.publish(channel, message)

    # --- housekeeping -----------------------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        if self.breaker.state is BreakerState.CLOSED:
            log.warning("redis %s failed: %s: %s", what, type(exc).__name__, exc)
        self._stale_slots = self.cluster  # (the next probe reads the slot map afresh)
        self.breaker.failure()

    async def close(self) -> None:
        await self._cancel_tasks()
        with contextlib.suppress(Exception):
            await self.client.aclose()
        if self.fast is not None:
            await self.fast.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
