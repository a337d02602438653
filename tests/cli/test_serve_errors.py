"""`pdllm serve` on a taken gRPC --port: one line naming the flag, for every role, before any model load (no
gRPC C-core log, no traceback); the all-in-one deployment's logs name the metrics port it serves."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest

from pdllm.shared.app.serve import build_parser, main, start
from pdllm.shared.rpc.server import ServerConfig, build_server

from ..model.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(autouse=True)
def pdllm_logger():  # type: ignore[no-untyped-def]
    """`serve` routes the pdllm loggers to JSON on stderr (pytest's capture stream here); put them back."""
    logger = logging.getLogger("pdllm")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield logger
    logger.handlers, logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def taken_port():  # type: ignore[no-untyped-def]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("role", ["router", "prefill", "decode", "all"])
def test_taken_port_is_one_line_naming_the_flag(taken_port: int, role: str, capsys) -> None:
    argv = ["--role", role, "--port", str(taken_port), "--metrics-port", "-1", "--model", "/nonexistent"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)  # the port is checked first: a model that cannot load is never reached
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdllm serve: error: --port {taken_port}: cannot listen on 127.0.0.1:{taken_port}")
    assert err.count("\n") == 1


def test_second_server_on_a_port_gets_one_line() -> None:
    """The user's case: a second `serve` while a first one holds --port (a real gRPC server this time),
    through the installed entry point: no C-core log line and no traceback."""
    first = build_server(ServerConfig(role="router", port=0), []).start()
    try:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdllm.shared.app.cli",
                "serve",
                "--role",
                "router",
                "--port",
                str(first.port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        first.stop()
    assert res.returncode == 2
    assert res.stderr.startswith(f"pdllm serve: error: --port {first.port}: cannot listen on")
    assert res.stderr.count("\n") == 1, res.stderr


def test_build_server_names_the_flag(taken_port: int) -> None:
    with pytest.raises(ValueError, match=rf"^--port {taken_port}: cannot listen on 127.0.0.1:{taken_port}"):
        build_server(ServerConfig(port=taken_port), [])


def test_all_in_one_logs_the_metrics_port_it_serves(tmp_path, pdllm_logger) -> None:
    model = make_tiny_checkpoint(tmp_path / "tiny")
    args = build_parser().parse_args(
        ["--role", "all", "--model", str(model), "--port", "0", "--metrics-port", "0"]
    )
    seen = Records()
    pdllm_logger.addHandler(seen)
    pdllm_logger.setLevel(logging.INFO)
    deployment = start(args)
    try:
        port = deployment.servers[0].metrics_port
        assert port  # the public server (the router) holds the endpoint of all three
        serving = {r.role: r.metrics_port for r in seen.records if r.getMessage() == "serving"}
        assert serving["router"] == port
        assert serving["prefill"] is None and serving["decode"] is None  # no endpoint of their own
    finally:
        deployment.stop()
