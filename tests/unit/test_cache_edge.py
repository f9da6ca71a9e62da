"""The edge tier's pure parts: keys, what is kept and for how long (a fake clock), invalidation
by the workers' prefixes; and the invalidation feed against an in-memory pub/sub."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest

from tailserve.cache.edge import EdgeCache, EdgeStore, Kept, edge_prefix, prefix_for
from tailserve.cache.invalidations import InvalidationFeed, parse_message
from tailserve.cache.keys import version_prefix
from tailserve.cache.redis import INVALIDATION_CHANNEL


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def reply(version: str = "1", cache: str | None = "miss", y: float = 1.0) -> Kept:
    parameters: dict[str, Any] = {"model_version": version}
    if cache is not None:
        parameters["cache"] = cache
    outputs = {"y": np.array([[y]], dtype=np.float32)}
    return Kept(outputs, "http://w1", parameters, {})


def inputs(value: float = 1.0) -> dict[str, Any]:
    return {"a": np.array([[value]], dtype=np.float32), "b": np.array([["text"]], dtype=object)}


def stored(store: EdgeStore, model: str = "m", value: float = 1.0, version: str = "1") -> str:
    """Answer one request of ``model`` as a worker of ``version`` would; the request's key."""
    digest = store.digest(model, inputs(value))
    assert digest is not None
    stamp = store.stamp(model)
    kept = reply(version, y=value)
    assert store.learn(model, kept.parameters, pinned=False)
    assert store.keep(model, digest, kept, stamp)
    key = store.key(model, None, digest)
    assert key is not None
    return key


def test_config_is_checked_and_names_become_a_frozenset() -> None:
    assert EdgeCache(models=["m", "m"]).models == frozenset({"m"})
    with pytest.raises(ValueError, match="collection"):
        EdgeCache(models="churn")
    with pytest.raises(ValueError, match="ttl_s"):
        EdgeCache(ttl_s=0)
    with pytest.raises(ValueError, match="policy"):
        EdgeCache(policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="room"):
        EdgeCache(max_entries=0)


def test_keys_follow_what_changes_the_answer() -> None:
    store = EdgeStore(EdgeCache())
    base = store.digest("m", inputs())
    reordered = store.digest("m", dict(reversed(list(inputs().items()))))
    assert base is not None and base == reordered
    assert store.digest("m", inputs(2.0)) != base
    assert store.digest("m", {**inputs(), "a": np.array([[1.0]], dtype=np.float64)}) != base
    assert store.digest("m", {**inputs(), "a": np.array([1.0], dtype=np.float32)}) != base
    # Parameters that never change an answer are left out; the others, and outputs, count.
    quiet = {"cache": "use", "timeout": 50, "priority": 1, "binary_data_output": True}
    assert store.digest("m", inputs(), parameters=quiet) == base
    assert store.digest("m", inputs(), parameters={"top_k": 5}) != base
    assert store.digest("m", inputs(), outputs=["y"]) != base
    # Text and bytes of the same characters agree, as at the worker; other objects are unkeyable.
    as_bytes = {**inputs(), "b": np.array([[b"text"]], dtype=object)}
    assert store.digest("m", as_bytes) == base
    assert store.digest("m", {"a": np.array([1, "x"], dtype=object)}) is None
    assert store.digest("m", inputs(), parameters={"odd": object()}) is None


def test_the_version_in_a_key_is_the_pinned_one_else_the_last_served() -> None:
    store = EdgeStore(EdgeCache())
    digest = "d" * 32
    assert store.key("m", None, digest) is None  # no reply seen: nothing can be kept
    assert store.key("m", 3, digest) == version_prefix("m", 3) + digest
    store.learn("m", {"model_version": "2"}, pinned=False)
    assert store.key("m", None, digest) == version_prefix("m", 2) + digest
    # A reply to a request that pinned an older version says nothing of what serves now.
    store.learn("m", {"model_version": "1"}, pinned=True)
    assert store.key("m", None, digest) == version_prefix("m", 2) + digest
    store.learn("m", {"model_version": "3"}, pinned=False)
    assert store.key("m", None, digest) == version_prefix("m", 3) + digest


def test_an_answer_is_kept_for_its_ttl_on_the_clock() -> None:
    clock = Clock()
    store = EdgeStore(EdgeCache(ttl_s=2.0, clock=clock))
    key = stored(store)
    clock.now = 1.999
    found = store.lookup(key)
    assert found is not None and found.outputs["y"].tolist() == [[1.0]]
    clock.now = 2.0
    assert store.lookup(key) is None
    assert (store.hits, store.misses, store.stores) == (1, 1, 1)
    assert store.lookup(None) is None and store.misses == 2


def test_what_is_not_kept() -> None:
    store = EdgeStore(EdgeCache(follow_workers=True))
    digest = store.digest("m", inputs())
    assert digest is not None
    stamp = store.stamp("m")
    # A model its workers do not cache (no ``cache`` in the reply) and nobody named.
    assert not store.learn("m", reply(cache=None).parameters, pinned=False)
    assert not store.keep("m", digest, reply(cache=None), stamp)
    assert store.learn("m", reply().parameters, pinned=False)
    # Stale at the worker, bypassed, or with no version: not kept.
    assert not store.keep("m", digest, reply(cache="stale"), stamp)
    assert not store.keep("m", digest, reply(cache="bypass"), stamp)
    assert not store.keep("m", digest, Kept({}, None, {"cache": "miss"}, {}), stamp)
    # Sent before an invalidation of its model passed: not kept; of another model: kept.
    store.invalidate(prefix_for("m"))
    assert not store.keep("m", digest, reply(), stamp)
    store.invalidate(prefix_for("other"))
    assert store.keep("m", digest, reply(), store.stamp("m"))


def test_named_models_are_kept_and_following_the_workers_can_be_turned_off() -> None:
    store = EdgeStore(EdgeCache(models={"named"}, follow_workers=False))
    assert store.caches("named") and not store.caches("m")
    assert store.learn("named", reply(cache=None).parameters, pinned=False)
    assert not store.learn("m", reply(cache="miss").parameters, pinned=False)


def test_invalidation_by_the_workers_prefixes() -> None:
    store = EdgeStore(EdgeCache())
    m1 = stored(store, "m", 1.0, version="1")
    m2 = stored(store, "m", 2.0, version="2")
    n1 = stored(store, "n", 1.0)
    # A prefix naming one worker key (whose digest differs from the edge's): its whole version.
    assert store.invalidate(version_prefix("m", 1) + "0123abcd") == 1
    assert store.lookup(m1) is None and store.lookup(m2) is not None
    assert store.invalidate(prefix_for("m")) == 1
    assert store.lookup(n1) is not None
    assert store.invalidate(prefix_for()) == 1
    assert len(store) == 0
    assert (store.invalidations, store.dropped) == (3, 3)


def test_edge_prefixes() -> None:
    assert edge_prefix("ts:{m}:v2:abc") == "ts:{m}:v2:"
    assert edge_prefix("ts:{m}:v2:") == "ts:{m}:v2:"
    assert edge_prefix("ts:{m}:v1") == "ts:{m}:v1"  # v1, v10 ...: as at the worker
    assert edge_prefix("ts:{m}:") == "ts:{m}:"
    assert edge_prefix("ts:") == "ts:"
    assert prefix_for("m", 2) == "ts:{m}:v2:"
    with pytest.raises(ValueError):
        prefix_for(None, 2)


def test_clear_drops_everything_and_what_is_in_flight() -> None:
    store = EdgeStore(EdgeCache())
    stored(store)
    digest = store.digest("m", inputs(5.0))
    assert digest is not None
    stamp = store.stamp("m")
    assert store.clear() == 1 and len(store) == 0 and store.resets == 1
    assert not store.keep("m", digest, reply(), stamp)


def test_messages() -> None:
    assert parse_message(orjson.dumps({"prefix": "ts:{m}:", "origin": "a"})) == "ts:{m}:"
    assert parse_message(b"not json") is None
    assert parse_message(orjson.dumps({"origin": "a"})) is None
    assert parse_message(orjson.dumps({"prefix": 3})) is None


# --- the feed, against an in-memory pub/sub ------------------------------------------------------


class FakePubSub:
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def __aenter__(self) -> FakePubSub:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pass

    async def subscribe(self, channel: str) -> None:
        assert channel == INVALIDATION_CHANNEL
        if self.hub.refuse:
            raise ConnectionError("redis is down")
        self.hub.subscriptions += 1

    async def get_message(self, **options: Any) -> Any:
        try:  # redis-py's: None when nothing came within the timeout
            item = await asyncio.wait_for(self.hub.queue.get(), options["timeout"])
        except TimeoutError:
            return None
        if isinstance(item, Exception):
            raise item
        return {"type": "message", "data": item}


class Hub:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.subscriptions = 0
        self.refuse = False
        self.closed = 0

    def client(self) -> Any:
        hub = self

        class Client:
            def pubsub(self) -> FakePubSub:
                return FakePubSub(hub)

            async def aclose(self) -> None:
                hub.closed += 1

        return Client()


async def _until(predicate: Any) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_the_feed_hands_on_prefixes_and_drops_everything_after_a_gap() -> None:
    hub = Hub()
    prefixes: list[str] = []
    gaps: list[int] = []
    feed = InvalidationFeed(
        hub.client, prefixes.append, lambda: gaps.append(1), pause_s=0.001, max_pause_s=0.002
    )
    feed.start()
    await asyncio.wait_for(feed.subscribed.wait(), 1)
    hub.queue.put_nowait(orjson.dumps({"prefix": "ts:{m}:", "origin": "a"}))
    hub.queue.put_nowait(b"garbage")
    await _until(lambda: prefixes == ["ts:{m}:"])
    assert feed.received == 1 and len(gaps) == 1
    # The connection breaks and Redis refuses for a while: no subscription, then a new one
    # that tells the edge to drop what it holds.
    hub.refuse = True
    hub.queue.put_nowait(ConnectionError("reset"))
    await _until(lambda: not feed.subscribed.is_set())
    hub.refuse = False
    await _until(lambda: feed.subscribed.is_set())
    assert len(gaps) == 2 and hub.subscriptions == 2
    await feed.close()
    assert not feed.subscribed.is_set() and hub.closed >= 2
