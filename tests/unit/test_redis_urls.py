"""Redis URLs: ``redis+cluster://`` names a node of a Redis Cluster wherever a URL is taken,
as ``redis://`` with ``--redis-cluster`` does; an unknown scheme is refused in plain words."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailserve.assembly.worker import Worker
from tailserve.cache.redis import node_url, parse_url
from tailserve.errors import ConfigError
from tailserve.settings import Settings


@pytest.mark.parametrize(
    ("url", "cluster", "expected"),
    [
        ("redis+cluster://10.0.0.5:7000", False, ("redis://10.0.0.5:7000", True)),
        ("REDIS+CLUSTER://cache:7000/0", False, ("redis://cache:7000/0", True)),
        ("rediss+cluster://:pw@cache:7000", False, ("rediss://:pw@cache:7000", True)),
        ("redis://cache:6379", True, ("redis://cache:6379", True)),  # --redis-cluster
        ("redis://cache:6379/3", False, ("redis://cache:6379/3", False)),
        ("rediss://cache:6380", False, ("rediss://cache:6380", False)),
        ("unix:///run/redis.sock", False, ("unix:///run/redis.sock", False)),
    ],
)
def test_a_cluster_url_is_redis_on_a_cluster(
    url: str, cluster: bool, expected: tuple[str, bool]
) -> None:
    assert parse_url(url, cluster=cluster) == expected


@pytest.mark.parametrize(
    "url", ["http://cache:6379", "cache:6379", "redis+sentinel://cache:26379", "unix+cluster:///s"]
)
def test_an_unknown_scheme_is_refused_naming_those_taken(url: str) -> None:
    with pytest.raises(ConfigError, match="redis://, rediss://, unix:// or, for a node of a "):
        parse_url(url)


def test_a_cluster_has_database_0_only_and_a_password_stays_out_of_messages() -> None:
    with pytest.raises(ConfigError, match=r"'redis\+cluster://:\*\*\*@cache:7000/2'.*database 0"):
        parse_url("redis+cluster://:secret@cache:7000/2")
    with pytest.raises(ConfigError, match="database 0"):
        parse_url("redis://cache:7000/1", cluster=True)
    with pytest.raises(ConfigError, match="over TCP"):
        parse_url("unix:///run/redis.sock", cluster=True)


def test_node_url_aims_a_url_at_another_node_keeping_its_credentials() -> None:
    assert node_url("redis://u:pw@cache:7000/0", "10.0.0.7", 7001) == "redis://u:pw@10.0.0.7:7001/0"
    assert node_url("redis://cache:7000", "::1", 7002) == "redis://[::1]:7002"


def test_a_worker_takes_a_cluster_url_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    settings = Settings(repository=str(tmp_path), redis_url="redis+cluster://127.0.0.1:7000")
    worker = Worker(settings)
    assert (worker.settings.redis_url, worker.settings.redis_cluster) == (
        "redis://127.0.0.1:7000",
        True,
    )
    with pytest.raises(ConfigError, match="the scheme must be"):
        Worker(settings.replace(redis_url="memcached://127.0.0.1:11211"))
