"""Fixtures that start real gRPC servers (with the FakeGeneration test double) on loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from pdllm.shared.rpc.server import RpcServer, ServerConfig, build_server
from pdllm.shared.rpc.validation import ValidationLimits
from tests.rpc.fake_generation import MODEL, FakeGeneration, fake_spec

StartServer = Callable[..., tuple[RpcServer, FakeGeneration]]


@pytest.fixture
def start_server() -> Iterator[StartServer]:
    """`start_server(**ServerConfig overrides)` -> (started server, its FakeGeneration); stopped at teardown."""
    servers: list[RpcServer] = []

    def start(step_delay_s: float = 0.05, **overrides: object) -> tuple[RpcServer, FakeGeneration]:
        servicer = FakeGeneration(
            limits=ValidationLimits(models=(MODEL,), max_prompt_bytes=65536), step_delay_s=step_delay_s
        )
        config = replace(ServerConfig(role="test", metrics_port=0), **overrides)
        server = build_server(config, [fake_spec(servicer)]).start()
        servers.append(server)
        return server, servicer

    yield start
    for server in servers:
        if not server.wait(0):
            server.stop()
