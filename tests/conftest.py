"""Project-wide pytest fixtures.

``redis_server`` yields the URL of a real, fresh redis-server (no persistence) on a free loopback port;
``redis_process`` yields the same server's :class:`RedisServer` handle, for tests that kill or restart it.
A missing redis-server fails the test with install instructions instead of skipping it: the Redis paths
are part of what CI must prove.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fixtures.redis_server import RedisServer, RedisServerError


@pytest.fixture
def redis_process() -> Iterator[RedisServer]:
    try:
        server = RedisServer().start()
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_server(redis_process: RedisServer) -> str:
    return redis_process.url
