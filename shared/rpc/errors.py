"""Typed errors that carry a gRPC status code, raised by servicers and by the client."""

from __future__ import annotations

import grpc


class PdllmError(Exception):
    """An error with the gRPC status it maps to; servicers may raise it and the server aborts the call with
    exactly this code and message (other exceptions become INTERNAL without leaking their text)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self, message: str, *, code: grpc.StatusCode | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.request_id = request_id

    def __str__(self) -> str:
        suffix = f" (request {self.request_id})" if self.request_id else ""
        return f"{self.code.name}: {self.message}{suffix}"


class InvalidRequestError(PdllmError):
    """Bad client input; `kind` is a stable machine-readable tag (e.g. "block_not_divisor")."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, kind: str, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.kind = kind


def error_from_rpc(err: grpc.RpcError) -> PdllmError:
    """Turn a client-side grpc.RpcError (a grpc.Call) into a PdllmError with its code and details."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else None
    message = details or f"call failed with {code.name}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError("server", message)
    return PdllmError(message, code=code)
