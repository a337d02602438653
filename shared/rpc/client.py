"""`PdllmClient`: a small Python client for the public `pdllm.v1.Generation` service.

Every gRPC failure surfaces as a PdllmError (InvalidRequestError for INVALID_ARGUMENT) whose str() is
"CODE: server message"; text that cannot be sent at all (lone surrogates, NUL) is rejected locally with
InvalidRequestError before any network traffic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import generation_pb2_grpc as pb_grpc
from pdllm.shared.decode_policy_settings import DecodePolicySettings
from pdllm.shared.rpc.errors import PdllmError, error_from_rpc
from pdllm.shared.rpc.validation import check_text
from pdllm.shared.settings import GenerationSettings, MethodSettings


@dataclass(frozen=True)
class ClientTls:
    root_cert_path: Path | None = None  # None: the system trust store
    server_name: str | None = None  # overrides the name checked against the certificate


def build_generate_request(
    context: str,
    question: str,
    *,
    instruction: str | None = None,
    request_id: str = "",
    model: str = "",
    **values: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest with only the given settings set; the others (None or "") take server defaults.
    ``values`` are the settings of ``shared/settings.py`` (``gen_length=16``, ``kv_mode="chunk-only"``,
    ``decode_policy="dual-cache"``)."""
    groups = {
        "generation": GenerationSettings.model_fields,
        "method": MethodSettings.model_fields,
        "decode_policy": DecodePolicySettings.model_fields,
    }
    unknown = sorted(set(values) - {name for names in groups.values() for name in names})
    if unknown:
        raise TypeError(f"build_generate_request() got unexpected keyword argument(s) {unknown}")
    texts = {"context": context, "question": question, "request_id": request_id, "model": model}
    texts |= {k: v for k, v in values.items() if isinstance(v, str)}
    if instruction is not None:
        texts["instruction"] = instruction
    for field, value in texts.items():
        check_text(field, value)
    given = {
        g: {k: v for k, v in values.items() if k in names and v not in (None, "")}
        for g, names in groups.items()
    }
    return pb.GenerateRequest(
        request_id=request_id,
        model=model,
        context=context,
        question=question,
        instruction=instruction,
        generation=pb.GenerationParams(**given["generation"]),
        method=pb.MethodParams(**given["method"]),
        decode_policy=pb.DecodePolicyParams(**given["decode_policy"]),
    )


class PdllmClient:
    """Blocking client; use as a context manager or call close()."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls: ClientTls | bool | None = None,
        timeout_s: float | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls:
            spec = tls if isinstance(tls, ClientTls) else ClientTls()
            roots = Path(spec.root_cert_path).read_bytes() if spec.root_cert_path else None
            if spec.server_name:
                options.append(("grpc.ssl_target_name_override", spec.server_name))
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots), options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout_s = timeout_s

    def generate(
        self, context: str, question: str, *, timeout_s: float | None = None, **params: object
    ) -> pb.GenerateResponse:
        """Run one request; `params` are build_generate_request's keyword arguments."""
        return self.generate_request(build_generate_request(context, question, **params), timeout_s=timeout_s)

    def generate_request(
        self, request: pb.GenerateRequest, *, timeout_s: float | None = None
    ) -> pb.GenerateResponse:
        try:
            return self._stub.Generate(request, timeout=timeout_s or self._timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise _with_request_id(error_from_rpc(err), request.request_id) from None

    def generate_stream(
        self, context: str, question: str, *, timeout_s: float | None = None, **params: object
    ) -> Iterator[pb.GenerateStreamResponse]:
        """Yield partial outputs then the final message; closing the iterator early cancels the call."""
        request = build_generate_request(context, question, **params)
        return self.stream_request(request, timeout_s=timeout_s)

    def stream_request(
        self, request: pb.GenerateRequest, *, timeout_s: float | None = None
    ) -> Iterator[pb.GenerateStreamResponse]:
        call = self._stub.GenerateStream(
            request, timeout=timeout_s or self._timeout_s, metadata=self._metadata
        )
        try:
            yield from call
        except grpc.RpcError as err:
            raise _with_request_id(error_from_rpc(err), request.request_id) from None
        finally:
            call.cancel()  # no-op once finished; cancels the server-side work if the caller stopped early

    def health(self, service: str = "", timeout_s: float = 5.0) -> str:
        """The server's health status name for `service` ("SERVING", "NOT_SERVING", ...)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdllmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_request_id(err: PdllmError, request_id: str) -> PdllmError:
    err.request_id = request_id or None
    return err
