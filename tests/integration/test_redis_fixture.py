"""The Redis fixture starts a real, private redis-server that redis-py can use."""

from __future__ import annotations

import redis as redis_py

from support.servers import RedisServer


def test_fixture_serves_a_private_redis_on_its_own_port(redis: RedisServer) -> None:
    client = redis_py.Redis.from_url(redis.url)
    try:
        assert client.ping()
        client.set("tailserve:test", b"value", px=10_000)
        assert client.get("tailserve:test") == b"value"
        assert int(client.info("server")["tcp_port"]) == redis.port
        assert redis.process.poll() is None
    finally:
        client.delete("tailserve:test")
        client.close()
