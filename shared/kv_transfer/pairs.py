"""Point-to-point groups between one KV sender and one receiver, made from torch.distributed pieces.

A serving fleet has no fixed world: prefill and decode workers come and go. So there is no global
``init_process_group``; each (sender, receiver) pair gets its own two-rank process group (sender rank 0,
receiver rank 1), built directly from ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a ``TCPStore`` that
the sender hosts (one listening socket, one key prefix per pair and epoch). NCCL moves CUDA tensors
GPU-to-GPU (NVLink / PCIe / network, whatever NCCL finds); Gloo moves CPU tensors over TCP (a CUDA tensor is
staged through host memory). The point-to-point ops of a pair are ordered, so each side runs at most one
transfer per pair at a time (the sender's per-pair thread, the receiver's per-sender lock).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]
BACKENDS = ("auto", "gloo", "nccl", "cuda-ipc")


@dataclass(frozen=True)
class TransferConfig:
    """``backend``: "auto" (CUDA IPC from a sender on the same host, NCCL from another, Gloo without CUDA),
    "gloo", "nccl" or "cuda-ipc" (same host only; NCCL groups for other senders). ``host``: the address this
    side binds and advertises (the sender's TCPStore; Gloo's pair sockets on both sides). ``store_port``: the
    sender's TCPStore port (0: any free one). ``timeout_s``: how long a group setup or one transfer may take
    before it fails (the receiver then rebuilds the KV itself)."""

    backend: str = "auto"
    host: str = "127.0.0.1"
    store_port: int = 0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"KV transfer backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"KV transfer store port must be in [0, 65535], got {self.store_port}")
        if self.timeout_s <= 0:
            raise ValueError(f"KV transfer timeout must be positive, got {self.timeout_s}")

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def resolve_backend(self, device: torch.device) -> Backend:
        """The backend of this side's pair groups (CUDA IPC needs none)."""
        if self.backend in ("nccl", "cuda-ipc") and device.type != "cuda":
            raise ValueError(f"KV transfer backend {self.backend!r} needs a CUDA device")
        if self.backend in ("auto", "cuda-ipc"):
            return "nccl" if device.type == "cuda" else "gloo"
        return self.backend  # type: ignore[return-value]

    def cuda_ipc(self, device: torch.device) -> bool:
        """Whether this side uses CUDA IPC with senders on its host."""
        return device.type == "cuda" and self.backend in ("auto", "cuda-ipc")


def serve_store(config: TransferConfig) -> tuple[dist.TCPStore, int]:
    """The sender's TCPStore, listening on ``config.host`` only (TCPStore alone would listen everywhere)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.store_port))
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen for KV transfers on {config.host}:{config.store_port} ({exc.strerror}); "
            "pick another --kv-transfer-port"
        ) from exc
    sock.listen(64)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        config.host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=config.timeout,
        master_listen_fd=sock.detach(),
    )
    return store, port


def connect_store(host: str, port: int, config: TransferConfig) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=config.timeout)


class PairGroup:
    """A two-rank group: :meth:`send` on rank 0, :meth:`recv` on rank 1. Blocking calls (run them on a
    thread of their own); a failed call leaves the group unusable (make a new one)."""

    def __init__(
        self, store: dist.Store, prefix: str, rank: int, backend: Backend, config: TransferConfig
    ) -> None:
        self.backend = backend
        self.rank = rank
        prefixed = dist.PrefixStore(prefix, store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=config.host)]
            options._timeout = config.timeout
            self.group: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, 2, options)
        else:
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2)
        self.timeout = config.timeout
        self._stream: torch.cuda.Stream | None = None

    def send(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (contiguous) to rank 1; returns once it has left this side."""
        if self.backend == "gloo":
            self.group.send([tensor.contiguous().cpu()], 1, 0).wait(self.timeout)
            return
        with torch.cuda.stream(self._cuda_stream(tensor.device)):
            torch.cuda.current_stream().wait_stream(torch.cuda.default_stream(tensor.device))
            self.group.send([tensor.contiguous()], 1, 0).wait(self.timeout)
            torch.cuda.current_stream().synchronize()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive a ``shape`` tensor from rank 0, onto ``device``; returns once it is there."""
        if self.backend == "gloo":
            host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
            self.group.recv([host], 0, 0).wait(self.timeout)
            if device.type != "cuda":
                return host
            with torch.cuda.stream(self._cuda_stream(device)):
                out = host.to(device, non_blocking=True)
                torch.cuda.current_stream().synchronize()
            return out
        with torch.cuda.stream(self._cuda_stream(device)):
            out = torch.empty(shape, dtype=dtype, device=device)
            self.group.recv([out], 0, 0).wait(self.timeout)
            torch.cuda.current_stream().synchronize()
        return out

    def _cuda_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken group must not raise
            self.group.abort() if self.backend == "nccl" else self.group.shutdown()
