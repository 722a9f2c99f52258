"""Integration fixtures: a real redis-server per test module, and a flushed client per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from support.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def rds(redis_srv: RedisServer) -> Iterator[redis.Redis]:
    """A client of an empty server (restarted first if a test killed it)."""
    if not redis_srv.running:
        redis_srv.start()
    client = redis.Redis.from_url(redis_srv.url)
    client.flushall()
    yield client
    client.close()
