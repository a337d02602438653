"""`pdllm ask`: send one long-context question to a running server and print the answer and its trace.

The answer goes to stdout; partial outputs (--stream) and the trace summary go to stderr, so the answer
can be piped. Failures print one `error: ...` line: exit 1 for errors the server reported (the gRPC code
and its message), 2 for bad local input (unreadable files, text that cannot be sent).
The auth token is read from $PDLLM_AUTH_TOKEN or --token-file, never from a flag (flags leak into `ps`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from google.protobuf import json_format

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared import settings
from pdllm.shared.rpc.client import ClientTls, PdllmClient, build_generate_request
from pdllm.shared.rpc.errors import InvalidRequestError, PdllmError

EXIT_SERVER_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdllm ask", description="Ask a running pdllm server a question.")
    p.add_argument("--server", default=os.environ.get("PDLLM_SERVER", "127.0.0.1:50051"), help="host:port")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="UTF-8 text file holding the context")
    src.add_argument("--context", help="the context itself")
    p.add_argument("--question", required=True)
    p.add_argument("--instruction", default=None)
    p.add_argument("--model", default="", help="model name (default: the server's default)")
    p.add_argument("--request-id", default="")
    p.add_argument("--stream", action="store_true", help="print partial answers to stderr as they unmask")
    p.add_argument("--json", action="store_true", help="print the final response as one JSON object")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds (default 600)")
    p.add_argument("--token-file", type=Path, default=None, help="file holding the bearer token")
    p.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca)")
    p.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate(s) to trust")
    p.add_argument("--tls-server-name", default=None, help="name to check the server certificate against")
    settings.add_arguments(
        p.add_argument_group("generation"), settings.GenerationSettings, unset="the server's"
    )
    settings.add_arguments(p.add_argument_group("method"), settings.MethodSettings, unset="the server's")
    settings.add_arguments(
        p.add_argument_group("decode policy"), settings.DecodePolicySettings, unset="the server's"
    )
    return p


_REQUEST_ARGS = ["instruction", "request_id", "model"]
_REQUEST_ARGS += [*settings.GenerationSettings.model_fields, *settings.MethodSettings.model_fields]
_REQUEST_ARGS += list(settings.DecodePolicySettings.model_fields)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: {what} is not valid UTF-8 ({err.reason} at byte {err.start})") from None


def _summary(final: pb.GenerateResponse) -> str:
    trace = final.trace
    timings = json_format.MessageToDict(trace.timings, preserving_proto_field_name=True)
    parts = [
        f"method {trace.method or '?'}",
        f"prompt tokens {trace.prompt_tokens}",
        f"chunks {trace.num_chunks}, selected {list(trace.selected_chunk_ids)}",
        f"cache hits {trace.cache_hits}, misses {trace.cache_misses}",
        f"steps {trace.steps}",
        f"decode policy {trace.decode_policy.policy or '?'}",
        "timings " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items()),
    ]
    return "trace: " + "; ".join(parts)


def _run(args: argparse.Namespace) -> int:
    context = args.context if args.context is not None else _read_text(args.context_file, "context")
    token = (
        _read_text(args.token_file, "token").strip()
        if args.token_file
        else os.environ.get("PDLLM_AUTH_TOKEN")
    )
    tls: ClientTls | None = None
    if args.tls or args.tls_ca or args.tls_server_name:
        tls = ClientTls(root_cert_path=args.tls_ca, server_name=args.tls_server_name)
    request = build_generate_request(context, args.question, **{k: getattr(args, k) for k in _REQUEST_ARGS})
    with PdllmClient(args.server, token=token or None, tls=tls) as client:
        if args.stream:
            final = None
            for message in client.stream_request(request, timeout_s=args.timeout):
                if message.HasField("partial"):
                    part = message.partial
                    print(f"[step {part.step}/{part.total_steps}] {part.text}", file=sys.stderr, flush=True)
                else:
                    final = message.final
            if final is None:
                raise PdllmError("the server ended the stream without a final message")
        else:
            final = client.generate_request(request, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(json_format.MessageToDict(final, preserving_proto_field_name=True)))
    else:
        print(final.text)
        print(_summary(final), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _run(args)
    except InvalidRequestError as err:
        # Raised locally (before sending) when kind != "server"; otherwise the server rejected the request.
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE if err.kind != "server" else EXIT_SERVER_ERROR
    except PdllmError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
