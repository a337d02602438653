"""The receiving side of a KV handoff: a decode worker pulls the KV a prefill worker holds for a request.

:meth:`KvReceiver.start` returns a :class:`Transfer` at once and pulls on a thread of its own: open (or
reuse) a two-rank group with the sender (``KvTransfer.Connect``, ``shared/kv_transfer/pairs.py``), ask it to send
(``KvTransfer.Send``), receive onto this worker's device: a decode KV given a :class:`PageTarget` (the
request's reserved pool pages) lands straight in them (``shared/kv_transfer/pages.py`` says how and when a buffer is still
needed), anything else in a new tensor (``Transfer.kv``). The transfer goes WAITING ->
TRANSFERRING -> DONE, or FAILED with the reason (sender gone, offer expired, timeout); the caller then builds
the KV itself. A failure drops the group with that sender (the next pull opens a new one). Pulls from one
sender run one at a time (its point-to-point ops are ordered); pulls from different senders in parallel.
From a sender on the same host, a CUDA receiver skips the group: it maps the sender's KV through CUDA IPC
(``shared/kv_transfer/cuda_ipc.py``), copies it (into the pages, for a decode KV with a target) and tells the sender to
``Release`` it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.kv_transfer import cuda_ipc
from pdllm.shared.kv_transfer.pages import PageTarget, slabs, tiled_shape, untile, wire_shape
from pdllm.shared.kv_transfer.pairs import PairGroup, TransferConfig, connect_store
from pdllm.shared.kv_transfer.payload import DECODE_KV

_log = logging.getLogger("pdllm.kv_transfer.receiver")


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Transfer:
    """One pull. ``target``: where a decode KV lands (then ``landed`` says it did and ``kv`` stays None);
    without one, ``kv`` is the pulled KV (``[layers, 2, Hkv, T, D]``). ``staged_bytes``: bytes that went
    through a buffer on this side (a staging tensor, a slab buffer, Gloo's host bounce), 0 when the KV was
    received or copied straight into its pages."""

    handoff: wpb.KvHandoff
    target: PageTarget | None = None
    state: TransferState = TransferState.WAITING
    kv: torch.Tensor | None = None
    landed: bool = False
    staged_bytes: int = 0
    error: str = ""
    seconds: float = 0.0
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _claimed: bool = field(default=False, repr=False)  # the pull has started: it may write the target
    _detached: bool = field(default=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def detach(self) -> bool:
        """Give the target pages back (the request was cancelled). True when nothing writes into them any
        more (the pull has not started, and now never will, or it has finished): the caller may free them.
        False while the pull may still write into them: free them once it has finished."""
        with self._lock:
            if self.finished or not self._claimed or self.target is None:
                self._detached = True
                return True
            return False

    def _claim(self) -> None:
        with self._lock:
            if self._detached:
                raise RuntimeError("the pull was cancelled before it started")
            self._claimed = True


@dataclass
class _Peer:
    lock: threading.Lock = field(default_factory=threading.Lock)
    group: PairGroup | None = None
    epoch: int = 0


class KvReceiver:
    """``channel``: makes a gRPC channel to a sender's address (the workers' token and TLS)."""

    def __init__(
        self,
        config: TransferConfig,
        channel: Callable[[str], grpc.Channel],
        device: torch.device,
        registry: CollectorRegistry | None = None,
        max_parallel: int = 4,
    ) -> None:
        self.config = config
        self.device = device
        self.receiver_id = f"decode-{uuid.uuid4().hex[:12]}"
        self.host_id = cuda_ipc.host_id()
        self._channel = channel
        self._stubs: dict[str, workers_pb2_grpc.KvTransferStub] = {}
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="kv-recv")
        self.outcomes = Counter(
            "pdllm_kv_handoff_pulls",
            "KV handoff pulls by outcome (done, failed)",
            ["outcome"],
            registry=registry,
        )
        self.staged = Counter(
            "pdllm_kv_handoff_staged_bytes",
            "Pulled KV bytes that went through a buffer before their place (0 for a decode KV received "
            "straight into its pool pages)",
            registry=registry,
        )
        self.seconds = Histogram(
            "pdllm_kv_handoff_seconds",
            "Wall time of one KV handoff pull",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=registry,
        )

    def start(self, handoff: wpb.KvHandoff, target: PageTarget | None = None) -> Transfer:
        """Pull ``handoff`` on a thread of this receiver; a decode-kv payload lands in ``target``'s pages
        when given (they must stay reserved until the transfer has finished or :meth:`Transfer.detach`
        said so)."""
        transfer = Transfer(handoff, target)
        self._pool.submit(self._pull, transfer)
        return transfer

    def _pull(self, transfer: Transfer) -> None:
        h = transfer.handoff
        start = time.perf_counter()
        try:
            dtype = getattr(torch, h.dtype, None)
            if not isinstance(dtype, torch.dtype) or len(h.shape) != 5 or not h.sender:
                raise ValueError(f"malformed KV handoff (dtype {h.dtype!r}, shape {list(h.shape)})")
            transfer._claim()
            target = transfer.target if h.payload == DECODE_KV else None
            if target is not None and not target.fits(tuple(h.shape), dtype):
                raise ValueError(f"a decode KV of shape {list(h.shape)} does not fit its reserved pages")
            if self.config.cuda_ipc(self.device) and h.host_id == self.host_id:
                transfer.state = TransferState.TRANSFERRING
                self._map(h, dtype, transfer, target)
            else:
                self._receive(h, dtype, transfer, target)
            self.staged.inc(transfer.staged_bytes)
            transfer.state = TransferState.DONE
            self.outcomes.labels("done").inc()
        except Exception as exc:  # the caller rebuilds the KV; say why once
            transfer.error = _describe(exc)
            transfer.state = TransferState.FAILED
            self.outcomes.labels("failed").inc()
            _log.warning("KV handoff %s from %s failed: %s", h.transfer_id, h.sender, transfer.error)
        finally:
            transfer.seconds = time.perf_counter() - start
            self.seconds.observe(transfer.seconds)
            transfer._done.set()

    def _receive(
        self, h: wpb.KvHandoff, dtype: torch.dtype, transfer: Transfer, target: PageTarget | None
    ) -> None:
        """Over the pair group with the sender (opened on first use, dropped when a pull fails)."""
        if h.backend != self.config.resolve_backend(self.device):
            raise ValueError(f"sender uses backend {h.backend!r}, this worker {self.config.backend!r}")
        peer = self._peer(h.sender)
        with peer.lock:
            group = self._connect(h.sender, peer)
            request = wpb.KvSendRequest(
                transfer_id=h.transfer_id, receiver_id=self.receiver_id, epoch=peer.epoch
            )
            try:
                self._stub(h.sender).Send(request, timeout=self.config.timeout_s)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # expired offers leave the group usable
                    self._drop(peer)
                raise
            transfer.state = TransferState.TRANSFERRING
            try:
                self._recv(group, h, dtype, transfer, target)
            except Exception:
                self._drop(peer)
                raise

    def _recv(
        self,
        group: PairGroup,
        h: wpb.KvHandoff,
        dtype: torch.dtype,
        transfer: Transfer,
        target: PageTarget | None,
    ) -> None:
        if h.payload != DECODE_KV:  # chunk KV: one message, the build's input
            transfer.kv = group.recv(tuple(h.shape), dtype, self.device)
            transfer.staged_bytes = transfer.kv.nbytes
            return
        shape = tiled_shape(h.shape)
        if target is None:
            tiles = torch.empty(shape, dtype=dtype, device=self.device)
            transfer.staged_bytes = group.recv_into(slabs(tiles)) + tiles.nbytes
            transfer.kv = untile(tiles, h.shape[3])
            return
        dests = [target.slab(layer, kv, shape[2]) for layer in range(shape[0]) for kv in range(shape[1])]
        if all(d is not None for d in dests):  # consecutive pages: every slab is one piece of the pool
            transfer.staged_bytes = group.recv_into(dests)  # type: ignore[arg-type]
        else:  # scattered pages: each slab through one buffer, scattered before the next one lands
            buf = torch.empty(shape[2:], dtype=dtype, device=self.device)
            staged = group.recv_into([buf] * len(dests), lambda i: target.write_slab(*divmod(i, 2), buf))
            transfer.staged_bytes = staged + buf.nbytes * len(dests)
        transfer.landed = True

    def _map(
        self, h: wpb.KvHandoff, dtype: torch.dtype, transfer: Transfer, target: PageTarget | None
    ) -> None:
        """Through CUDA IPC: the sender lends its memory, this side copies out of it and releases it."""
        stub = self._stub(h.sender)
        timeout = self.config.timeout_s
        reply = stub.Send(wpb.KvSendRequest(transfer_id=h.transfer_id, cuda_ipc=True), timeout=timeout)
        try:
            with cuda_ipc.mapped(reply.cuda_ipc, wire_shape(h), dtype, self.device) as shared:
                if target is not None:
                    target.write(shared)
                    transfer.landed = True
                    return
                transfer.kv = untile(shared, h.shape[3]) if h.payload == DECODE_KV else shared.clone()
                transfer.staged_bytes = transfer.kv.nbytes
        finally:
            stub.Release(wpb.KvReleaseRequest(transfer_id=h.transfer_id), timeout=timeout)

    def _peer(self, sender: str) -> _Peer:
        with self._lock:
            return self._peers.setdefault(sender, _Peer())

    def _stub(self, sender: str) -> workers_pb2_grpc.KvTransferStub:
        with self._lock:
            if sender not in self._stubs:
                self._stubs[sender] = workers_pb2_grpc.KvTransferStub(self._channel(sender))
            return self._stubs[sender]

    def _connect(self, sender: str, peer: _Peer) -> PairGroup:
        if peer.group is not None:
            return peer.group
        reply = self._stub(sender).Connect(
            wpb.KvConnectRequest(receiver_id=self.receiver_id), timeout=self.config.timeout_s
        )
        host = sender.rsplit(":", 1)[0].strip("[]")
        store = connect_store(host, reply.store_port, self.config)
        peer.group = PairGroup(store, f"{self.receiver_id}/{reply.epoch}", 1, reply.backend, self.config)
        peer.epoch = reply.epoch
        return peer.group

    def _drop(self, peer: _Peer) -> None:
        if peer.group is not None:
            peer.group.close()
        peer.group, peer.epoch = None, 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for peer in self._peers.values():
                self._drop(peer)


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"
