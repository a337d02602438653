"""A taken metrics port is a one-line error naming the flag, not an OSError traceback."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from pdllm.shared.app.serve import main
from pdllm.shared.rpc.metrics import start_metrics_endpoint


@pytest.fixture
def taken_port():  # type: ignore[no-untyped-def]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_start_metrics_endpoint_names_the_flag_when_the_port_is_taken(taken_port: int) -> None:
    with pytest.raises(ValueError, match=rf"--metrics-port {taken_port}: cannot listen on 127.0.0.1"):
        start_metrics_endpoint(CollectorRegistry(), "127.0.0.1", taken_port)


def test_serve_exits_with_one_line_when_the_metrics_port_is_taken(taken_port: int, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--role", "router", "--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", str(taken_port),
            "--prefill-workers", "127.0.0.1:1", "--decode-workers", "127.0.0.1:2"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"pdllm serve: error: --metrics-port {taken_port}" in err and "Traceback" not in err
