"""A FakeGeneration server process for the SIGTERM drain test: prints its ports as one JSON line, serves
until SIGTERM/SIGINT, drains, prints the outcome and exits 0 if every call finished within the grace."""

from __future__ import annotations

import argparse
import json
import sys

from pdllm.shared.rpc.server import ServerConfig, build_server
from pdllm.shared.rpc.validation import ValidationLimits
from tests.rpc.fake_generation import MODEL, FakeGeneration, fake_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--step-delay", type=float, default=0.05)
    args = parser.parse_args(argv)
    servicer = FakeGeneration(limits=ValidationLimits(models=(MODEL,)), step_delay_s=args.step_delay)
    config = ServerConfig(role="drain-test", metrics_port=0, drain_grace_s=args.grace)
    server = build_server(config, [fake_spec(servicer)]).start()
    print(json.dumps({"port": server.port, "metrics_port": server.metrics_port}), flush=True)
    drained = server.serve_until_signal()
    print(json.dumps({"drained": drained, "completed_streams": servicer.completed_streams}), flush=True)
    return 0 if drained else 3


if __name__ == "__main__":
    sys.exit(main())
