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
from collections.abc import Callable, Sequence
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
    """A two-rank group: :meth:`send` on rank 0, :meth:`recv` / :meth:`recv_into` on rank 1. Blocking calls (run them on a
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

    def send(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Send ``tensors`` (one, or several as that many messages in order) to rank 1; returns once they
        have left this side. All are posted before the first wait: a tiled payload's slabs go out back to
        back, not one rendezvous at a time."""
        parts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if self.backend == "gloo":
            host = [t.contiguous().cpu() for t in parts]
            works = [self.group.send([t], 1, i) for i, t in enumerate(host)]
            for work in works:
                work.wait(self.timeout)
            return
        device = parts[0].device
        with torch.cuda.stream(self._cuda_stream(device)):
            torch.cuda.current_stream().wait_stream(torch.cuda.default_stream(device))
            works = [self.group.send([t.contiguous()], 1, i) for i, t in enumerate(parts)]
            works[-1].wait(self.timeout)  # one NCCL stream: the last one done means all are
            torch.cuda.current_stream().synchronize()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive one ``shape`` tensor from rank 0, onto ``device``; returns once it is there."""
        out = torch.empty(shape, dtype=dtype, device=device)
        self.recv_into([out])
        return out

    def recv_into(self, dests: Sequence[torch.Tensor], then: Callable[[int], None] | None = None) -> int:
        """Receive ``len(dests)`` messages from rank 0, message ``i`` into contiguous ``dests[i]`` (may be a
        view of a larger tensor, e.g. pool pages; one buffer may repeat when ``then(i)`` consumes it before
        message ``i + 1`` lands). Returns once all is in place, with the bytes that went through a host
        bounce buffer (Gloo onto a CUDA tensor: Gloo moves CPU tensors only)."""
        if self.backend == "gloo":
            staged = 0
            bounce: torch.Tensor | None = None
            for i, dest in enumerate(dests):
                if dest.device.type == "cpu":
                    self._recv_one(dest, i)
                else:
                    if bounce is None or bounce.shape != dest.shape:
                        bounce = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=True)
                    self._recv_one(bounce, i)
                    dest.copy_(bounce)  # synchronous: the bounce buffer takes the next message
                    staged += dest.numel() * dest.element_size()
                if then is not None:
                    then(i)
            return staged
        with torch.cuda.stream(self._cuda_stream(dests[0].device)):
            work = None
            for i, dest in enumerate(dests):
                # Each recv is queued behind this stream's work so far (the previous message's ``then``),
                # so a reused buffer is consumed before it is overwritten, with no host wait per message.
                work = self.group.recv([dest], 0, i)
                work.wait()
                if then is not None:
                    then(i)
            if work is not None:
                work.wait(self.timeout)  # one NCCL stream: the last one done means all are
            torch.cuda.current_stream().synchronize()
        return 0

    def _recv_one(self, dest: torch.Tensor, tag: int) -> None:
        self.group.recv([dest], 0, tag).wait(self.timeout)

    def _cuda_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken group must not raise
            self.group.abort() if self.backend == "nccl" else self.group.shutdown()
