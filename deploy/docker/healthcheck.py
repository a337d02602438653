"""Exec probe for pdllm pods that serve gRPC over TLS (the kubelet's built-in gRPC probe speaks plaintext only).

    python /opt/pdllm/bin/healthcheck.py --ca /etc/pdllm/tls/ca.crt --server-name pdllm-worker.internal

Calls grpc.health.v1.Health/Check on 127.0.0.1:$PDLLM_PORT (default 50051) and exits 0 when the answer is
SERVING, 1 otherwise (NOT_SERVING, unknown service, no answer within --timeout), with one line on stderr.
Without --ca it checks over plaintext, like the kubelet's probe.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=int(os.environ.get("PDLLM_PORT", "50051")))
    p.add_argument("--service", default="", help='health service name ("" = the whole server)')
    p.add_argument(
        "--ca", default=None, help="PEM CA bundle that signed the server certificate (enables TLS)"
    )
    p.add_argument("--server-name", default=None, help="name to verify the certificate against")
    p.add_argument("--timeout", type=float, default=3.0)
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> tuple[bool, str]:
    target = f"127.0.0.1:{args.port}"
    if args.ca:
        try:
            with open(args.ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        except OSError as exc:
            return False, f"cannot read CA bundle {args.ca}: {exc.strerror}"
        options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            return False, f"{target}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: list[str] | None = None) -> int:
    ok, message = check(parse_args(sys.argv[1:] if argv is None else argv))
    print(message, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
