"""``serve``'s KV handoff wiring: flags, the prefill worker's sender, the decode worker's receiver
(``pdllm.shared.kv_transfer``). The prefill worker's decode-KV build is the decode worker's
``build_selected`` (same kernels, so the same KV). In ``--role all`` nothing is handed off: both workers
share a device.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

# torch (through pdllm.shared.kv_transfer) is imported only when a worker starts: `serve --help` stays fast.


def add_handoff_arguments(p: argparse.ArgumentParser, env: Callable[..., Any]) -> None:
    """``env(flag, default, convert)``: the flag's default from its PDLLM_ variable."""
    h = p.add_argument_group("KV handoff (split prefill / decode workers)")
    h.add_argument(
        "--build-on",
        choices=["auto", "decode", "prefill"],
        default=env("--build-on", "auto"),
        help="router: where a pdllm request's decode KV is built; 'prefill' hands it to the decode worker, "
        "'auto' does so while the decode worker is busy and the prefill worker is not (--role all: decode)",
    )
    h.add_argument(
        "--kv-transfer-backend",
        choices=["auto", "gloo", "nccl", "cuda-ipc"],
        help="how decode workers pull handed-off KV: 'auto' = CUDA IPC from a prefill worker on the same host "
        "(one container or pod), NCCL from another, Gloo without CUDA",
        default=env("--kv-transfer-backend", "auto"),
    )
    h.add_argument(
        "--kv-transfer-host",
        default=env("--kv-transfer-host", ""),
        help="address KV transfers bind and advertise (default: --host, or this host's address when "
        "--host listens on all interfaces)",
    )
    h.add_argument(
        "--kv-transfer-port",
        type=int,
        default=env("--kv-transfer-port", 0, int),
        help="prefill: port of the KV transfer rendezvous store (0: any free port)",
    )
    h.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=env("--kv-transfer-timeout", 10.0, float),
        help="seconds a KV pull may take before the decode worker builds the KV itself",
    )
    h.add_argument(
        "--kv-handoff-bytes",
        type=int,
        default=env("--kv-handoff-bytes", 4 << 30, int),
        help="prefill: KV held for decode workers to pull at once (beyond: the decode worker builds)",
    )


def transfer_config(args: argparse.Namespace) -> Any:
    from pdllm.shared.kv_transfer import TransferConfig

    host = args.kv_transfer_host or args.host
    try:
        unspecified = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name
        unspecified = False
    if unspecified:  # listening everywhere: advertise the address other pods reach this one at
        host = socket.gethostbyname(socket.gethostname())
    return TransferConfig(args.kv_transfer_backend, host, args.kv_transfer_port, args.kv_transfer_timeout)


def make_sender(args: argparse.Namespace, device: Any, registry: CollectorRegistry) -> Any:
    from pdllm.shared.kv_transfer import KvSender, SenderConfig

    config = SenderConfig(transfer_config(args), max_bytes=args.kv_handoff_bytes)
    return KvSender(config, device, registry)


def make_receiver(
    args: argparse.Namespace, device: Any, channel: Callable[[str], Any], registry: CollectorRegistry
) -> Any:
    from pdllm.decode_service.kv_receiver import KvReceiver

    return KvReceiver(transfer_config(args), channel, device, registry)
