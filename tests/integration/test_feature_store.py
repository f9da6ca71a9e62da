"""The feature store against a real redis-server: round trips, one command for many ids, the
in-process cache in front, versions kept apart, faults as tailserve errors; the ranker's
features loaded and served end to end."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from support.servers import (
    OwnRedisServer,
    RedisServer,
    async_wait_for,
    command_calls,
    free_port,
    pause_redis,
    resume_redis,
    run_worker,
)
from tailserve.cache.breaker import Breaker, BreakerState
from tailserve.cache.feature_store import FeatureStore, entity_key
from tailserve.cache.features import FeatureResolver
from tailserve.cache.redis import connect
from tailserve.errors import InvalidInput, Unavailable
from tailserve.examples import funnel, load_features, ranker
from tailserve.modelconfig import FeatureInput, FeaturesConfig
from tailserve.settings import Settings
from tailserve.tensors import Tensor

FIELDS = ["f0", "f1", "f2", "f3"]


def fresh_entity() -> str:
    """An entity type of the test's own on the shared server."""
    return f"e-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def store(redis: RedisServer) -> AsyncIterator[FeatureStore]:
    # A limit no loaded test machine reaches: these tests are about behaviour, not speed.
    store = FeatureStore(connect(redis.url, timeout_s=2.0), timeout_s=5.0, chunk=300)
    yield store
    await store.close()


def table(rows: int, version: float = 0.0) -> np.ndarray[Any, Any]:
    """Distinct values a row: row i holds i*10 + column (+ version)."""
    return (np.arange(rows)[:, None] * 10 + np.arange(len(FIELDS)) + version).astype(np.float32)


async def test_rows_written_are_read_back_by_field_name(store: FeatureStore) -> None:
    entity = fresh_entity()
    rows = {7: {"f0": 1.5, "f1": -2.0, "f2": 3.25}, 8: {"f0": 4.0, "f1": 5.0, "f2": 6.0}}
    assert await store.write(entity, "1", rows) == 2
    matrix = await store.read(entity, "1", [8, 7], ["f2", "f0"])
    assert matrix.dtype == np.float32
    np.testing.assert_array_equal(matrix, [[6.0, 4.0], [3.25, 1.5]])
    assert await store.fields(entity, "1") == ["f0", "f1", "f2"]


async def test_many_ids_are_read_in_one_command(store: FeatureStore, admin: Redis) -> None:
    entity = fresh_entity()
    assert await store.write_matrix(entity, "1", range(1000), FIELDS, table(1000)) == 1000
    await store.read(entity, "1", [0], FIELDS)  # the script is loaded on first use
    ids = list(range(999, 0, -2))
    before = await command_calls(admin, "evalsha")
    matrix = await store.read(entity, "1", ids, FIELDS)
    assert await command_calls(admin, "evalsha") == before + 1
    np.testing.assert_array_equal(matrix, table(1000)[ids])
    # Stored compactly: one packed float32 value a hash.
    raw = await admin.hgetall(entity_key(entity, "1", 5))
    assert raw == {b"v": table(6)[5].tobytes()}


async def test_unknown_ids_are_invalid_input_naming_the_entity_and_id(
    store: FeatureStore,
) -> None:
    entity = fresh_entity()
    await store.write_matrix(entity, "1", range(3), FIELDS, table(3))
    with pytest.raises(InvalidInput, match=f"unknown {entity} ids 9, 11"):
        await store.read(entity, "1", [1, 9, 11], FIELDS)
    with pytest.raises(Unavailable, match=r"holds no .* features of version '2'"):
        await store.read(entity, "2", [1], FIELDS)


async def test_prepare_caches_the_script_and_names_a_version_not_there(
    store: FeatureStore, admin: Redis
) -> None:
    entity = fresh_entity()
    await store.write_matrix(entity, "1", range(3), FIELDS, table(3))
    await admin.script_flush()
    await store.prepare(entity, "1", FIELDS[:2])
    (cached,) = await admin.script_exists(store._sha)
    assert cached
    evals = await command_calls(admin, "eval")
    np.testing.assert_array_equal(await store.read(entity, "1", [2], FIELDS), table(3)[[2]])
    assert await command_calls(admin, "eval") == evals  # the read found the script there
    with pytest.raises(Unavailable, match=r"holds no .* features of version '2'"):
        await store.prepare(entity, "2", FIELDS)
    with pytest.raises(Unavailable, match="lack 'f9'"):
        await store.prepare(entity, "1", ["f0", "f9"])


async def test_versions_are_kept_apart_and_fixed_to_their_fields(store: FeatureStore) -> None:
    entity = fresh_entity()
    await store.write_matrix(entity, "1", range(4), FIELDS, table(4))
    await store.write_matrix(entity, "2", range(4), FIELDS, table(4, version=0.5))
    np.testing.assert_array_equal(await store.read(entity, "1", [3], FIELDS), table(4)[[3]])
    np.testing.assert_array_equal(
        await store.read(entity, "2", [3], FIELDS), table(4, version=0.5)[[3]]
    )
    with pytest.raises(InvalidInput, match="write a new version"):
        await store.write(entity, "1", {9: {"other": 1.0}})
    # The same fields in another order are stored in the version's order.
    await store.write(entity, "1", {9: {"f3": 3.0, "f2": 2.0, "f1": 1.0, "f0": 0.0}})
    np.testing.assert_array_equal(await store.read(entity, "1", [9], FIELDS), [[0, 1, 2, 3]])
    assert await store.drop(entity, "1") == 6  # five rows and the schema
    with pytest.raises(Unavailable):
        await store.read(entity, "1", [3], FIELDS)
    assert (await store.read(entity, "2", [3], FIELDS)).shape == (1, 4)


async def test_a_redis_that_does_not_answer_is_unavailable() -> None:
    client = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    try:
        with pytest.raises(Unavailable, match="the feature store failed"):
            await FeatureStore(client).read("user", "1", [1], FIELDS)
    finally:
        await client.aclose()


async def test_a_paused_store_opens_the_breaker_and_reads_fail_at_once_until_it_is_back(
    own_redis: OwnRedisServer,
) -> None:
    # Each read waits at most 50 ms for a paused Redis (the socket would wait 30 s); after
    # three such, the next fail at once, and a probe once Redis is back closes the breaker.
    # (While Redis answers, reads may wait 5 s: a busy machine can take 50 ms from a read.)
    clock = Clock()
    breaker = Breaker(clock=clock, threshold=3, open_s=1.0)
    store = FeatureStore(connect(own_redis.url, timeout_s=30.0), timeout_s=5.0, breaker=breaker)
    entity = fresh_entity()
    try:
        rows = {i: dict(zip(FIELDS, map(float, table(3)[i]), strict=True)) for i in (1, 2)}
        assert await store.write(entity, "1", rows) == 2
        assert (await store.read(entity, "1", [2], FIELDS)).tolist() == [table(3)[2].tolist()]
        store.timeout_s = 0.05
        pause_redis(own_redis)
        try:
            for _ in range(3):
                with pytest.raises(Unavailable, match="did not answer within 50 ms"):
                    await store.read(entity, "1", [1], FIELDS)
            assert breaker.state is BreakerState.OPEN
            with pytest.raises(Unavailable, match="not asked again until a probe succeeds"):
                await store.read(entity, "1", [1], FIELDS)
        finally:
            resume_redis(own_redis)
            store.timeout_s = 5.0
        clock.now += 1.0  # the cool-down is over: the next read probes

        async def probed() -> bool:
            try:
                await store.read(entity, "1", [1], FIELDS)
            except Unavailable:
                clock.now += 10.0  # (a probe that met the last of the pause: again)
                return False
            return breaker.state is BreakerState.CLOSED

        await async_wait_for(probed, what="a probe to close the breaker")
    finally:
        await store.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def resolver_for(entity: str, store: FeatureStore, clock: Clock) -> FeatureResolver:
    spec = FeatureInput(input="x", key="ids", entity=entity, fields=FIELDS, shape=[-1])
    return FeatureResolver(FeaturesConfig(version="1", ttl_s=10.0, inputs=[spec]), store, clock)


def id_tensor(values: list[int]) -> list[Tensor]:
    return [Tensor("ids", "INT64", np.array(values, dtype=np.int64))]


async def test_the_in_process_cache_spares_redis_until_the_ttl(
    store: FeatureStore, admin: Redis
) -> None:
    entity = fresh_entity()
    await store.write_matrix(entity, "1", range(50), FIELDS, table(50))
    clock = Clock()
    resolver = resolver_for(entity, store, clock)
    await store.read(entity, "1", [0], FIELDS)  # the script is loaded on first use
    before = await command_calls(admin, "evalsha")
    first = await resolver.resolve(id_tensor(list(range(40))))
    again = await resolver.resolve(id_tensor(list(range(39, -1, -1))))
    assert await command_calls(admin, "evalsha") == before + 1
    np.testing.assert_array_equal(again[0].data, first[0].data[::-1])
    # Only the misses go to Redis: 40..49 in one command.
    await resolver.resolve(id_tensor(list(range(50))))
    assert await command_calls(admin, "evalsha") == before + 2
    # Past the TTL the rows are read again, with what the store now holds.
    await store.write_matrix(entity, "1", range(50), FIELDS, table(50, version=0.25))
    written = await command_calls(admin, "evalsha")  # (a write is one script call too)
    clock.now += 11
    fresh = await resolver.resolve(id_tensor([3]))
    assert await command_calls(admin, "evalsha") == written + 1
    np.testing.assert_array_equal(fresh[0].data, table(50, version=0.25)[[3]])


async def test_an_unknown_id_names_the_tensor(store: FeatureStore) -> None:
    entity = fresh_entity()
    await store.write_matrix(entity, "1", range(5), FIELDS, table(5))
    resolver = resolver_for(entity, store, Clock())
    with pytest.raises(InvalidInput, match=f"input 'ids': unknown {entity} id 99"):
        await resolver.resolve(id_tensor([1, 99]))


# --- the ranker example, loaded and served --------------------------------------------------


@pytest.fixture(scope="module")
def ranker_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ranker")
    ranker.write_ranker(directory)
    return directory


@pytest.fixture(scope="module")
def loaded(ranker_repository: Path, redis: RedisServer) -> dict[str, int]:
    return load_features(ranker_repository / "ranker", redis.url)


async def test_load_features_fills_redis_with_the_catalog(
    loaded: dict[str, int], ranker_repository: Path, store: FeatureStore
) -> None:
    # with the funnel's retrieval vectors, made from the same catalog
    assert loaded == {
        "user": ranker.USERS,
        "item": ranker.ITEMS,
        funnel.USER_VECTORS: ranker.USERS,
        funnel.ITEM_VECTORS: ranker.ITEMS,
        funnel.POPULAR: 1,
    }
    with np.load(ranker_repository / "ranker" / ranker.CATALOG) as catalog:
        saved = dict(catalog)
    last = [ranker.ITEMS - 1, 0, 12_345]
    items = await store.read("item", "1", last, ranker.ITEM_FIELDS)
    np.testing.assert_array_equal(items, saved["item"][last].astype(np.float32))
    users = await store.read("user", "1", [ranker.USERS - 1], ranker.USER_FIELDS)
    np.testing.assert_array_equal(users, saved["user"][[-1]].astype(np.float32))
    with pytest.raises(InvalidInput):
        await store.read("item", "1", [ranker.ITEMS], ranker.ITEM_FIELDS)


def test_a_worker_scores_candidates_from_their_ids(
    loaded: dict[str, int], ranker_repository: Path, redis: RedisServer
) -> None:
    with np.load(ranker_repository / "ranker" / ranker.CATALOG) as catalog:
        saved = dict(catalog)
    weights, _ = ranker.train()
    request = ranker.draw_request(np.random.default_rng(5), 300)
    user, items = int(request["user_id"][0]), request["item_ids"]
    expected = ranker.scores(
        weights,
        saved["user"][[user] * len(items)].astype(np.float32),
        saved["item"][items].astype(np.float32),
    )
    body = {
        "inputs": [
            {"name": "user_id", "datatype": "INT64", "shape": [1], "data": [user]},
            {
                "name": "item_ids",
                "datatype": "INT64",
                "shape": [len(items)],
                "data": items.tolist(),
            },
        ]
    }
    settings = Settings(repository=str(ranker_repository), redis_url=redis.url)
    admin = SyncRedis(host="127.0.0.1", port=redis.port)
    admin.script_flush()
    with run_worker(settings) as worker:
        # Ready once the store is: its read script is in Redis before the first request.
        store = worker.worker.feature_store
        assert store is not None and admin.script_exists(store._sha) == [True]
        admin.close()
        # (Scores are under test, not speed: a deadline no loaded machine misses, not the
        # ranker's 30 ms SLO.)
        relaxed = {"X-Deadline-Ms": "10000"}
        response = httpx.post(
            f"{worker.url}/v2/models/ranker/infer", json=body, headers=relaxed, timeout=30
        )
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        assert output["name"] == "score" and output["shape"] == [len(items), 1]
        np.testing.assert_allclose(output["data"], expected[:, 0], atol=1e-5)
        body["inputs"][0]["data"] = [ranker.USERS + 1]
        missing = httpx.post(
            f"{worker.url}/v2/models/ranker/infer", json=body, headers=relaxed, timeout=30
        )
        assert missing.status_code == 400
        assert "'user_id'" in missing.json()["error"]


def test_examples_features_only_fills_a_redis_from_a_written_repository(
    ranker_repository: Path, redis: RedisServer, tmp_path: Path
) -> None:
    # a database of its own on the shared server, so what is counted is this command's doing
    url = f"redis://127.0.0.1:{redis.port}/7"
    command = [sys.executable, "-m", "tailserve.cli", "examples"]
    empty = subprocess.run(
        [*command, str(tmp_path), "--features-only", "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert empty.returncode == 2 and "holds no ranker" in empty.stderr
    assert list(tmp_path.iterdir()) == []
    done = subprocess.run(
        [*command, str(ranker_repository), "--features-only", "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" not in done.stdout and f"{ranker.USERS:,} users" in done.stdout
    assert sorted(path.name for path in ranker_repository.iterdir()) == ["ranker"]
    with SyncRedis(port=redis.port, db=7) as admin:
        assert admin.exists(entity_key("user", "1", ranker.USERS - 1))
        assert admin.exists(entity_key("item", "1", ranker.ITEMS - 1))
        assert not admin.exists(entity_key("item", "1", ranker.ITEMS))
        admin.flushdb()
