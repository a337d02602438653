"""The decode worker's gRPC face: ``pdllm.v1.Decode`` checks a request, turns it into a
:class:`~.request.DecodeRequest` for the scheduler (``scheduler.py``) and streams its partial outputs and
result back.

A pdllm request's static KV is built from its chunks' token ids (full-mask / chunk-query), read from the
KV tier (chunk-only; recomputed on a miss), or pulled from the prefill worker that built it (a ``handoff``;
checked against this worker's model first, FAILED_PRECONDITION on a mismatch; rebuilt if the pull fails).
Its pool pages are reserved for what the build keeps: the instruction and, per chunk, all its tokens or
top-B's B (``static_tokens``).
A vanilla request carries its whole prompt. What session the request then becomes in the batched rounds is
decided in one place, ``sessions.py``, from the model family, the method and the decode policy; what a block-diffusion model does not run is INVALID_ARGUMENT naming the option
(``request_checks.check_block_diffusion``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from pdllm.decode_service.handoff import start_pull, use_pulled
from pdllm.decode_service.kv_receiver import KvReceiver
from pdllm.decode_service.policies import CachePolicy, DecodePolicyConfig
from pdllm.decode_service.request import DecodeRequest, Final, Partial, Started, StaticDecode
from pdllm.decode_service.request_checks import check_block_diffusion, check_policy_family, check_token_ids
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.sessions import SessionMaker, rounds_policy
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.chunk_store import position_scheme
from pdllm.shared.config import EngineConfig
from pdllm.shared.decode_policy import DyLLMConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.kv_transfer.payload import (
    CHUNK_KV,
    DECODE_KV,
    check_kv_spec,
    decode_kv_scheme,
    model_kv_spec,
)
from pdllm.shared.layout import Request, decode_layout, kept_count
from pdllm.shared.rpc.convert import decode_policy_config, engine_config, generation_config
from pdllm.shared.rpc.errors import PdllmError
from pdllm.shared.rpc.logs import bind_request_id
from pdllm.shared.rpc.server import termination_event
from pdllm.shared.stepwise import Steps, drain

# A decode result's peak memory: its KV pages in the pool plus its build's transient growth (scheduler).
DECODE_MEMORY_KIND = "kv-pages-plus-build"


def policy_trace(cache: dict[str, int | str]) -> pb.DecodePolicyTrace:
    """The trace's ``decode_policy`` from a result's policy counters (none: a session without a policy);
    counters without a field of their own (DyLLM's, FOCUS's) go to its ``counters`` map."""
    if not cache:
        return pb.DecodePolicyTrace(policy="none")
    named = pb.DecodePolicyTrace.DESCRIPTOR.fields_by_name
    fields = {k: v for k, v in cache.items() if k in named and k != "counters"}
    counters = {k: int(v) for k, v in cache.items() if k not in fields}
    return pb.DecodePolicyTrace(**fields, counters=counters)  # type: ignore[arg-type]


def static_tokens(request: wpb.DecodeRequest, top_b: int | None) -> int:
    """Static KV tokens a pdllm request's build writes into its pages: the instruction and what top-B
    retention keeps of each chunk (all of it when ``top_b`` is None), so it reserves no page it never fills."""
    kept = sum(kept_count(len(c.token_ids), top_b) for c in request.chunks)
    return len(request.instruction_ids) + kept


def _request(request: wpb.DecodeRequest) -> Request:
    """The request's instruction, chunks (the selected ones, in the order sent) and query."""
    chunks = [list(h.token_ids) for h in request.chunks]
    return Request(instruction=list(request.instruction_ids), chunks=chunks, query=list(request.question_ids))


class DecodeServicer(workers_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        worker: DecodeWorker,
        scheduler: DecodeScheduler,
        max_vanilla_tokens: int = 0,
        receiver: KvReceiver | None = None,
    ) -> None:
        """``max_vanilla_tokens``: longest prompt a vanilla request may have (0: no limit). Vanilla forwards
        the whole prompt every step, and one step cannot be stopped halfway: beyond some length a
        cancelled or timed-out request would hold the device for minutes. ``receiver``: pulls KV handed
        off by prefill workers (None: a request's handoff is ignored and its KV built here)."""
        self.worker = worker
        self.scheduler = scheduler
        self.max_vanilla_tokens = max_vanilla_tokens
        self.receiver = receiver
        page_size = 64 if scheduler is None else scheduler.pool.page_size  # None: tests that stop earlier
        self.sessions = SessionMaker(worker.model, page_size)

    def Decode(
        self, request: wpb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[wpb.DecodeResponse]:
        with bind_request_id(request.request_id):
            try:
                gen = generation_config(request.generation)
                cfg = engine_config(request.method, self.worker.config)
                policy = decode_policy_config(request.decode_policy)
            except ValueError as exc:
                raise PdllmError(str(exc), code=grpc.StatusCode.INVALID_ARGUMENT) from exc
            check_token_ids(request, self.worker.model.config.vocab_size)
            sessions = self.sessions
            if sessions.block_diffusion:
                check_block_diffusion(request.method.method, cfg, gen, policy, self.worker.model)
            else:
                check_policy_family(policy, self.worker.model)
            start_steps: Callable[[int], Steps[StaticDecode]] | None = None
            kv_tokens = 0
            if request.method.method == "vanilla":
                ids = self._vanilla_prompt(request)
                start: Callable[[], Started] = lambda: sessions.vanilla(ids, gen, policy)  # noqa: E731
                cache_tokens = sessions.pool_slots(policy, len(ids), gen, static=False)
            elif sessions.block_diffusion:  # its block-causal cache is built here: no handoff pulled
                start = lambda: sessions.sdar(_request(request), gen, policy)  # noqa: E731
                prompt_tokens = len(request.instruction_ids) + len(request.question_ids)
                prompt_tokens += sum(len(c.token_ids) for c in request.chunks)
                cache_tokens = sessions.pool_slots(policy, prompt_tokens, gen, static=True)
            else:
                if not request.chunks:
                    raise PdllmError(
                        "pdllm decode needs at least one chunk", code=grpc.StatusCode.INVALID_ARGUMENT
                    )
                self._check_identity(request, cfg)
                start = lambda: self._start_pdllm(request, gen, cfg, entry, policy)  # noqa: E731
                cache_policy = rounds_policy(policy)
                start_steps = lambda layers: self._pdllm_steps(  # its build may run in pieces
                    request, gen, cfg, entry, layers, cache_policy
                )  # noqa: E731
                kv_tokens = static_tokens(request, cfg.top_b)
                cache_tokens = sessions.pool_slots(policy, len(request.question_ids), gen, static=True)
            entry = DecodeRequest(
                request.request_id,
                start,
                termination_event(context),
                request.stream_partials,
                kv_tokens,
                start_steps=start_steps,
                cache_tokens=cache_tokens,
            )
            if self.receiver is not None and kv_tokens and request.HasField("handoff"):
                pool = self.scheduler.pool  # a decode KV lands in the entry's reserved pages
                entry.fetch = lambda: start_pull(self.receiver, pool, request.handoff, entry.pages)  # type: ignore[arg-type]
            self.scheduler.submit(entry)
            for event in entry.stream():
                if isinstance(event, Partial):
                    yield wpb.DecodeResponse(partial=self._partial(request, gen, event))
                elif isinstance(event, Final):
                    yield wpb.DecodeResponse(final=self._final(event, entry))

    # ------------------------------------------------------------------ sessions (scheduler thread)
    def _vanilla_prompt(self, request: wpb.DecodeRequest) -> list[int]:
        """BOS (if the model has one), instruction, context and question; refused past the vanilla limit."""
        if not request.context_ids:
            raise PdllmError("vanilla decode needs context_ids", code=grpc.StatusCode.INVALID_ARGUMENT)
        prompt = len(request.instruction_ids) + len(request.context_ids) + len(request.question_ids)
        if self.max_vanilla_tokens and prompt > self.max_vanilla_tokens:
            raise PdllmError(
                f"vanilla decoding is limited to {self.max_vanilla_tokens} prompt tokens on this "
                f"worker (--max-vanilla-tokens), got {prompt}; use method 'pdllm' for long contexts",
                code=grpc.StatusCode.INVALID_ARGUMENT,
            )
        bos = self.worker.model.config.bos_token_id
        ids = [*request.instruction_ids, *request.context_ids, *request.question_ids]
        return ids if bos is None else [bos, *ids]

    def _start_pdllm(
        self,
        request: wpb.DecodeRequest,
        gen: GenerationConfig,
        cfg: EngineConfig,
        entry: DecodeRequest,
        policy: DecodePolicyConfig,
    ) -> Started:
        """The whole build: the request ready to join the rounds."""
        built = drain(self._pdllm_steps(request, gen, cfg, entry, None, rounds_policy(policy)))
        entry.cache_stats, entry.kv_source = built.cache_stats, built.kv_source
        return built

    def _check_identity(self, request: wpb.DecodeRequest, cfg: EngineConfig) -> None:
        """FAILED_PRECONDITION for chunk handles or a handoff made by another model, dtype or layout."""
        rid = request.request_id
        model = self.worker.model
        if request.HasField("kv_spec"):  # handles carry token ids; only the model must be the same
            ours = model_kv_spec(model, request.kv_spec.position_scheme, cfg.chunk_size)
            ours.dtype = request.kv_spec.dtype
            check_kv_spec(request.kv_spec, ours, "the chunk handles", rid)
        if request.HasField("handoff"):
            payload = request.handoff.payload
            if payload == DECODE_KV and cfg.kv_mode != "chunk-only":
                scheme = decode_kv_scheme(cfg.kv_mode)
            elif payload == CHUNK_KV and cfg.kv_mode == "chunk-only":
                scheme = position_scheme(cfg.prefill_attention)
            else:
                raise PdllmError(
                    f"a {payload!r} handoff does not fit kv_mode {cfg.kv_mode!r}",
                    code=grpc.StatusCode.FAILED_PRECONDITION,
                )
            ours = model_kv_spec(model, scheme, cfg.chunk_size)
            check_kv_spec(request.handoff.kv_spec, ours, "the handed-off KV", rid)

    def _pdllm_steps(
        self,
        request: wpb.DecodeRequest,
        gen: GenerationConfig,
        cfg: EngineConfig,
        entry: DecodeRequest,
        layers_per_step: int | None = None,
        cache_policy: CachePolicy | DyLLMConfig | None = None,
    ) -> Steps[StaticDecode]:
        """The session's build, in pieces of ``layers_per_step`` layers of its forward (None: one piece);
        from the request's pulled KV when its handoff arrived (decode-kv: no build, the KV is in its pages).
        ``cache_policy``: a batched decode policy the session then runs under."""
        tokens = _request(request)
        chunks = tokens.chunks
        layout = decode_layout(tokens, list(range(len(chunks))), gen.gen_length)
        pulled = use_pulled(entry.received, layout, entry.kv_tokens)
        if pulled.static is not None:
            return StaticDecode(
                tokens.query, pulled.static, gen, kv_source=pulled.source, cache_policy=cache_policy
            )
        local, stats = pulled.local, (0, 0)
        if pulled.source != "handoff" and cfg.kv_mode == "chunk-only":
            local, hits = self.worker.chunk_kv(chunks, cfg)
            stats = (hits, len(chunks) - hits)
        static = yield from self.worker.build_steps(tokens, layout, cfg, local, layers_per_step)
        return StaticDecode(tokens.query, static, gen, stats, pulled.source, cache_policy)

    # ------------------------------------------------------------------ messages
    def _partial(self, request: wpb.DecodeRequest, gen: GenerationConfig, p: Partial) -> pb.PartialOutput:
        total = gen.gen_length if gen.threshold is not None else min(gen.steps, gen.gen_length)
        return pb.PartialOutput(
            request_id=request.request_id,
            step=p.step,
            total_steps=total,
            block_index=p.block,
            token_ids=p.tokens,
            unmasked=sum(1 for t in p.tokens if t >= 0),
        )

    def _final(self, event: Final, entry: DecodeRequest) -> wpb.DecodeResult:
        result = event.result
        eos = self.worker.model.config.eos_token_id
        hits, misses = entry.cache_stats
        return wpb.DecodeResult(
            token_ids=result.token_ids,
            finish_reason="eos" if eos is not None and eos in result.raw_tokens else "length",
            steps=result.steps,
            timings=pb.PhaseTimings(
                queue_s=event.queue_s, build_s=event.build_s, decode_s=result.decode_seconds
            ),
            cache_hits=hits,
            cache_misses=misses,
            peak_memory_bytes=event.peak_bytes,
            memory_kind=DECODE_MEMORY_KIND,
            kv_source=entry.kv_source,
            handoff_s=entry.received.seconds if entry.received is not None else 0.0,
            decode_policy=policy_trace(result.cache),
        )
