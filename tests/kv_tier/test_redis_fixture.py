"""The project-wide redis_server fixture: a real server that tests can kill and restart."""

from __future__ import annotations

import socket

import pytest
import redis

from tests.fixtures.redis_server import RedisServer, RedisServerConfig, RedisServerError


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return True
    return False


def test_fixture_serves_a_fresh_server_without_persistence(
    redis_server: str, redis_process: RedisServer
) -> None:
    assert redis_server == redis_process.url and redis_server.startswith("redis://127.0.0.1:")
    client = redis.Redis.from_url(redis_server)
    assert client.ping() is True
    assert client.dbsize() == 0
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    client.close()


def test_kill_and_restart_on_the_same_port(redis_process: RedisServer) -> None:
    client = redis.Redis.from_url(redis_process.url)
    client.set("a", b"1")
    port = redis_process.port
    redis_process.kill()
    assert not redis_process.running and _refused(port)
    with pytest.raises(redis.ConnectionError):
        client.get("a")
    redis_process.restart()
    assert redis_process.port == port and redis_process.running
    assert client.get("a") is None  # no persistence: a restart loses the data
    client.close()


def test_missing_binary_fails_with_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PDLLM_REDIS_SERVER", str(tmp_path / "nope"))
    monkeypatch.setattr("tests.fixtures.redis_server.Path.is_file", lambda self: False)
    with pytest.raises(RedisServerError, match="apt-get install -y redis-server"):
        RedisServer(RedisServerConfig())


def test_max_memory_option_reaches_the_server() -> None:
    with RedisServer(RedisServerConfig(max_memory="3mb")) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory") == {"maxmemory": str(3 * 1024 * 1024)}
        client.close()
