"""The decode worker's gRPC face: ``pdllm.v1.Decode`` turns a request into a job for the scheduler
(``scheduler.py``) and streams its partial outputs and result back.

What a job runs:

- **pdllm** (Dream / LLaDA): the static KV of the selected chunks is built from their token ids
  (full-mask / chunk-query), read from the KV tier (chunk-only; recomputed on a miss), or pulled from the
  prefill worker that built it (a ``handoff``; checked against this worker's model first,
  FAILED_PRECONDITION on a mismatch; rebuilt if the pull fails). The session then joins the batched rounds.
- **vanilla** (Dream / LLaDA): the whole prompt becomes the session's local rows, no static KV; it joins
  the same rounds.
- A caching decode policy (prefix / dual cache, Sparse-dLLM, Polestar-Cache) keeps its cache of local
  K/V in pool pages after the static KV; its session joins the rounds too (``policy_rounds.py``).
- Still outside the rounds: DyLLM (its loop, stepped alone, ``policy_sessions.py``), FOCUS (its packed
  groups, ``focus_rounds.py``) and every request on an SDAR (block-diffusion) model, which runs exact
  block diffusion stepped alone (``shared/generation/sdar_decode.py``; no pool pages, no handoff; what it
  does not run is INVALID_ARGUMENT, ``request_checks.check_block_diffusion``).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pdllm.decode_service.focus_rounds import FocusGroups, FocusMember
from pdllm.decode_service.handoff import start_pull, use_pulled
from pdllm.decode_service.jobs import DecodeJob, Final, Partial, StaticDecode
from pdllm.decode_service.kv_pool import PooledKV
from pdllm.decode_service.policy_rounds import BATCHED_POLICIES, cache_slots
from pdllm.decode_service.policy_sessions import (
    pooled_static,
    static_compute_skip_logits,
    static_local_rows,
)
from pdllm.decode_service.request_checks import check_block_diffusion, check_token_ids
from pdllm.decode_service.scheduler import DecodeScheduler
from pdllm.decode_service.worker import DecodeWorker
from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from pdllm.protos.pdllm.v1 import workers_pb2 as wpb
from pdllm.protos.pdllm.v1 import workers_pb2_grpc
from pdllm.shared.chunk_store import position_scheme
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation import sdar_decode
from pdllm.shared.generation.block_diffusion import BlockDiffusionSession
from pdllm.shared.generation.policies import CachePolicy, DecodePolicyConfig, make_policy
from pdllm.shared.generation.policies.base import vanilla_local_rows
from pdllm.shared.generation.policies.compute_skip import compute_skip_session, vanilla_compute_skip_logits
from pdllm.shared.generation.sampler import DenoiseSession, GenerationConfig
from pdllm.shared.generation.vanilla import prompt_tensor
from pdllm.shared.kv_transfer.payload import (
    CHUNK_KV,
    DECODE_KV,
    check_kv_spec,
    decode_kv_scheme,
    model_kv_spec,
)
from pdllm.shared.kv_transfer.receiver import KvReceiver
from pdllm.shared.layout import Request, decode_layout
from pdllm.shared.model.attention import DenseAttention
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
        self.focus_groups = FocusGroups(worker.model)  # FOCUS requests, batched (scheduler thread only)

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
            sdar = sdar_decode.is_block_diffusion(self.worker.model)
            if sdar:
                check_block_diffusion(request.method.method, cfg, gen, policy, self.worker.model)
            cache_tokens = 0
            if request.method.method == "vanilla":
                if not request.context_ids:
                    raise PdllmError(
                        "vanilla decode needs context_ids", code=grpc.StatusCode.INVALID_ARGUMENT
                    )
                prompt = len(request.instruction_ids) + len(request.context_ids) + len(request.question_ids)
                if self.max_vanilla_tokens and prompt > self.max_vanilla_tokens:
                    raise PdllmError(
                        f"vanilla decoding is limited to {self.max_vanilla_tokens} prompt tokens on this "
                        f"worker (--max-vanilla-tokens), got {prompt}; use method 'pdllm' for long contexts",
                        code=grpc.StatusCode.INVALID_ARGUMENT,
                    )
                start = lambda: self._vanilla_session(request, gen, policy, job)  # noqa: E731
                start_steps = None
                kv_tokens = 0
                if not sdar and make_policy(policy) is not None:  # its cache of local rows in pool pages
                    cache_tokens = cache_slots(prompt + self._bos_tokens(), gen)
            else:
                if not request.chunks:
                    raise PdllmError(
                        "pdllm decode needs at least one chunk", code=grpc.StatusCode.INVALID_ARGUMENT
                    )
                self._check_identity(request, cfg)
                batched = make_policy(policy) if policy.name in BATCHED_POLICIES else None
                start = lambda: drain(self._pdllm_steps(request, gen, cfg, job, None, batched))  # noqa: E731
                start_steps = lambda layers: self._pdllm_steps(request, gen, cfg, job, layers, batched)  # noqa: E731
                if policy.caches and batched is None:  # stepped alone: its build ends in a policy session
                    start = lambda: self._policy_session(request, gen, cfg, job, policy)  # noqa: E731
                    start_steps = None
                # Pages even for a policy session: the pool's budget bounds it, and a pulled KV lands there.
                kv_tokens = len(request.instruction_ids) + sum(len(c.token_ids) for c in request.chunks)
                if batched is not None:
                    cache_tokens = cache_slots(len(request.question_ids), gen)
                if sdar:  # stepped alone over a cache of its own: no pool pages, so no handoff pulled
                    start = lambda: self._sdar_session(request, gen, policy, job)  # noqa: E731
                    start_steps, kv_tokens = None, 0
            job = DecodeJob(
                request.request_id,
                start,
                termination_event(context),
                request.stream_partials,
                kv_tokens,
                start_steps=start_steps,
                cache_tokens=cache_tokens,
            )
            if self.receiver is not None and kv_tokens and request.HasField("handoff"):
                pool = self.scheduler.pool  # a decode KV lands in the job's reserved pages
                job.fetch = lambda: start_pull(self.receiver, pool, request.handoff, job.pages)  # type: ignore[arg-type]
            self.scheduler.submit(job)
            for event in job.stream():
                if isinstance(event, Partial):
                    yield wpb.DecodeResponse(partial=self._partial(request, gen, event))
                elif isinstance(event, Final):
                    yield wpb.DecodeResponse(final=self._final(event, job))

    # ------------------------------------------------------------------ sessions (scheduler thread)
    def _bos_tokens(self) -> int:
        return int(self.worker.model.config.bos_token_id is not None)

    def _vanilla_session(
        self, request: wpb.DecodeRequest, gen: GenerationConfig, policy: DecodePolicyConfig, job: DecodeJob
    ) -> StaticDecode | DenoiseSession | BlockDiffusionSession | FocusMember:
        """A vanilla request's session: its whole prompt as local rows in the rounds (attending to its own
        rows only, no static KV), under its caching policy if any; FOCUS, DyLLM and SDAR have their own."""
        model = self.worker.model
        bos = [model.config.bos_token_id] if model.config.bos_token_id is not None else []
        ids = bos + list(request.instruction_ids) + list(request.context_ids) + list(request.question_ids)
        prompt = prompt_tensor(model, ids)
        if sdar_decode.is_block_diffusion(model):  # generate_vanilla's block diffusion (none / focus)
            if policy.name == "focus":  # batched with the worker's other FOCUS requests
                return self.focus_groups.join_block_diffusion(
                    prompt, gen, policy.focus_config(), job.cancelled
                )
            return sdar_decode.block_session(model, prompt, gen, policy)
        if policy.name == "focus":  # one packed step with the worker's other FOCUS requests per turn
            local, positions = vanilla_local_rows(model.config.mask_token_id, prompt, gen)
            focus = policy.focus_config()
            return self.focus_groups.join(
                local, positions, prompt.numel(), DenseAttention(), gen, focus, job.cancelled
            )
        if policy.skips_compute:  # DyLLM: generate_vanilla's loop, a step per scheduler turn
            graphs = self.worker.cuda_graph  # DyLLM replays its sparse steps as the worker replays rounds
            return compute_skip_session(vanilla_compute_skip_logits(model, prompt, gen, policy, graphs))
        return StaticDecode(ids, None, gen, cache_policy=make_policy(policy))

    def _policy_session(
        self,
        request: wpb.DecodeRequest,
        gen: GenerationConfig,
        cfg: EngineConfig,
        job: DecodeJob,
        policy: DecodePolicyConfig,
    ) -> DenoiseSession:
        """A pdllm session under a compute-skipping decode policy: the build, then the engine's policy loop
        over its static KV (``static_compute_skip_logits``, the in-process engine's very path), stepped
        alone; FOCUS's joins the worker's batched FOCUS group."""
        built = drain(self._pdllm_steps(request, gen, cfg, job))
        static = built.static
        if isinstance(static, PooledKV):  # a handoff landed in the job's pages
            assert job.received is not None
            static = pooled_static(self.scheduler.pool, job.pages, static, job.received.handoff)
        job.cache_stats, job.kv_source = built.cache_stats, built.kv_source
        attention = self.worker.decode_attention
        model, query = self.worker.model, built.query
        if policy.name == "focus":  # batched with the worker's other FOCUS requests (focus_rounds.py)
            local, positions, inner = static_local_rows(model, query, static, gen, attention, None)
            focus = policy.focus_config()
            return self.focus_groups.join(local, positions, len(query), inner, gen, focus, job.cancelled)
        # Caching policies run in the batched rounds (BATCHED_POLICIES); the compute-skipping ones come here.
        assert policy.skips_compute, f"decode policy {policy.name!r} does not take this path"
        return compute_skip_session(
            static_compute_skip_logits(
                model, query, static, gen, policy, attention, cuda_graph=self.worker.cuda_graph
            )
        )

    def _sdar_session(
        self, request: wpb.DecodeRequest, gen: GenerationConfig, policy: DecodePolicyConfig, job: DecodeJob
    ) -> BlockDiffusionSession | FocusMember:
        """A pdllm request on SDAR: exact block diffusion over ``[instruction, chunks, query]`` (plain or under
        FOCUS), the in-process engine's steps 6-7 (``sdar_decode.session``), its block-causal prefix built
        from the token ids; under FOCUS it joins the worker's batched FOCUS requests."""
        req, model = _request(request), self.worker.model
        layout = decode_layout(req, list(range(len(req.chunks))), gen.gen_length)
        if policy.name != "focus":
            return sdar_decode.session(model, req, layout, gen, policy)
        prefix = sdar_decode.build_prefix(model, req, layout, gen)
        prompt = sdar_decode.selected_prompt_tensor(model, req, layout)
        return self.focus_groups.join_block_diffusion(
            prompt, gen, policy.focus_config(), job.cancelled, prefix
        )

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
        job: DecodeJob,
        layers_per_step: int | None = None,
        cache_policy: CachePolicy | None = None,
    ) -> Steps[StaticDecode]:
        """The session's build, in pieces of ``layers_per_step`` layers of its forward (None: one piece);
        from the job's pulled KV when its handoff arrived (decode-kv: no build, the KV is in its pages).
        ``cache_policy``: a batched decode policy the session then runs under."""
        req = _request(request)
        chunks = req.chunks
        layout = decode_layout(req, list(range(len(chunks))), gen.gen_length)
        pulled = use_pulled(job.received, layout, job.kv_tokens)
        if pulled.static is not None:
            return StaticDecode(
                req.query, pulled.static, gen, kv_source=pulled.source, cache_policy=cache_policy
            )
        local, stats = pulled.local, (0, 0)
        if pulled.source != "handoff" and cfg.kv_mode == "chunk-only":
            local, hits = self.worker.chunk_kv(chunks, cfg)
            stats = (hits, len(chunks) - hits)
        static = yield from self.worker.build_steps(req, layout, cfg, local, layers_per_step)
        return StaticDecode(req.query, static, gen, stats, pulled.source, cache_policy)

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

    def _final(self, event: Final, job: DecodeJob) -> wpb.DecodeResult:
        result = event.result
        eos = self.worker.model.config.eos_token_id
        hits, misses = job.cache_stats
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
            kv_source=job.kv_source,
            handoff_s=job.received.seconds if job.received is not None else 0.0,
            decode_policy=policy_trace(result.cache),
        )
