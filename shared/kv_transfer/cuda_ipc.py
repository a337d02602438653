"""CUDA IPC for a handoff between processes of one host: the sender shares the KV's CUDA allocation (torch's
own storage sharing, as ``torch.multiprocessing`` does), the receiver maps it and copies it into its own
memory (for a decode KV: straight into the reserved pool pages); no bytes go through the host or a socket.
Faster than any send on one host (one device-to-device copy: same GPU, or peer-to-peer over NVLink / PCIe
between two), and it works where NCCL cannot: two processes on one GPU. Only between processes that see
each other's CUDA allocations (one host, one container or IPC namespace); :func:`host_id` tells the
receiver when that is the case.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

from pdllm.protos.pdllm.v1 import workers_pb2 as wpb


def host_id() -> str:
    """Same value in two processes only when they share a host and a hostname (a container or pod)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def share(kv: torch.Tensor) -> wpb.CudaIpcHandle:
    """A handle to contiguous CUDA tensor ``kv``'s memory (valid while the sender keeps ``kv``)."""
    storage = kv.untyped_storage()
    _, handle, size, offset, rc_handle, rc_offset, event, event_sync = storage._share_cuda_()  # type: ignore[attr-defined]
    return wpb.CudaIpcHandle(
        handle=handle,
        storage_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=rc_handle,
        ref_counter_offset=rc_offset,
        event_handle=event or b"",
        event_sync_required=event_sync,
        tensor_offset=kv.storage_offset(),
    )


@contextlib.contextmanager
def mapped(
    h: wpb.CudaIpcHandle, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Iterator[torch.Tensor]:
    """The sender's tensor behind ``h``, mapped into this process for the block: copy out of it inside (into
    pool pages, or a new tensor); the copies are synchronized before the mapping is dropped."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
        device.index if device.index is not None else torch.cuda.current_device(),
        h.handle,
        h.storage_bytes,
        h.storage_offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle or None,
        h.event_sync_required,
    )
    stride = torch.empty(shape, device="meta").stride()
    shared = torch.empty((0,), dtype=dtype, device=device).set_(storage, h.tensor_offset, shape, stride)
    try:
        yield shared
    finally:
        torch.cuda.synchronize(device)  # the sender may reuse its memory once this side released it
        del shared, storage  # drops the mapping (and torch's IPC reference count)
