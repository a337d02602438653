"""The sending side of a KV handoff: a prefill worker holds a request's KV until a decode worker pulls it.

:meth:`KvSender.offer` keeps a tensor under a new transfer id (within a byte budget; offers expire after
``ttl_s`` unless pulled) and returns the :class:`~pdllm.protos.pdllm.v1.workers_pb2.KvHandoff` that the
prefill response carries. The sender serves ``pdllm.v1.KvTransfer`` on the prefill worker's gRPC port:
``Connect`` opens a two-rank group with the calling receiver (``pairs.py``), ``Send`` posts the send of one
offer over it. Each pair has one thread, so sends to one receiver go out in the order they were asked for;
an offer is sent at most once and dropped as soon as its send was posted. A receiver on the same host may
ask for a CUDA IPC handle instead (``cuda_ipc.py``): the offer is then lent until the receiver's
``Release`` (or its TTL), since the receiver copies straight out of this process's memory. A decode KV is
held in page tiles and sent as one message per layer and K/V, so that the receiver can land it straight in
its pool pages (``pages.py``).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.kv_transfer import cuda_ipc
from pdllm.shared.kv_transfer.pages import slabs, tiled_shape, to_tiles
from pdllm.shared.kv_transfer.pairs import PairGroup, TransferConfig, serve_store
from pdllm.shared.kv_transfer.payload import DECODE_KV, dtype_name
from pdllm.shared.rpc.errors import PdllmError

_log = logging.getLogger("pdllm.kv_transfer.sender")


@dataclass(frozen=True)
class SenderConfig:
    """``max_bytes``: KV held for pulls at once (an offer beyond it is declined: the decode worker builds).
    ``ttl_s``: an offer nobody pulled within this time is dropped."""

    transfer: TransferConfig = field(default_factory=TransferConfig)
    max_bytes: int = 4 << 30
    ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.ttl_s <= 0:
            raise ValueError("KV handoff budget must be >= 0 bytes and its TTL positive")


@dataclass
class _Offer:
    kv: torch.Tensor
    expires: float


@dataclass
class _Pair:
    epoch: int
    thread: ThreadPoolExecutor
    group: Future  # Future[PairGroup], set up on the pair's thread


class KvSender(workers_pb2_grpc.KvTransferServicer):
    def __init__(
        self, config: SenderConfig, device: torch.device, registry: CollectorRegistry | None = None
    ) -> None:
        self.config = config
        self.backend = config.transfer.resolve_backend(device)
        self._offers: dict[str, _Offer] = {}
        self._lent: dict[str, _Offer] = {}  # shared through CUDA IPC, until Release
        self._held = 0
        self._pairs: dict[str, _Pair] = {}
        self._ids = itertools.count(1)
        self._epochs = itertools.count(1)
        self._lock = threading.Lock()
        self._store, self.store_port = serve_store(config.transfer)
        self.host_id = cuda_ipc.host_id()
        self.outcomes = Counter(
            "pdllm_kv_handoff_offers",
            "KV handoff offers by outcome (sent, lent through CUDA IPC, declined over budget, expired, failed)",
            ["outcome"],
            registry=registry,
        )
        Gauge("pdllm_kv_handoff_held_bytes", "KV held for handoff pulls", registry=registry).set_function(
            lambda: self._held
        )

    # ------------------------------------------------------------------ prefill side
    def offer(self, kv: torch.Tensor, handoff: wpb.KvHandoff) -> wpb.KvHandoff | None:
        """Hold ``kv`` for one pull; ``handoff`` carries the payload fields. None when over budget. A
        decode-kv payload is held in page tiles (``pages.py``), the layout it lands in on the decode side."""
        tiled = handoff.payload == DECODE_KV and kv.dim() == 5
        held_shape = tiled_shape(kv.shape) if tiled else tuple(kv.shape)
        held = math.prod(held_shape) * kv.element_size()
        with self._lock:
            self._expire(time.monotonic())
            if self._held + held > self.config.max_bytes:
                self.outcomes.labels("declined").inc()
                return None
            self._held += held  # booked before the copy below, so concurrent offers see it
        try:
            wire = to_tiles(kv) if tiled else kv.contiguous()
            if wire.is_cuda:  # the bytes are complete before anyone (a CUDA IPC reader) is told about them
                torch.cuda.current_stream(wire.device).synchronize()
        except Exception:
            with self._lock:
                self._held -= held
            raise
        with self._lock:
            transfer_id = f"{next(self._ids)}-{time.time_ns()}"
            self._offers[transfer_id] = _Offer(wire, time.monotonic() + self.config.ttl_s)
        out = wpb.KvHandoff()
        out.CopyFrom(handoff)
        out.transfer_id, out.backend, out.nbytes = transfer_id, self.backend, kv.numel() * kv.element_size()
        out.shape[:] = list(kv.shape)
        out.dtype = dtype_name(kv.dtype)
        out.host_id = self.host_id
        return out

    @property
    def held_bytes(self) -> int:
        return self._held

    def _take(self, transfer_id: str, table: dict[str, _Offer] | None = None) -> _Offer | None:
        offer = (self._offers if table is None else table).pop(transfer_id, None)
        if offer is not None:
            self._held -= offer.kv.numel() * offer.kv.element_size()
        return offer

    def _expire(self, now: float) -> None:
        for table in (self._offers, self._lent):
            for tid in [t for t, o in table.items() if o.expires <= now]:
                self._take(tid, table)
                self.outcomes.labels("expired").inc()

    # ------------------------------------------------------------------ KvTransfer service
    def Connect(self, request: wpb.KvConnectRequest, context: grpc.ServicerContext) -> wpb.KvConnectResponse:
        rid = request.receiver_id
        if not rid:
            raise PdllmError("receiver_id must not be empty", code=grpc.StatusCode.INVALID_ARGUMENT)
        epoch = next(self._epochs)
        thread = ThreadPoolExecutor(1, thread_name_prefix="kv-send")
        group = thread.submit(PairGroup, self._store, f"{rid}/{epoch}", 0, self.backend, self.config.transfer)
        with self._lock:
            old = self._pairs.pop(rid, None)
            self._pairs[rid] = _Pair(epoch, thread, group)
        if old is not None:
            self._close_pair(old)
        return wpb.KvConnectResponse(store_port=self.store_port, epoch=epoch, backend=self.backend)

    def Send(self, request: wpb.KvSendRequest, context: grpc.ServicerContext) -> wpb.KvSendResponse:
        if request.cuda_ipc:
            return self._lend(request.transfer_id)
        with self._lock:
            self._expire(time.monotonic())
            pair = self._pairs.get(request.receiver_id)
            if pair is None or pair.epoch != request.epoch:
                raise PdllmError(
                    "no open KV transfer group for this receiver (Connect first)",
                    code=grpc.StatusCode.FAILED_PRECONDITION,
                )
            offer = self._take(request.transfer_id)
        if offer is None:
            raise _not_held(request.transfer_id)
        pair.thread.submit(self._send, pair, offer, request.receiver_id)
        return wpb.KvSendResponse()

    def _lend(self, transfer_id: str) -> wpb.KvSendResponse:
        with self._lock:
            self._expire(time.monotonic())
            offer = self._offers.get(transfer_id)
            if offer is None:
                raise _not_held(transfer_id)
            if not offer.kv.is_cuda:
                self._take(transfer_id)
                raise PdllmError(
                    "CUDA IPC needs KV on a CUDA device", code=grpc.StatusCode.FAILED_PRECONDITION
                )
            self._lent[transfer_id] = self._offers.pop(
                transfer_id
            )  # still held: the receiver reads our memory
        self.outcomes.labels("lent").inc()
        return wpb.KvSendResponse(cuda_ipc=cuda_ipc.share(offer.kv))

    def Release(self, request: wpb.KvReleaseRequest, context: grpc.ServicerContext) -> wpb.KvReleaseResponse:
        with self._lock:
            self._take(request.transfer_id, self._lent)
        return wpb.KvReleaseResponse()

    def _send(self, pair: _Pair, offer: _Offer, receiver_id: str) -> None:
        try:
            # A tiled payload goes as its 2 * layers slabs: each lands in its own piece of the pool.
            pair.group.result().send(slabs(offer.kv) if offer.kv.dim() == 6 else offer.kv)
            self.outcomes.labels("sent").inc()
        except Exception as exc:  # the receiver times out and rebuilds; this pair is done for
            self.outcomes.labels("failed").inc()
            _log.warning("KV handoff send to %s failed: %s", receiver_id, exc)
            with self._lock:
                if self._pairs.get(receiver_id) is pair:
                    del self._pairs[receiver_id]
            self._close_pair(pair, wait=False)

    def _close_pair(self, pair: _Pair, wait: bool = False) -> None:
        def close() -> None:
            if pair.group.done() and pair.group.exception() is None:
                pair.group.result().close()

        pair.group.add_done_callback(lambda _: close())
        pair.thread.shutdown(wait=wait, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
            self._offers.clear()
            self._lent.clear()
            self._held = 0
        for pair in pairs:
            self._close_pair(pair)


def _not_held(transfer_id: str) -> PdllmError:
    return PdllmError(
        f"KV handoff {transfer_id!r} is not held here (expired or already pulled)",
        code=grpc.StatusCode.NOT_FOUND,
    )
