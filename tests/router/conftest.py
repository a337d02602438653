"""Fixtures for the router tests: the fake Kubernetes API server lives in k8s_fake.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from k8s_fake import FakeApiServer


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.thread.start()
    yield server
    server.expire_watches()
    server.httpd.shutdown()
    server.httpd.server_close()
