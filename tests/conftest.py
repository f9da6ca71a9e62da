from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from phases import SERIAL
from support import fuzzing, servers
from support.examples import ExamplesRun, examples_once
from support.servers import OwnRedisServer, RedisServer, RunningRedisCluster, redis_server

TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(TESTS).as_posix() in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """Under pytest-xdist: the fuzz cases a worker process ran (tests/fuzz/conftest.py)."""
    counts = getattr(node, "workeroutput", {}).get("fuzz")
    if counts:
        fuzzing.CASES.update(counts["cases"])
        fuzzing.FAILURES.update(counts["failures"])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many cases the fuzz tests ran (docs/testing.md, "Fuzzing")."""
    if fuzzing.CASES:
        terminalreporter.write_line(fuzzing.summary())
        if fuzzing.LONG:
            for target, count in sorted(fuzzing.CASES.items()):
                failed = fuzzing.FAILURES.get(target, 0)
                terminalreporter.write_line(f"  {target}: {count} cases, {failed} failing")


@pytest.fixture(scope="session")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server of the test session's own, on a free loopback port."""
    try:
        with redis_server(tmp_path_factory.mktemp("redis")) as server:
            yield server
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def examples_command(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> ExamplesRun:
    """`tailserve examples DIR`: the example repository, trained from synthetic data, and what
    the command said; trained once for this source (support/examples.py), a copy a session."""
    cache = getattr(pytestconfig, "cache", None)  # (None under -p no:cacheprovider)
    built = cache.mkdir("examples") if cache is not None else tmp_path_factory.mktemp("build")
    return examples_once(built, tmp_path_factory.mktemp("examples") / "repo")


@pytest.fixture(scope="session")
def example_repository(examples_command: ExamplesRun) -> Path:
    """The example repository (`tailserve examples`), trained once per test session."""
    done = examples_command.done
    if done.returncode != 0:
        pytest.fail(f"tailserve examples failed:\n{done.stderr}", pytrace=False)
    return examples_command.directory


@pytest.fixture(scope="session")
def churn_repository(example_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example repository's churn model alone: a stack of it is ready in a few seconds,
    where the whole examples (the text model's runtime above all) take several times that."""
    directory = tmp_path_factory.mktemp("churn-only")
    shutil.copytree(example_repository / "churn", directory / "churn")
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
