"""Channels from the router to its workers: the same TLS and bearer token as the router's public side
(workers check them too)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from pdllm.shared.rpc.server import ServerConfig

RECONNECT_BACKOFF_MAX_MS = 2000


def worker_channel_factory(config: ServerConfig) -> Callable[[str], grpc.Channel]:
    """Router -> worker channels: same token and TLS as the public side (workers check them too)."""
    options = [
        ("grpc.max_receive_message_length", config.max_receive_message_bytes),
        ("grpc.max_send_message_length", config.max_send_message_bytes),
        # gRPC's reconnect backoff grows to 120 s by default: a worker that was down two minutes would wait
        # up to a minute after it serves again before the health checks could reach it.
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    ]

    def factory(address: str) -> grpc.Channel:
        if config.tls is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=config.tls.cert_path.read_bytes())
            if config.auth_token:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.access_token_call_credentials(config.auth_token)
                )
            return grpc.secure_channel(
                address, creds, options + [("grpc.ssl_target_name_override", "pdllm.internal")]
            )
        channel = grpc.insecure_channel(address, options)
        if config.auth_token:
            channel = grpc.intercept_channel(channel, _BearerToken(config.auth_token))
        return channel

    return factory


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or []) + [self._metadata]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)
