from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support import servers
from support.servers import OwnRedisServer, RedisServer, RunningRedisCluster, redis_server


@pytest.fixture(scope="session")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server of the test session's own, on a free loopback port."""
    try:
        with redis_server(tmp_path_factory.mktemp("redis")) as server:
            yield server
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def example_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example repository (`tailserve examples`), trained once per test session."""
    from tailserve.examples import write_examples

    directory = tmp_path_factory.mktemp("examples")
    write_examples(directory)
    return directory


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningRedisCluster]:
    """A real three-node Redis Cluster (masters only) of the test session's own."""
    try:
        with servers.redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
            yield cluster
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def replicated_cluster(tmp_path: Path) -> Iterator[RunningRedisCluster]:
    """A Redis Cluster of the test's own, three masters with a replica each, quick to fail
    over (a node is failing after 1 s of silence): to kill a master."""
    try:
        with servers.redis_cluster(tmp_path, replicas=1, node_timeout_ms=1000) as c:
            yield c
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedisServer]:
    """A redis-server of the test's own, to pause (SIGSTOP), kill and restart on its port
    without disturbing the other tests."""
    try:
        with servers.own_redis_server(tmp_path) as server:
            yield server
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
async def admin(redis: RedisServer) -> AsyncIterator[Any]:
    """An asyncio client of the session's Redis, for a test to inspect it."""
    from redis.asyncio import Redis

    client = Redis.from_url(redis.url)
    yield client
    await client.aclose()
