"""The prefill worker: ``pdllm.v1.Prefill`` over :class:`PrefillWorker`'s steps 3-5 (``worker.py``).

Chunk prefill reads chunk KV from the KV tier and computes the misses, then the chunks are scored and the
top-K selected; what the write policy keeps of the computed chunk KV (``--kv-write-policy``, default
"second-sight": the top-K, and the whole document once it comes back) is then handed to the tier's
background writer, where later requests find it. The worker answers
with handles (tier keys + token ids); the decode worker builds the decode KV from them. When the request
asks for a handoff (``offer_handoff``, the router's ``--build-on``), the worker also builds the decode KV
(chunk-only: keeps the selected chunks' KV) and its :class:`KvSender` holds it for the decode worker to
pull; the response's ``handoff`` says where (``handoff.py``, ``pdllm.shared.kv_transfer``). Concurrent requests
meet in the :class:`PrefillBatcher` queue and share batched chunk prefill forwards
(``--prefill-batch-requests``), in arrival order; one thread drives the device (the batcher's own, or in
``serve --role all`` the decode scheduler's, between decode rounds).
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import CancelledError

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdllm.prefill_service.batching import BatchingConfig, PrefillBatcher, PrefillMany
from pdllm.prefill_service.worker import PrefillWorker, Selection
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.config import EngineConfig
from pdllm.shared.kv_transfer.payload import model_kv_spec
from pdllm.shared.kv_transfer.sender import KvSender
from pdllm.shared.rpc.convert import engine_config, generation_config
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.rpc.logs import bind_request_id
from pdllm.shared.rpc.server import termination_event


class PrefillServicer(workers_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        worker: PrefillWorker,
        registry: CollectorRegistry | None = None,
        batching: BatchingConfig | None = None,
        run_batch: PrefillMany | None = None,
        sender: KvSender | None = None,
        piece_tokens: int | None = None,
    ) -> None:
        """``run_batch``: how a batch of jobs runs (default: ``worker.prefill_many`` on the batching thread,
        in chunk forwards of at most ``piece_tokens`` padded tokens: a batch whose callers have all gone
        stops before its next forward, so that bounds how long it runs on; None: ``prefill_batch`` chunks a
        forward whatever their length. ``serve --role all`` interleaves it with the decode rounds).
        ``sender``: holds handed-off KV for decode workers to pull (None: ``offer_handoff`` is ignored)."""
        self.worker = worker
        self.sender = sender
        self.batch_requests = Histogram(
            "pdllm_prefill_batch_requests",
            "Requests sharing one batched chunk prefill",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=registry,
        )
        self.batcher = PrefillBatcher(
            run_batch or functools.partial(worker.prefill_many, max_tokens=piece_tokens),
            batching,
            on_batch=self.batch_requests.observe,
        )
        # Chunk-level reuse: "hit" = step-3 KV found in the KV tier, "computed" = prefilled now.
        self.chunks = Counter(
            "pdllm_prefill_chunks",
            "Chunks seen by prefill, by where their KV came from",
            ["result"],
            registry=registry,
        )
        self.tokens = Counter("pdllm_prefill_context_tokens", "Context tokens prefilled", registry=registry)
        self.written = Counter(
            "pdllm_prefill_chunks_written",
            "Chunk KV values handed to the KV tier after selection (--kv-write-policy)",
            registry=registry,
        )

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillResponse:
        cancelled = termination_event(context)
        with bind_request_id(request.request_id):
            try:
                cfg = engine_config(request.method, self.worker.config)
                gen = generation_config(request.generation)
                job = self.worker.job(
                    list(request.context_ids),
                    list(request.question_ids),
                    gen,
                    list(request.instruction_ids) or None,
                    config=cfg,
                )
            except ValueError as exc:
                raise PdllmError(str(exc), code=grpc.StatusCode.INVALID_ARGUMENT) from exc
            # The answer carries handles, not KV: the selection lets its chunk KV go once written.
            offer = request.offer_handoff and self.sender is not None
            job = dataclasses.replace(job, keep_bank=False, offer_handoff=offer)
            try:
                sel, queue_s = self.batcher.submit(job, cancelled)
            except CancelledError as exc:
                raise PdllmError("prefill cancelled by the caller", code=grpc.StatusCode.CANCELLED) from exc
            except ValueError as exc:
                raise PdllmError(str(exc), code=grpc.StatusCode.INVALID_ARGUMENT) from exc
        self.chunks.labels("hit").inc(sel.trace.cache_hits)
        self.chunks.labels("computed").inc(sel.trace.cache_misses)
        self.written.inc(sel.trace.chunks_written)
        self.tokens.inc(len(request.context_ids))
        return self._response(sel, cfg, queue_s)

    def _response(self, sel: Selection, cfg: EngineConfig, queue_s: float) -> wpb.PrefillResponse:
        spec = model_kv_spec(self.worker.model, sel.position_scheme, cfg.chunk_size)
        chosen = set(sel.selected)
        scores = []
        for s in sel.scores:
            n = len(sel.request.chunks[s.chunk])
            kept = (min(cfg.top_b, n) if cfg.top_b else n) if s.chunk in chosen else 0
            scores.append(
                pb.ChunkScore(
                    chunk_id=s.chunk,
                    self_information=s.s_i,
                    pseudo_label=s.s_p,
                    total=s.total,
                    selected=s.chunk in chosen,
                    num_tokens=n,
                    kept_tokens=kept,
                )
            )
        handles = [
            wpb.ChunkHandle(
                key=sel.keys[i],
                chunk_id=i,
                token_ids=sel.request.chunks[i],
                positions=list(range(len(sel.request.chunks[i]))),
            )
            for i in sel.selected
        ]
        t = sel.trace.timings
        timings = pb.PhaseTimings(
            queue_s=queue_s,
            prefill_s=t.get("prefill", 0.0),
            score_s=t.get("score", 0.0),
            select_s=t.get("select", 0.0),
            build_s=t.get("handoff_build", 0.0),
        )
        peak, kind = sel.meter.peak()
        handoff = self._offer(sel, cfg)
        return wpb.PrefillResponse(
            handoff=handoff,
            kv_spec=spec,
            selected=handles,
            chunk_scores=scores,
            timings=timings,
            cache_hits=sel.trace.cache_hits,
            cache_misses=sel.trace.cache_misses,
            peak_memory_bytes=int(peak or 0),
            memory_kind=kind,
        )

    def _offer(self, sel: Selection, cfg: EngineConfig) -> wpb.KvHandoff | None:
        """Hold the selection's handoff KV for a pull (None: none was made, or the sender is full)."""
        h = sel.handoff
        if h is None or self.sender is None:
            return None
        template = wpb.KvHandoff(
            payload=h.payload,
            segment_lens=h.segment_lens,
            instruction_len=h.instruction_len,
            query_start=h.query_start,
            kv_spec=model_kv_spec(self.worker.model, h.position_scheme, cfg.chunk_size),
        )
        sel.handoff = None  # the sender owns the tensor now
        return self.sender.offer(h.kv, template)
