"""Server interceptors: bearer-token auth, and one observability/admission layer that every call passes.

The observability layer is outermost so that it also counts calls the auth layer rejects. It wraps the
method handler itself (not just the call) to:
- admit or reject the call (UNAVAILABLE while draining) and track in-flight calls for the drain,
- turn undecodable request bytes (e.g. invalid UTF-8 in a string field) into INVALID_ARGUMENT instead of
  grpc's default INTERNAL,
- bind the request id for structured logs,
- map PdllmError to its status and any other exception to INTERNAL without leaking its text,
- record metrics (code, latency, time to first streamed message).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.rpc.logs import bind_request_id
from pdllm.shared.rpc.metrics import RpcMetrics
from pdllm.shared.rpc.validation import new_request_id

HEALTH_PREFIX = "/grpc.health.v1.Health/"

_log = logging.getLogger("pdllm.rpc")


class AdmissionState:
    """In-flight call count, concurrency limit and draining flag, updated atomically so that no call slips
    in after the drain starts or past the limit. Health (exempt) calls are not counted."""

    def __init__(self, limit: int | None = None) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._draining = False
        self.limit = limit

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def try_admit(self) -> grpc.StatusCode | None:
        """None if admitted (the caller must release()), else the status to refuse the call with."""
        with self._cond:
            if self._draining:
                return grpc.StatusCode.UNAVAILABLE
            if self.limit is not None and self._in_flight >= self.limit:
                return grpc.StatusCode.RESOURCE_EXHAUSTED
            self._in_flight += 1
            return None

    def release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def start_drain(self) -> None:
        with self._cond:
            self._draining = True

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no admitted call is running; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)


def _bearer_token(metadata: tuple[tuple[str, Any], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            # The scheme name is case-insensitive (RFC 7235); the token is compared exactly.
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def _rejecting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same streaming kind as `handler` that fails every call with `code`."""

    def reject(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(reject)
    return grpc.unary_unary_rpc_method_handler(reject)


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` metadata on every method outside `exempt_prefixes`."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)) -> None:
        if not token:
            raise ValueError("auth token must be non-empty")
        self._token = token.encode("utf-8")
        self._exempt = exempt_prefixes

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._exempt):
            return handler
        presented = _bearer_token(handler_call_details.invocation_metadata)
        if presented is not None and hmac.compare_digest(presented.encode("utf-8"), self._token):
            return handler
        reason = "missing bearer token" if presented is None else "invalid bearer token"
        return _rejecting_handler(
            handler, grpc.StatusCode.UNAUTHENTICATED, f"{reason} (metadata 'authorization')"
        )


@dataclass(frozen=True)
class _Undecodable:
    error: str


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def wrapped(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as err:  # any decode failure is the client's malformed input
            return _Undecodable(str(err))

    return wrapped


def _request_id(request: Any) -> str | None:
    """The call's request id: the message's own, or a fresh one when it has an empty `request_id` field
    (servicers read the effective id with `current_request_id()`)."""
    if isinstance(request, _Undecodable) or not hasattr(request, "request_id"):
        return None
    return request.request_id or new_request_id()


def _final_code(context: grpc.ServicerContext) -> grpc.StatusCode:
    """The status the client got. Checked before the handler's own code: once the call has ended under the
    handler (the client cancelled, its deadline passed, the server stopped), that ending is what the client
    saw, whatever the handler set afterwards (a router whose worker call fails once its own call has ended
    aborts with the worker's status, often CANCELLED)."""
    if not context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return context.code() or grpc.StatusCode.OK


class ObservabilityInterceptor(grpc.ServerInterceptor):
    def __init__(
        self,
        admission: AdmissionState,
        metrics: RpcMetrics | None,
        track_queue_depth: bool = True,
        drain_exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,),
    ) -> None:
        self._admission = admission
        self._metrics = metrics
        self._track_queue_depth = track_queue_depth
        self._drain_exempt = drain_exempt_prefixes

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        exempt = method.startswith(self._drain_exempt)
        # Streamed requests reach the handler through an iterator, where a decode failure cannot be turned
        # into a status before the handler sees it; grpc's own handling (INTERNAL) stays for those.
        deserialize = (
            handler.request_deserializer
            if handler.request_streaming
            else _safe_deserializer(handler.request_deserializer)
        )
        serialize = handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            inner = handler.stream_stream
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(inner, method, exempt), deserialize, serialize
            )
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary, method, exempt), deserialize, serialize
            )
        if handler.response_streaming:
            inner = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(inner, method, exempt), deserialize, serialize
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, method, exempt), deserialize, serialize
        )

    def _admit(self, request: Any, context: grpc.ServicerContext, method: str, exempt: bool) -> None:
        """Abort (after counting the rejection) unless the call may run; admitted calls hold an in-flight slot."""
        if isinstance(request, _Undecodable):
            code, message = grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {request.error}"
        elif exempt:
            return
        else:
            refused = self._admission.try_admit()
            if refused is None:
                return
            code = refused
            if refused == grpc.StatusCode.UNAVAILABLE:
                message = "server is draining; retry on another replica"
            else:
                message = f"server is at its limit of {self._admission.limit} concurrent calls; retry later"
        if self._metrics is not None:
            self._metrics.rejected(method, code.name)
        _log.info("rpc rejected", extra={"method": method, "code": code.name})
        context.abort(code, message)

    def _on_exception(self, err: Exception, context: grpc.ServicerContext, request_id: str | None) -> None:
        """Re-raise deliberate aborts; convert PdllmError and unexpected errors into a status. Never returns."""
        if isinstance(err, PdllmError):
            context.abort(err.code, err.message)
        code = context.code()
        if code is not None and code != grpc.StatusCode.OK:
            raise err  # context.abort() already set the status
        _log.exception("unhandled error in RPC handler")
        context.abort(
            grpc.StatusCode.INTERNAL, f"internal error; the server logged it under request id {request_id}"
        )

    def _finish(self, method: str, started: float, context: grpc.ServicerContext, exempt: bool) -> None:
        code = _final_code(context)
        seconds = time.monotonic() - started
        if not exempt:
            self._admission.release()
        if self._metrics is not None:
            self._metrics.finished(method, code.name, seconds, self._track_queue_depth and not exempt)
        level = logging.DEBUG if method.startswith(HEALTH_PREFIX) else logging.INFO
        _log.log(
            level, "rpc finished", extra={"method": method, "code": code.name, "seconds": round(seconds, 6)}
        )

    def _begin(self, request: Any, context: grpc.ServicerContext, method: str, exempt: bool) -> float:
        self._admit(request, context, method, exempt)
        if self._metrics is not None:
            self._metrics.started(self._track_queue_depth and not exempt)
        return time.monotonic()

    def _unary(self, inner: Callable[..., Any], method: str, exempt: bool) -> Callable[..., Any]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Any:
            request_id = _request_id(request)
            with bind_request_id(request_id):
                started = self._begin(request, context, method, exempt)
                try:
                    return inner(request, context)
                except Exception as err:  # mapped to a status, never leaked
                    self._on_exception(err, context, request_id)
                finally:
                    self._finish(method, started, context, exempt)

        return behavior

    def _streaming(
        self, inner: Callable[..., Iterator[Any]], method: str, exempt: bool
    ) -> Callable[..., Any]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            # All work happens inside the generator: grpc iterates it on the handler thread, and a generator
            # that never started runs no `finally`, which would leak an in-flight slot.
            request_id = _request_id(request)
            with bind_request_id(request_id):
                started = self._begin(request, context, method, exempt)
            try:
                responses: Iterator[Any] | None = None
                first = True
                while True:
                    # Bind the request id around each step only: a binding held across `yield` would leak
                    # into whatever grpc runs on this thread between messages.
                    with bind_request_id(request_id):
                        try:
                            if responses is None:  # handlers may raise before returning an iterator
                                responses = iter(inner(request, context))
                            message = next(responses)
                        except StopIteration:
                            return
                        except Exception as err:  # mapped to a status, never leaked
                            self._on_exception(err, context, request_id)
                    if first and self._metrics is not None:
                        first = False
                        self._metrics.first_message.labels(self._metrics.role, method).observe(
                            time.monotonic() - started
                        )
                    yield message
            finally:
                with bind_request_id(request_id):
                    self._finish(method, started, context, exempt)

        return behavior
