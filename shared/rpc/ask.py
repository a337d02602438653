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

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.shared import settings, settings_flags
from pdllm.shared.cli_args import Parser
from pdllm.shared.rpc.client import ClientTls, PdllmClient, build_generate_request
from pdllm.shared.rpc.errors import InvalidRequestError, PdllmError
from pdllm.shared.rpc.trace_format import message_json, summary

EXIT_SERVER_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pdllm ask",
        usage="%(prog)s (--context-file FILE | --context TEXT) --question TEXT [--server HOST:PORT] [FLAG ...]",
        description="pdllm ask: ask a running server a question about a (long) context.",
    )
    c = p.add_argument_group("server")
    c.add_argument(
        "--server",
        default=os.environ.get("PDLLM_SERVER", "127.0.0.1:50051"),
        help="host:port of the router (or the all-in-one server) (env PDLLM_SERVER; default %(default)s)",
    )
    c.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    c.add_argument(
        "--token-file", type=Path, default=None, help="file holding the bearer token (else $PDLLM_AUTH_TOKEN)"
    )
    c.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca)")
    c.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate(s) to trust")
    c.add_argument(
        "--tls-server-name", default=None, help="name to check the server certificate against (default: host)"
    )
    r = p.add_argument_group("request")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="UTF-8 text file holding the context")
    src.add_argument("--context", help="the context itself")
    r.add_argument("--question", required=True, help="the question to answer about the context")
    r.add_argument("--instruction", default=None, help="optional instruction before the context")
    r.add_argument("--model", default="", help="model name (default: the server's model)")
    r.add_argument(
        "--request-id", default="", help="id for the server's logs (default: the server makes one)"
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--stream",
        action="store_true",
        help="show the answer on stderr as it unmasks (one line redrawn on a terminal, a line per step when "
        "piped)",
    )
    o.add_argument(
        "--json",
        action="store_true",
        help="print the response as one JSON object, in the fields of pdllm.v1.GenerateResponse "
        "(what `pdllm generate --json` prints)",
    )
    settings_flags.add_arguments(
        p.add_argument_group("generation"), settings.GenerationSettings, unset="the server's"
    )
    settings_flags.add_arguments(
        p.add_argument_group("method"), settings.MethodSettings, unset="the server's"
    )
    settings_flags.add_arguments(
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


def _progress(part: pb.PartialOutput, terminal: bool) -> None:
    """One partial answer on stderr: redrawn in place on a terminal, a plain line otherwise."""
    line = f"[step {part.step}/{part.total_steps}] {part.text}"
    if terminal:
        sys.stderr.write("\r\x1b[K" + line)
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


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
            terminal = sys.stderr.isatty()
            try:
                for message in client.stream_request(request, timeout_s=args.timeout):
                    if message.HasField("partial"):
                        _progress(message.partial, terminal)
                    else:
                        final = message.final
            finally:
                if terminal:  # end the redrawn line, also before an error message
                    sys.stderr.write("\n")
            if final is None:
                raise PdllmError("the server ended the stream without a final message")
        else:
            final = client.generate_request(request, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(message_json(final)))
    else:
        print(final.text)
        print(summary(final.trace), file=sys.stderr)
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
