"""Command-line flags shared by every serving role, with PDLLM_<FLAG> environment fallbacks.

`pdllm serve` adds these to its parser and turns the result into a ServerConfig, so every role (and the
Kubernetes manifests, which set env vars) spells the same setting the same way. Precedence: flag, then
environment variable, then default. The auth token is never a flag (flags show up in `ps`): it comes from
$PDLLM_AUTH_TOKEN or from the file named by --auth-token-file.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from pdllm.shared.rpc.server import ServerConfig, TlsFiles
from pdllm.shared.settings_flags import env_name, env_value  # PDLLM_<FLAG>: one place for all flags

T = TypeVar("T")


def add_server_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    g = parser.add_argument_group("server")

    def add(flag: str, convert: Callable[[str], T], default: T, help_text: str) -> None:
        shown = '""' if default == "" else default
        g.add_argument(
            flag,
            type=convert,
            default=env_value(flag, convert, default, env),
            help=f"{help_text} (env {env_name(flag)}; default {shown})",
        )

    add("--host", str, "127.0.0.1", "address to bind")
    add("--port", int, 50051, "gRPC port (0 = any free port)")
    add("--metrics-host", str, "", "address for /metrics (empty = same as --host)")
    add("--metrics-port", int, 9400, "Prometheus port (-1 = no metrics endpoint)")
    add("--max-workers", int, 64, "handler threads, i.e. calls running at once")
    add("--max-concurrent-rpcs", int, 0, "beyond this, calls get RESOURCE_EXHAUSTED (0 = --max-workers)")
    add("--max-message-bytes", int, 64 << 20, "largest request/response message")
    add("--drain-seconds", float, 120.0, "grace for in-flight calls after SIGTERM")
    add("--tls-cert", str, "", "PEM certificate chain; enables TLS together with --tls-key")
    add("--tls-key", str, "", "PEM private key")
    add(
        "--auth-token-file", str, "", "file holding the bearer token (else $PDLLM_AUTH_TOKEN; none = no auth)"
    )


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"--auth-token-file {path}: {err.strerror or err}") from None
    if not token:
        raise ValueError(f"--auth-token-file {path} is empty")
    return token


def server_config_from_args(
    args: argparse.Namespace, role: str, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Check the server flags (ValueError with a one-line message) and build the ServerConfig."""
    env = os.environ if environ is None else environ
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    tls = None
    if args.tls_cert:
        for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        tls = TlsFiles(cert_path=Path(args.tls_cert), key_path=Path(args.tls_key))
    for flag, value, low in (
        ("--port", args.port, 0),
        ("--max-workers", args.max_workers, 1),
        ("--max-concurrent-rpcs", args.max_concurrent_rpcs, 0),
        ("--max-message-bytes", args.max_message_bytes, 1024),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= args.port <= 65535 or not -1 <= args.metrics_port <= 65535:
        raise ValueError("ports must be in [0, 65535] (--metrics-port may be -1 to disable)")
    if args.drain_seconds < 0:
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    token = _read_token(args.auth_token_file) if args.auth_token_file else env.get("PDLLM_AUTH_TOKEN") or None
    return ServerConfig(
        role=role,
        host=args.host,
        port=args.port,
        max_workers=args.max_workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs or None,
        max_receive_message_bytes=args.max_message_bytes,
        max_send_message_bytes=args.max_message_bytes,
        auth_token=token,
        tls=tls,
        metrics_host=args.metrics_host or args.host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        drain_grace_s=args.drain_seconds,
    )
