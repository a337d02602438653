"""deploy/docker/healthcheck.py (the TLS exec probe) against real gRPC health servers, plaintext and TLS."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from k8s_render import REPO

SCRIPT = REPO / "deploy" / "docker" / "healthcheck.py"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def probe(*args: str | int) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a server certificate for DNS:pdllm.internal signed by it (what cert-manager would issue)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make test certificates (Debian package `openssl`)"
    d = tmp_path_factory.mktemp("tls")
    run = lambda *a: subprocess.run([openssl, *a], cwd=d, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=pdllm-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=pdllm")
    (d / "san.ext").write_text("subjectAltName=DNS:pdllm.internal\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "tls.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return d


def serve(certs: Path | None) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if certs is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        pair = ((certs / "tls.key").read_bytes(), (certs / "tls.crt").read_bytes())
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair]))
    server.start()
    return server, servicer, port


@pytest.fixture
def tls_server(certs: Path) -> Iterator[tuple[health.HealthServicer, int]]:
    server, servicer, port = serve(certs)
    yield servicer, port
    server.stop(None)


def test_tls_probe_follows_serving_status(certs: Path, tls_server: tuple[health.HealthServicer, int]) -> None:
    servicer, port = tls_server
    tls = ("--port", port, "--ca", certs / "ca.crt", "--server-name", "pdllm.internal")
    servicer.set("", SERVING)
    ok = probe(*tls)
    assert ok.returncode == 0 and "SERVING" in ok.stderr
    servicer.set("", NOT_SERVING)
    draining = probe(*tls)
    assert draining.returncode == 1 and "NOT_SERVING" in draining.stderr
    servicer.set("pdllm.v1.Prefill", SERVING)
    assert probe(*tls, "--service", "pdllm.v1.Prefill").returncode == 0
    assert probe(*tls, "--service", "pdllm.v1.Decode").returncode == 1  # unknown service: NOT_FOUND


def test_tls_probe_rejects_wrong_name_plaintext_and_missing_ca(
    certs: Path, tls_server: tuple[health.HealthServicer, int]
) -> None:
    servicer, port = tls_server
    servicer.set("", SERVING)
    wrong_name = probe(
        "--port", port, "--ca", certs / "ca.crt", "--server-name", "evil.example", "--timeout", 2
    )
    assert wrong_name.returncode == 1 and "UNAVAILABLE" in wrong_name.stderr
    plaintext = probe("--port", port, "--timeout", 2)
    assert plaintext.returncode == 1
    missing = probe("--port", port, "--ca", certs / "nope.crt")
    assert missing.returncode == 1 and "cannot read CA bundle" in missing.stderr


def test_plaintext_probe_and_nothing_listening() -> None:
    server, servicer, port = serve(None)
    try:
        servicer.set("", SERVING)
        assert probe("--port", port).returncode == 0
    finally:
        server.stop(None).wait()
    gone = probe("--port", port, "--timeout", 1)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
