"""Server flags: defaults, PDLLM_* environment fallbacks, flag precedence, one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdllm.shared.rpc.options import add_server_arguments, env_name, server_config_from_args
from pdllm.shared.rpc.server import ServerConfig, TlsFiles


def _config(argv: list[str], environ: dict[str, str] | None = None, role: str = "decode") -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, environ or {})
    return server_config_from_args(parser.parse_args(argv), role, environ or {})


def test_defaults_bind_loopback_with_metrics_and_no_auth() -> None:
    cfg = _config([])
    assert (cfg.role, cfg.host, cfg.port, cfg.metrics_host, cfg.metrics_port) == (
        "decode",
        "127.0.0.1",
        50051,
        "127.0.0.1",
        9400,
    )
    assert cfg.auth_token is None and cfg.tls is None and cfg.max_concurrent_rpcs is None
    assert cfg.drain_grace_s == 120.0


def test_environment_fills_in_and_flags_win(tmp_path: Path) -> None:
    env = {
        "PDLLM_HOST": "0.0.0.0",
        "PDLLM_PORT": "6000",
        "PDLLM_METRICS_PORT": "-1",
        "PDLLM_DRAIN_SECONDS": "7.5",
        "PDLLM_AUTH_TOKEN": "from-env",
        "PDLLM_MAX_CONCURRENT_RPCS": "32",
    }
    cfg = _config(["--port", "7000"], env)
    assert (cfg.host, cfg.port, cfg.metrics_port, cfg.drain_grace_s) == ("0.0.0.0", 7000, None, 7.5)
    assert cfg.auth_token == "from-env" and cfg.max_concurrent_rpcs == 32
    token = tmp_path / "token"
    token.write_text("from-file\n")
    assert _config(["--auth-token-file", str(token)], env).auth_token == "from-file"
    assert env_name("--max-message-bytes") == "PDLLM_MAX_MESSAGE_BYTES"


def test_tls_files(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("cert")
    key.write_text("key")
    assert _config(["--tls-cert", str(cert), "--tls-key", str(key)]).tls == TlsFiles(cert, key)


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--tls-cert", "/x.pem"], {}, "--tls-cert and --tls-key must be given together"),
        (
            ["--tls-cert", "/nope/c.pem", "--tls-key", "/nope/k.pem"],
            {},
            "--tls-cert /nope/c.pem: no such file",
        ),
        (["--port", "70000"], {}, "ports must be in [0, 65535]"),
        (["--max-workers", "0"], {}, "--max-workers must be >= 1"),
        (["--drain-seconds", "-1"], {}, "--drain-seconds must be >= 0"),
        (["--auth-token-file", "/nope/token"], {}, "--auth-token-file /nope/token"),
        ([], {"PDLLM_PORT": "http"}, "$PDLLM_PORT='http' is not a valid value for --port"),
    ],
)
def test_bad_settings_are_one_line_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        _config(argv, env)
    assert message in str(info.value) and "\n" not in str(info.value)
