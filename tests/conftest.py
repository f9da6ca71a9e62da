from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support.servers import RedisServer, redis_server


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
